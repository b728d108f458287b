//! What the layer reads and hands on: its settings, [`Normalize`], [`OtherContent`], and
//! [`BodyField`] with [`BodyKey`], the key extractor that reads it.

use std::fmt;
use std::sync::Arc;

use http::Request;
use unicode_normalization::char::is_combining_mark;
use unicode_normalization::UnicodeNormalization;

use crate::key::{Key, KeyError, KeyExtractor};

/// A [`BodyFieldLayer`](super::BodyFieldLayer)'s settings, shared by its services and
/// their futures.
#[derive(Debug)]
pub(super) struct Settings {
    pub(super) field: Arc<str>,
    /// The number fields read besides the key ([`BodyFieldBuilder::number`]), none twice and
    /// none the key's.
    ///
    /// [`BodyFieldBuilder::number`]: super::BodyFieldBuilder::number
    pub(super) numbers: Arc<[Arc<str>]>,
    pub(super) limit: usize,
    pub(super) normalize: Normalize,
    pub(super) other: OtherContent,
}

/// How a field's value is normalised before it becomes a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Normalize {
    /// The value as sent: `Ann` and `ann` are two budgets.
    Exact,
    /// Leading and trailing white space removed (Unicode's `White_Space`).
    Trim,
    /// Compatibility forms (NFKC), accents, invisible characters and white space at either
    /// end folded away, then lowercased: `ann`, ` ANN `, `ＡＮＮ`, `Ánn` and `a\u{200B}nn`
    /// are one budget. The default.
    #[default]
    Fold,
}

impl Normalize {
    /// `value`, normalised.
    pub(crate) fn apply(self, value: &str) -> String {
        match self {
            Normalize::Exact => value.to_owned(),
            Normalize::Trim => value.trim().to_owned(),
            // NFKD leaves ASCII as it is, and ASCII has no accent or invisible character
            // other than its controls.
            Normalize::Fold if value.is_ascii() => {
                let kept = value.trim().chars().filter(|c| !c.is_ascii_control());
                kept.map(|c| c.to_ascii_lowercase()).collect()
            }
            Normalize::Fold => {
                // Decomposed, so that accents are marks of their own, which go with the
                // invisible characters; what is left is composed again.
                let bare = value
                    .nfkd()
                    .filter(|&c| !is_combining_mark(c) && !is_invisible(c));
                bare.nfkc().collect::<String>().trim().to_lowercase()
            }
        }
    }
}

/// Whether `c` is a control character or a default-ignorable code point (Unicode's
/// `Default_Ignorable_Code_Point`, DerivedCoreProperties.txt: zero-width spaces and joiners,
/// the soft hyphen, the byte-order mark, variation selectors, tags...): characters that render
/// as nothing, and that database collations (MySQL's `utf8mb4_0900_ai_ci`, say) give no
/// weight, so that `an\u{AD}n` would log in as `ann` while counting apart.
fn is_invisible(c: char) -> bool {
    const IGNORABLE: [(char, char); 17] = [
        ('\u{AD}', '\u{AD}'),
        ('\u{34F}', '\u{34F}'),
        ('\u{61C}', '\u{61C}'),
        ('\u{115F}', '\u{1160}'),
        ('\u{17B4}', '\u{17B5}'),
        ('\u{180B}', '\u{180F}'),
        ('\u{200B}', '\u{200F}'),
        ('\u{202A}', '\u{202E}'),
        ('\u{2060}', '\u{206F}'),
        ('\u{3164}', '\u{3164}'),
        ('\u{FE00}', '\u{FE0F}'),
        ('\u{FEFF}', '\u{FEFF}'),
        ('\u{FFA0}', '\u{FFA0}'),
        ('\u{FFF0}', '\u{FFF8}'),
        ('\u{1BCA0}', '\u{1BCA3}'),
        ('\u{1D173}', '\u{1D17A}'),
        ('\u{E0000}', '\u{E0FFF}'),
    ];
    c.is_control() || IGNORABLE.iter().any(|&(from, to)| (from..=to).contains(&c))
}

/// What [`BodyFieldLayer`] does with a request that is neither a form nor JSON: another
/// `Content-Type` or none, or a `Content-Encoding` other than `identity`.
///
/// [`BodyFieldLayer`]: super::BodyFieldLayer
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtherContent {
    /// Answer `415 Unsupported Media Type`. The default.
    #[default]
    Reject,
    /// Hand the request on untouched, its body unread and without a [`BodyField`]; a
    /// [`BodyKey`] then finds no key, and the rate-limit layer's
    /// [`MissingKey`](crate::MissingKey) applies.
    Pass,
}

/// The field a [`BodyFieldLayer`] read, in the request's extensions: its name and its
/// normalised value, never empty.
///
/// Handlers can read it too (axum: `Extension<BodyField>`). Its `Debug` output shows the
/// value as [`Key`]'s `Debug` does, so that a user name stays out of the logs.
///
/// [`BodyFieldLayer`]: super::BodyFieldLayer
#[derive(Clone, PartialEq, Eq)]
pub struct BodyField {
    name: Arc<str>,
    value: String,
}

impl BodyField {
    /// A field as the layer would have put it, e.g. to test a handler.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn new(name: &str, value: impl Into<String>) -> Self {
        BodyField {
            name: Arc::from(name),
            value: value.into(),
        }
    }

    /// The field a layer read, named with the layer's own name.
    pub(super) fn shared(name: Arc<str>, value: String) -> Self {
        BodyField { name, value }
    }

    /// The field's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The field's value, normalised as the layer was told.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl fmt::Debug for BodyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyField")
            .field("name", &self.name)
            .field("value", &Key::from(self.value.as_str()).loggable())
            .finish()
    }
}

