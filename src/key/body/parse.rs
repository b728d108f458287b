//! The body formats the layer reads, how it finds the field in each, and [`Problem`], the
//! layer's own answers.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::field::Settings;

/// Why the layer answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Problem {
    TooLarge,
    Unreadable,
    Unsupported,
    NotJsonObject,
    Missing,
    Twice,
    NotText,
    /// Number field `.0` ([`Settings::numbers`]) sent twice.
    NumberTwice(usize),
    /// Number field `.0` present but not a non-negative integer.
    NotNumber(usize),
}

impl Problem {
    pub(super) fn response(self, settings: &Settings) -> Response<Full<Bytes>> {
        let field = &settings.field;
        let number = |index: usize| settings.numbers.get(index).map_or("", |name| &**name);
        let (status, text) = match self {
            Problem::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is over {} bytes", settings.limit),
            ),
            Problem::Unreadable => (
                StatusCode::BAD_REQUEST,
                "the request body could not be read".to_owned(),
            ),
            Problem::Unsupported => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send a form (application/x-www-form-urlencoded) or JSON (application/json), \
                 without a Content-Encoding"
                    .to_owned(),
            ),
            Problem::NotJsonObject => (
                StatusCode::BAD_REQUEST,
                "the request body is not a JSON object".to_owned(),
            ),
            Problem::Missing => (
                StatusCode::BAD_REQUEST,
                format!("the request body has no field {field:?}, or it is empty"),
            ),
            Problem::Twice => (
                StatusCode::BAD_REQUEST,
                format!("the request body has the field {field:?} more than once"),
            ),
            Problem::NotText => (
                StatusCode::BAD_REQUEST,
                format!("the field {field:?} is neither a string nor a number"),
            ),
            Problem::NumberTwice(index) => (
                StatusCode::BAD_REQUEST,
                format!(
                    "the request body has the field {:?} more than once",
                    number(index)
                ),
            ),
            Problem::NotNumber(index) => (
                StatusCode::BAD_REQUEST,
                format!(
                    "the field {:?} is not a whole number of at least 0",
                    number(index)
                ),
            ),
        };
        let reason = status.canonical_reason().unwrap_or("Error");
        let mut response = Response::new(Full::new(Bytes::from(format!("{reason}: {text}\n"))));
        *response.status_mut() = status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
    }
}

/// The body formats the layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Form,
    Json,
}

impl Format {
    /// The format of a request with `headers`: one `Content-Type` the layer reads (as axum's
    /// `Form` and `Json` do: parameters ignored, `application/*+json` is JSON), and no
    /// `Content-Encoding` other than `identity`.
    pub(super) fn of(headers: &HeaderMap) -> Option<Format> {
        let encoded = headers.get_all(CONTENT_ENCODING).iter().any(|coding| {
            !coding
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"identity")
        });
        let mut types = headers.get_all(CONTENT_TYPE).iter();
        let (Some(content_type), None, false) = (types.next(), types.next(), encoded) else {
            return None;
        };
        let essence = content_type.to_str().ok()?.split(';').next()?.trim();
        let (kind, subtype) = essence.split_once('/')?;
        if !kind.eq_ignore_ascii_case("application") {
            return None;
        }
        let subtype = subtype.to_ascii_lowercase();
        if subtype == "x-www-form-urlencoded" {
            Some(Format::Form)
        } else if subtype == "json" || subtype.ends_with("+json") {
            Some(Format::Json)
        } else {
            None
        }
    }

    /// The raw value of the key field `key` in `body`, and the value of each field of
    /// `numbers` (`None`: absent), read in one pass.
    pub(super) fn fields(
        self,
        body: &[u8],
        key: &str,
        numbers: &[Arc<str>],
    ) -> Result<Read, Problem> {
        match self {
            Format::Form => form_fields(body, key, numbers),
            Format::Json => json_fields(body, key, numbers),
        }
    }
}

/// What the layer read of a body: the key field's raw value and the number fields' values,
/// in the order the layer names them.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Read {
    pub(super) key: String,
    pub(super) numbers: Vec<Option<u64>>,
}

/// Keeps `value` as number field `index`'s, unless it was there already.
fn keep(numbers: &mut [Option<u64>], index: usize, value: u64) -> Result<(), Problem> {
    match numbers[index].replace(value) {
        Some(_) => Err(Problem::NumberTwice(index)),
        None => Ok(()),
    }
}

