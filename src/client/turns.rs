//! Turns for work that is not an HTTP call (sending mail, a queue consumer): the layer's
//! waiting machinery as a plain future, and the turn it yields.

use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use super::wait::{Placed, Seat, WaitTurn};
use super::OutboundError;
use crate::{Key, MemoryStore, Store};

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
    /// with [`OutboundError::TooLate`] where the turn would come later, and with
    /// [`OutboundError::Store`] where the store cannot reserve. Cancel-safe: dropping the
    /// future gives its place back (the line moves up).
    pub fn wait(&self, key: Key, cost: u32) -> WaitTurn<St> {
        if cost == 0 {
            return WaitTurn::failed(OutboundError::TooLate { turn: None });
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

/// A turn that has come ([`Turns::wait`]): [`go`](Turn::go) uses it, right before the work
/// goes out. It holds for the layer's margin from the turn: use it at once. Dropped unused,
/// its place is given back (the reservation stays in the store's line until `go`), as a
/// dropped [`WaitTurn`]'s is.
#[must_use = "a turn is used by `go`"]
pub struct Turn<St: Store> {
    placed: Placed<St>,
    /// The latest it may leave on the instance's clock.
    until: tokio::time::Instant,
}

impl<St: Store> std::fmt::Debug for Turn<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn").finish_non_exhaustive()
    }
}

impl<St: Store> Turn<St> {
    pub(super) fn new(placed: Placed<St>, until: tokio::time::Instant) -> Self {
        Turn { placed, until }
    }

    /// Uses the turn: call it right before the work goes out, at once (the upstream may see
    /// the work up to the layer's margin after the turn, and no later).
    pub fn go(mut self) {
        self.placed.go();
    }

    /// Whether the turn may no longer be used: later than its margin after it.
    pub(super) fn too_late(&self) -> bool {
        let seat = self.placed.seat();
        seat.is_some_and(|seat| seat.shared.clock.now() > self.until)
    }

    /// Gives the turn back and waits for another, with what is left of the wait.
    pub(super) fn again(self) -> WaitTurn<St> {
        super::wait::again(self.placed)
    }

    /// Where its upstream's pushback pauses: its layer and key.
    pub(super) fn pauser(&self) -> Option<(Arc<Shared<St>>, Key)> {
        let seat = self.placed.seat()?;
        Some((Arc::clone(&seat.shared), seat.key.clone()))
    }
}