/// The number fields a [`BodyFieldLayer`] read ([`BodyFieldBuilder::number`]), in the
/// request's extensions next to its [`BodyField`], for a
/// [cost closure](crate::RateLimitLayerBuilder::cost) or the handler: each value kept as the
/// number it is, never normalised as the key is.
///
/// ```
/// use tower_redis_ratelimit::key::body::{BodyFieldLayer, BodyFields};
/// use tower_redis_ratelimit::RateLimitLayer;
///
/// // An LLM gateway: tokens per minute per user, each request reserving its `max_tokens`
/// // (100 when it sends none, 4 000 at most).
/// let read = BodyFieldLayer::builder("user").number("max_tokens").build()?;
/// let limit = RateLimitLayer::builder()
///     .key(read.key())
///     .policy("10000/1m")
///     .cost(|head| {
///         let asked = BodyFields::of(head).and_then(|f| f.number("max_tokens"));
///         asked.map_or(100, |n| n.min(4_000) as u32)
///     })
///     .build()?;
/// # drop((read, limit));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`BodyFieldLayer`]: super::BodyFieldLayer
/// [`BodyFieldBuilder::number`]: super::BodyFieldBuilder::number
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyFields {
    names: Arc<[Arc<str>]>,
    values: Vec<Option<u64>>,
}

impl BodyFields {
    /// The number fields a layer read: `values[i]` is the value of `names[i]`.
    pub(super) fn shared(names: Arc<[Arc<str>]>, values: Vec<Option<u64>>) -> Self {
        BodyFields { names, values }
    }

    /// The fields a layer read from the request `head` describes, if one did.
    pub fn of<'a>(head: &crate::RequestHead<'a>) -> Option<&'a BodyFields> {
        head.extensions.get::<BodyFields>()
    }

    /// The value of number field `name`; `None` when the body did not have it, or the layer
    /// was not told to read it.
    pub fn number(&self, name: &str) -> Option<u64> {
        let index = self.names.iter().position(|n| **n == *name)?;
        self.values.get(index).copied().flatten()
    }
}

/// The key of a request: the [`BodyField`] a [`BodyFieldLayer`] outside the rate-limit layer
/// read. Without it (no such layer, another field, or a request passed on unread) the
/// request has no key ([`KeyError::MissingBodyField`]).
///
/// ```
/// use tower_redis_ratelimit::key::body::{BodyFieldLayer, BodyKey};
/// use tower_redis_ratelimit::RateLimitLayer;
///
/// let read = BodyFieldLayer::builder("username").build()?;
/// let key: BodyKey = read.key();
/// let limit = RateLimitLayer::builder().key(key).policy("5/1m").build()?;
/// # drop((read, limit));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`BodyFieldLayer`]: super::BodyFieldLayer
#[derive(Debug, Clone)]
pub struct BodyKey {
    field: Arc<str>,
}

impl BodyKey {
    /// Keys requests by the field a layer reads, named with the layer's own name.
    pub(super) fn shared(field: Arc<str>) -> Self {
        BodyKey { field }
    }
}

impl<B> KeyExtractor<B> for BodyKey {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        match request.extensions().get::<BodyField>() {
            Some(found) if found.name == self.field && !found.value.is_empty() => {
                Ok(Key::from(found.value.as_str()))
            }
            _ => Err(KeyError::MissingBodyField(self.field.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_case_width_and_white_space() {
        assert_eq!(Normalize::Fold.apply("\u{3000}ＡＮＮ\t"), "ann");
        assert_eq!(Normalize::Fold.apply("ÅSA"), "asa");
        // Accents go, composed or not.
        assert_eq!(Normalize::Fold.apply("E\u{301}"), "e");
        assert_eq!(Normalize::Fold.apply("\u{e9}"), "e");
        // So do characters that render as nothing, which collations ignore.
        for invisible in [
            '\u{200B}',
            '\u{AD}',
            '\u{FEFF}',
            '\u{2060}',
            '\0',
            '\u{E0041}',
        ] {
            assert_eq!(Normalize::Fold.apply(&format!("a{invisible}nn")), "ann");
        }
        assert_eq!(Normalize::Fold.apply(" ANN "), "ann");
        assert_eq!(Normalize::Fold.apply("ＡＮＮ"), "ann");
        assert_eq!(Normalize::Fold.apply("ÉLODIE"), "elodie");
        assert_eq!(Normalize::Fold.apply("an\u{AD}n\0"), "ann");
        assert_eq!(Normalize::Trim.apply(" Ann "), "Ann");
        assert_eq!(Normalize::Exact.apply(" Ann "), " Ann ");
        // Other scripts keep their letters: a Cyrillic а is not a Latin a.
        assert_eq!(Normalize::Fold.apply("\u{430}nn"), "\u{430}nn");
        assert_eq!(Normalize::Trim.apply("\u{3000}Ann "), "Ann");
    }

    #[test]
    fn the_key_is_the_field_of_its_name_and_bounded() {
        let key = BodyKey::shared("username".into());
        let with = |field: BodyField| {
            let mut request = Request::new(());
            request.extensions_mut().insert(field);
            request
        };
        assert_eq!(
            key.extract(&with(BodyField::new("username", "ann"))),
            Ok(Key::from("ann"))
        );
        let huge = key
            .extract(&with(BodyField::new("username", "a".repeat(16_000))))
            .unwrap();
        assert_eq!(huge.as_str().len(), 33);
        assert_eq!(
            key.extract(&with(BodyField::new("email", "ann"))),
            Err(KeyError::MissingBodyField("username".to_owned()))
        );
        assert!(key.extract(&Request::new(())).is_err());
        let shown = format!("{:?}", BodyField::new("username", "ann"));
        assert!(!shown.contains("\"ann\""), "{shown}");
    }
}
