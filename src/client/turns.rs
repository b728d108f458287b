//! Turns for work that is not an HTTP call (sending mail, a queue consumer): the layer's
//! waiting machinery as a plain future, and the turn it yields.

use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use super::wait::{Seat, WaitTurn};
use super::OutboundError;
use crate::{Key, MemoryStore, Store, StoreError};

/// Turns of one policy on one store, for work that is not an HTTP call: the same store,
/// policy and settings as the [`OutboundLayer`](super::OutboundLayer) it came from
/// ([`OutboundLayer::turns`](super::OutboundLayer::turns)), and the same line, so that its
/// turns and the layer's requests queue together. Cheap to clone; `Send` and `Sync`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::client::OutboundLayer;
/// use tower_redis_ratelimit::{Algorithm, Key, Policy};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The mail provider accepts 10 messages per second.
/// let policy: Policy = "10/1s".parse()?;
/// let layer = OutboundLayer::builder()
///     .policy(policy.with_algorithm(Algorithm::SlidingLog))
///     .max_wait(Duration::from_secs(30))
///     .build()?;
/// let turns = layer.turns();
/// let turn = turns.wait(Key::from("mail"), 1).await?;
/// turn.go(); // right before the message goes out
/// // send the message
/// # Ok(())
/// # }
/// ```
pub struct Turns<St = MemoryStore> {
    shared: Arc<Shared<St>>,
}

impl<St> Clone for Turns<St> {
    fn clone(&self) -> Self {
        Turns {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St> std::fmt::Debug for Turns<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turns")
            .field("policy", &self.shared.policy.name())
            .finish_non_exhaustive()
    }
}

impl<St> Turns<St> {
    pub(super) fn new(shared: Arc<Shared<St>>) -> Self {
        Turns { shared }
    }
}

impl<St: Store> Turns<St> {
    /// Waits for a turn of `cost` units of `key`, up to the layer's `max_wait`: fails at once
    /// with [`OutboundError::TooLate`] where the turn would come later (or never: a cost over
    /// a count), and with [`OutboundError::Store`] where the store cannot reserve (a cost of
    /// 0 among others). Cancel-safe: dropping the
    /// future gives its place back (the line moves up).
    pub fn wait(&self, key: Key, cost: u32) -> WaitTurn<St> {
        if cost == 0 {
            let zero = StoreError::Unsupported("a reservation's cost must be at least one unit");
            return WaitTurn::failed(OutboundError::Store(zero));
        }
        WaitTurn::new(Seat::new(Arc::clone(&self.shared), key, cost))
    }

    /// Pauses `key` for the fleet, as an upstream's pushback does: turns made meanwhile come
    /// after it, and those waiting learn it and wait again (at most the layer's
    /// [`max_pause`](super::OutboundLayerBuilder::max_pause)).
    pub fn pause(&self, key: &Key, wait: Duration) {
        drop(Shared::pause(&self.shared, key.clone(), wait));
    }
}
