//! The body formats the layer reads, how it finds the field in each, and [`Problem`], the
//! layer's own answers.

use std::fmt;

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
}

impl Problem {
    pub(super) fn response(self, settings: &Settings) -> Response<Full<Bytes>> {
        let field = &settings.field;
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

    /// The raw value of field `name` in `body`.
    pub(super) fn field(self, body: &[u8], name: &str) -> Result<String, Problem> {
        match self {
            Format::Form => form_field(body, name),
            Format::Json => json_field(body, name),
        }
    }
}

/// Field `name` of a form, percent-decoded as axum's `Form` decodes it (`+` is a space, bytes
/// that are not UTF-8 become U+FFFD).
fn form_field(body: &[u8], name: &str) -> Result<String, Problem> {
    let mut found = None;
    for (key, value) in form_urlencoded::parse(body) {
        if key == name {
            if found.is_some() {
                return Err(Problem::Twice);
            }
            found = Some(value);
        }
    }
    found
        .map(|value| value.into_owned())
        .ok_or(Problem::Missing)
}

/// Field `name` of a JSON object: a string, or a number as its text.
fn json_field(body: &[u8], name: &str) -> Result<String, Problem> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let found = json
        .deserialize_map(TopLevel { name })
        .map_err(|_| Problem::NotJsonObject)?;
    json.end().map_err(|_| Problem::NotJsonObject)?;
    found
}

/// Walks a JSON object's fields, skipping all but `name`'s value without keeping them.
struct TopLevel<'a> {
    name: &'a str,
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = Result<String, Problem>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(is_field) = map.next_key_seed(IsField(self.name))? {
            if !is_field {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let value = map.next_value::<serde_json::Value>()?;
            found = Some(match (found, value) {
                (Some(_), _) => Err(Problem::Twice),
                (None, serde_json::Value::String(text)) => Ok(text),
                (None, serde_json::Value::Number(number)) => Ok(number.to_string()),
                (None, _) => Err(Problem::NotText),
            });
        }
        Ok(found.unwrap_or(Err(Problem::Missing)))
    }
}

/// Whether a JSON object's key is the field's name, without keeping the key.
struct IsField<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for IsField<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for IsField<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
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
}