/// The fields of a form, percent-decoded as axum's `Form` decodes them (`+` is a space, bytes
/// that are not UTF-8 become U+FFFD); a number field is decimal digits.
fn form_fields(body: &[u8], key: &str, numbers: &[Arc<str>]) -> Result<Read, Problem> {
    let mut found = None;
    let mut values = vec![None; numbers.len()];
    for (name, value) in form_urlencoded::parse(body) {
        if name == key {
            if found.is_some() {
                return Err(Problem::Twice);
            }
            found = Some(value);
        } else if let Some(index) = numbers.iter().position(|n| **n == *name) {
            let digits = value.bytes().all(|b| b.is_ascii_digit());
            let number = value.parse().ok().filter(|_| digits);
            keep(&mut values, index, number.ok_or(Problem::NotNumber(index))?)?;
        }
    }
    let key = found.ok_or(Problem::Missing)?.into_owned();
    Ok(Read {
        key,
        numbers: values,
    })
}

/// The fields of a JSON object: the key a string, or a number as its text; a number field a
/// non-negative integer, kept as it is.
fn json_fields(body: &[u8], key: &str, numbers: &[Arc<str>]) -> Result<Read, Problem> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let found = json
        .deserialize_map(TopLevel { key, numbers })
        .map_err(|_| Problem::NotJsonObject)?;
    json.end().map_err(|_| Problem::NotJsonObject)?;
    found
}

/// Walks a JSON object's fields, skipping all but the key's and the numbers' values without
/// keeping them.
struct TopLevel<'a> {
    key: &'a str,
    numbers: &'a [Arc<str>],
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = Result<Read, Problem>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found: Option<Result<String, Problem>> = None;
        let mut values = vec![None; self.numbers.len()];
        let mut problem = None;
        let seed = Which {
            key: self.key,
            numbers: self.numbers,
        };
        while let Some(which) = map.next_key_seed(seed.clone())? {
            match which {
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
                Field::Key => {
                    let value = map.next_value::<serde_json::Value>()?;
                    found = Some(match (found, value) {
                        (Some(_), _) => Err(Problem::Twice),
                        (None, serde_json::Value::String(text)) => Ok(text),
                        (None, serde_json::Value::Number(number)) => Ok(number.to_string()),
                        (None, _) => Err(Problem::NotText),
                    });
                }
                Field::Number(index) => {
                    let value = map.next_value::<serde_json::Value>()?;
                    let kept = match value.as_u64() {
                        Some(number) => keep(&mut values, index, number),
                        None => Err(Problem::NotNumber(index)),
                    };
                    problem = problem.or(kept.err());
                }
            }
        }
        let key = found.unwrap_or(Err(Problem::Missing));
        Ok(match problem {
            Some(problem) => Err(problem),
            None => key.map(|key| Read {
                key,
                numbers: values,
            }),
        })
    }
}

/// Which of the layer's fields a JSON object's key names, found without keeping the key.
#[derive(Clone)]
struct Which<'a> {
    key: &'a str,
    numbers: &'a [Arc<str>],
}

/// A JSON object's key, as [`Which`] finds it.
enum Field {
    Key,
    Number(usize),
    Other,
}

impl<'de> DeserializeSeed<'de> for Which<'_> {
    type Value = Field;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Field, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Which<'_> {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Field, E> {
        if name == self.key {
            return Ok(Field::Key);
        }
        let number = self.numbers.iter().position(|n| **n == *name);
        Ok(number.map_or(Field::Other, Field::Number))
    }
}

/// The key field `name` of a form (tests: no number fields).
#[cfg(test)]
fn form_field(body: &[u8], name: &str) -> Result<String, Problem> {
    form_fields(body, name, &[]).map(|read| read.key)
}

