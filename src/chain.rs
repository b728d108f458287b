//! An error and its causes on one line, for logs. The crate's errors keep their cause as
//! `source` and out of their own message (so that a caller printing the chain sees each once);
//! a log that showed only the message would lose the cause.

use std::error::Error;
use std::fmt;

/// Displays an error and then each of its causes, `: ` between them.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::OutboundError;
    use crate::KeyError;

    #[test]
    fn a_chain_shows_each_cause_once() {
        let error: OutboundError<std::io::Error> = OutboundError::Key(KeyError::NotFound);
        assert_eq!(
            Chain(&error).to_string(),
            "the request has no key: the key extractor found no key"
        );
        let inner = OutboundError::Inner(std::io::Error::other("reset by peer"));
        assert_eq!(
            Chain(&inner).to_string(),
            "the inner service failed: reset by peer"
        );
    }
}
