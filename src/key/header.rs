use http::{HeaderName, Request};

use super::{Key, KeyError, KeyExtractor};

/// The value of one request header, such as an API key or a user id.
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
        match value.to_str() {
            Ok(text) if !text.trim().is_empty() => Ok(Key::from(text.trim())),
            _ => Err(KeyError::InvalidHeader(self.name.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_the_header_value() {
        let h = Header::new(HeaderName::from_static("x-api-key"));
        let req = Request::builder()
            .header("x-api-key", " k1 ")
            .body(())
            .unwrap();
        assert_eq!(h.extract(&req).unwrap().as_str(), "k1");
        assert!(matches!(
            h.extract(&Request::new(())),
            Err(KeyError::MissingHeader(_))
        ));
        let bad = Request::builder()
            .header("x-api-key", &b"\xff"[..])
            .body(())
            .unwrap();
        assert!(matches!(h.extract(&bad), Err(KeyError::InvalidHeader(_))));
    }
}
