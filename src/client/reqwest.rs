//! reqwest: the layer's turns as a reqwest-middleware [`Middleware`], for services that call
//! their APIs with reqwest (whose request type is its own, not an `http::Request`, so that the
//! tower layer cannot wrap a `reqwest::Client`).

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;

use ::reqwest::{Request, Response};
use http::Extensions;
use reqwest_middleware::{Middleware, Next};

use super::pushback::pushback_or_log;
use super::shared::Shared;
use super::{OutboundError, OutboundLayer, Turns};
use crate::key::Global;
use crate::{Key, KeyError, MemoryStore, Store};

/// What a reqwest request's turn is counted by.
type KeyOf = dyn Fn(&Request) -> Option<Key> + Send + Sync;

/// Makes every request of a reqwest client wait for its turn, as
/// [`OutboundLayer`] does for a tower service: the same store, policy, `max_wait`, margin,
/// line and pushback, and the same errors. Made by [`OutboundLayer::middleware`]; added to a
/// client with reqwest-middleware's `ClientBuilder::with`.
///
/// Each request waits for a turn of one unit of its key ([`Turns::wait`]), uses it right before
/// it goes to the next middleware (and, at the end of the chain, out), and pauses its key
/// where the answer pushes back (`429` or `503` with `Retry-After`, read and capped by
/// `max_pause` as the layer does), handing the refusal back once the store has recorded the
/// pause, so that the caller's next request waits for it.
/// A request that does not go out fails with `reqwest_middleware::Error::Middleware`, whose
/// `anyhow::Error` holds the [`OutboundError<Infallible>`](OutboundError) (`downcast_ref`
/// finds it); an error of the chain after it is returned as it came.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use tower_redis_ratelimit::client::{OutboundError, OutboundLayer};
/// use tower_redis_ratelimit::{Algorithm, Policy};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The provider allows 10 requests in any second.
/// let policy: Policy = "10/1s".parse()?;
/// let layer = OutboundLayer::builder()
///     .policy(policy.with_algorithm(Algorithm::SlidingLog))
///     .max_wait(Duration::from_secs(30))
///     .build()?;
/// // One key per host: each provider's limit on its own.
/// let middleware = layer
///     .middleware()
///     .key(|request: &reqwest::Request| request.url().host_str().map(str::to_owned));
/// let client: reqwest_middleware::ClientWithMiddleware =
///     reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///         .with(middleware)
///         .build();
/// # let failed = reqwest_middleware::Error::middleware(
/// #     OutboundError::<Infallible>::TooLate { turn: None },
/// # );
/// // What a call that did not go out failed with:
/// if let reqwest_middleware::Error::Middleware(error) = &failed {
///     let outbound = error.downcast_ref::<OutboundError<Infallible>>();
///     if let Some(OutboundError::TooLate { turn }) = outbound {
///         println!("its turn would have come in {turn:?}");
///     }
///     println!("{error:#}"); // the error and its causes
/// }
/// # drop(client);
/// # Ok(())
/// # }
/// ```
pub struct OutboundMiddleware<St = MemoryStore> {
    turns: Turns<St>,
    key: Arc<KeyOf>,
}

impl<St> Clone for OutboundMiddleware<St> {
    fn clone(&self) -> Self {
        OutboundMiddleware {
            turns: self.turns.clone(),
            key: Arc::clone(&self.key),
        }
    }
}

impl<St> fmt::Debug for OutboundMiddleware<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboundMiddleware")
            .field("turns", &self.turns)
            .finish_non_exhaustive()
    }
}

impl<St: Store> OutboundLayer<Global, St> {
    /// The layer's turns as a reqwest middleware: one key for every request, the key
    /// [`Global`] gives the layer's requests (so that the two share one line); set another
    /// with [`OutboundMiddleware::key`]. Only a layer of one key makes one, as a layer's key
    /// extractor reads `http::Request`s, not reqwest's.
    pub fn middleware(&self) -> OutboundMiddleware<St> {
        OutboundMiddleware {
            turns: self.turns(),
            key: Arc::new(|_: &Request| Some(global())),
        }
    }
}

impl<St> OutboundMiddleware<St> {
    /// What a request's turn is counted by: `key` of the request (its host, a header, the
    /// account its URL names). A request it gives `None`, or an empty key, fails with
    /// [`OutboundError::Key`] and does not go out.
    pub fn key<F, K>(mut self, key: F) -> Self
    where
        F: Fn(&Request) -> Option<K> + Send + Sync + 'static,
        K: Into<Key>,
    {
        self.key = Arc::new(move |request: &Request| {
            key(request)
                .map(Into::into)
                .filter(|key: &Key| !key.as_str().is_empty())
        });
        self
    }
}

#[async_trait::async_trait]
impl<St: Store> Middleware for OutboundMiddleware<St> {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let failed = reqwest_middleware::Error::middleware::<OutboundError<Infallible>>;
        let key = (self.key)(&request).ok_or(OutboundError::Key(KeyError::NotFound));
        let key = key.map_err(failed)?;
        let turn = self.turns.wait(key, 1).await.map_err(failed)?;
        // Where the answer's pushback pauses, as the layer's response future does.
        let pauser = turn.pauser();
        turn.go();
        let response = next.run(request, extensions).await?;
        if let Some((shared, key)) = pauser {
            let status = response.status().as_u16();
            if let Some(wait) = pushback_or_log(status, response.headers(), shared.max_pause) {
                // Handed back once the store heard the pause, as the layer does: the caller's
                // next request does not reserve before it.
                let _ = Shared::pause(&shared, key, wait).await;
            }
        }
        Ok(response)
    }
}

/// The key of every request of a layer of one key ([`Global`]'s).
fn global() -> Key {
    Key::from("global")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyExtractor;

    #[test]
    fn the_default_key_is_the_one_a_layer_of_one_key_uses() {
        let request = http::Request::new(());
        assert_eq!(Global.extract(&request).unwrap(), global());
    }
}