/// The key field `name` of a JSON object (tests: no number fields).
#[cfg(test)]
fn json_field(body: &[u8], name: &str) -> Result<String, Problem> {
    json_fields(body, name, &[]).map(|read| read.key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|&(name, value)| {
                (
                    http::HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    fn of(pairs: &[(&'static str, &'static str)]) -> Option<Format> {
        Format::of(&headers(pairs))
    }

    #[test]
    fn reads_forms_and_json_as_axum_does_and_nothing_else() {
        let form = "application/x-www-form-urlencoded";
        assert_eq!(of(&[("content-type", form)]), Some(Format::Form));
        assert_eq!(
            of(&[(
                "content-type",
                "Application/X-WWW-Form-Urlencoded; charset=UTF-8"
            )]),
            Some(Format::Form)
        );
        assert_eq!(
            of(&[("content-type", "application/json")]),
            Some(Format::Json)
        );
        assert_eq!(
            of(&[("content-type", "application/vnd.api+json")]),
            Some(Format::Json)
        );
        for other in [
            "text/plain",
            "application/grpc",
            "multipart/form-data",
            "json",
        ] {
            assert_eq!(of(&[("content-type", other)]), None, "{other}");
        }
        assert_eq!(of(&[]), None);
        assert_eq!(
            of(&[("content-type", form), ("content-encoding", "gzip")]),
            None
        );
        assert_eq!(
            of(&[("content-type", form), ("content-encoding", "identity")]),
            Some(Format::Form)
        );
        let mut two = headers(&[("content-type", form)]);
        two.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert_eq!(Format::of(&two), None);
    }

    #[test]
    fn takes_one_form_field_decoded() {
        let field = |body: &str| form_field(body.as_bytes(), "username");
        assert_eq!(field("password=x&username=ann").as_deref(), Ok("ann"));
        assert_eq!(field("username=ANN+%41%C3%A9").as_deref(), Ok("ANN Aé"));
        assert_eq!(field("username=%FF").as_deref(), Ok("\u{FFFD}"));
        assert_eq!(field("user=ann"), Err(Problem::Missing));
        assert_eq!(field(""), Err(Problem::Missing));
        assert_eq!(field("username=ann&username=bob"), Err(Problem::Twice));
    }

    #[test]
    fn takes_one_top_level_json_field() {
        let field = |body: &str| json_field(body.as_bytes(), "username");
        assert_eq!(field(r#"{"username": "ann"}"#).as_deref(), Ok("ann"));
        assert_eq!(
            field(r#"{"a": [1, {"username": "x"}], "username": "\u0041nn"}"#).as_deref(),
            Ok("Ann")
        );
        assert_eq!(field(r#"{"username": 42}"#).as_deref(), Ok("42"));
        assert_eq!(field(r#"{"username": -4.5}"#).as_deref(), Ok("-4.5"));
        assert_eq!(
            field(r#"{"user": "ann", "nested": {"username": "x"}}"#),
            Err(Problem::Missing)
        );
        for not_text in [
            r#"{"username": null}"#,
            r#"{"username": ["ann"]}"#,
            r#"{"username": true}"#,
        ] {
            assert_eq!(field(not_text), Err(Problem::NotText), "{not_text}");
        }
        assert_eq!(
            field(r#"{"username": "ann", "username": "bob"}"#),
            Err(Problem::Twice)
        );
        for broken in [
            "",
            "[]",
            r#""ann""#,
            r#"{"username": "ann""#,
            r#"{"username": "ann"} x"#,
        ] {
            assert_eq!(field(broken), Err(Problem::NotJsonObject), "{broken}");
        }
        // Deep values do not overflow the stack: skipped ones are walked without recursion,
        // and the field's own stops at serde_json's depth limit.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let skipped = format!(r#"{{"a": {deep}, "username": "ann"}}"#);
        assert_eq!(field(&skipped).as_deref(), Ok("ann"));
        let kept = format!(r#"{{"username": {deep}}}"#);
        assert_eq!(field(&kept), Err(Problem::NotJsonObject));
    }

    #[test]
    fn reads_a_key_and_numbers_in_one_pass_kept_as_they_are() {
        let numbers: Vec<Arc<str>> = vec!["max_tokens".into(), "n".into()];
        let json = |body: &str| json_fields(body.as_bytes(), "user", &numbers);
        assert_eq!(
            json(r#"{"user": "Ann", "max_tokens": 800, "messages": [{"n": 3}]}"#),
            Ok(Read {
                key: "Ann".into(),
                numbers: vec![Some(800), None],
            })
        );
        assert_eq!(
            json(r#"{"n": 18446744073709551615, "user": "a", "max_tokens": 0}"#),
            Ok(Read {
                key: "a".into(),
                numbers: vec![Some(0), Some(u64::MAX)],
            })
        );
        for not_number in [r#""800""#, "-1", "8.5", "1e3", "null", "[800]"] {
            let body = format!(r#"{{"user": "a", "max_tokens": {not_number}}}"#);
            assert_eq!(json(&body), Err(Problem::NotNumber(0)), "{body}");
        }
        assert_eq!(
            json(r#"{"user": "a", "n": 1, "n": 2}"#),
            Err(Problem::NumberTwice(1))
        );
        assert_eq!(json(r#"{"max_tokens": 1}"#), Err(Problem::Missing));
        let form = |body: &str| form_fields(body.as_bytes(), "user", &numbers);
        assert_eq!(
            form("max_tokens=0800&user=ANN"),
            Ok(Read {
                key: "ANN".into(),
                numbers: vec![Some(800), None],
            })
        );
        for not_number in ["", "+8", "-1", "8.0", "x", "99999999999999999999"] {
            let body = format!("user=a&max_tokens={not_number}");
            assert_eq!(form(&body), Err(Problem::NotNumber(0)), "{body}");
        }
        assert_eq!(form("user=a&n=1&n=1"), Err(Problem::NumberTwice(1)));
    }
}
