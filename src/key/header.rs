use http::{HeaderName, Request};

use super::{Key, KeyError, KeyExtractor};

/// The value of one request header, such as an API key or a user id.
///
/// Values are used as they are when short and plain; long or binary values (not UTF-8, 8 KiB of
/// anything) are hashed to a fixed length (see [`Key`]), so a client cannot make the store keep
/// arbitrarily large keys. An absent or empty header is a [`KeyError`].
///
/// ```
/// use tower_redis_ratelimit::key::Header;
///
/// let by_api_key = Header::new(http::HeaderName::from_static("x-api-key"));
/// ```
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

impl Header {
    /// Keys requests by the value of header `name`.
    pub fn new(name: HeaderName) -> Self {
        Header { name }
    }
}

impl<B> KeyExtractor<B> for Header {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let value = request
            .headers()
            .get(&self.name)
            .ok_or_else(|| KeyError::MissingHeader(self.name.clone()))?;
        let bytes = value.as_bytes().trim_ascii();
        if bytes.is_empty() {
            return Err(KeyError::InvalidHeader(self.name.clone()));
        }
        Ok(Key::from(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_header_value_and_hashes_hostile_ones() {
        let h = Header::new(HeaderName::from_static("x-api-key"));
        let with = |value: &[u8]| {
            Request::builder()
                .header("x-api-key", value)
                .body(())
                .unwrap()
        };
        assert_eq!(h.extract(&with(b" k1 ")).unwrap().as_str(), "k1");
        assert!(matches!(
            h.extract(&Request::new(())),
            Err(KeyError::MissingHeader(_))
        ));
        assert!(matches!(
            h.extract(&with(b"  ")),
            Err(KeyError::InvalidHeader(_))
        ));
        let binary = h.extract(&with(b"\xff\xfe")).unwrap();
        assert!(binary.as_str().starts_with('#') && binary.as_str().len() == 33);
        let huge = h.extract(&with(&[b'a'; 8192])).unwrap();
        assert_eq!(huge.as_str().len(), 33);
        assert_ne!(huge, h.extract(&with(&[b'a'; 8191])).unwrap());
    }
}
