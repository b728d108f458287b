//! [`MemoryStoreBuilder`]: a memory store's bound and clock.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::clock::{Clock, TokioClock};
use super::{MemoryStore, Shared};
use crate::shards::Shards;
use crate::store::claims::Claims;

/// Configures a [`MemoryStore`].
pub struct MemoryStoreBuilder {
    max_keys: u64,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    pub(super) fn new() -> Self {
        MemoryStoreBuilder {
            max_keys: MemoryStore::DEFAULT_MAX_KEYS,
            clock: None,
        }
    }

    /// The most keys (client × policy) held at once; default
    /// [`MemoryStore::DEFAULT_MAX_KEYS`]. At least one key per shard is always held.
    pub fn max_keys(mut self, max_keys: u64) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The clock decisions are made with; default [`TokioClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            shared: Arc::new(Shared {
                entries: Shards::new(self.max_keys),
                next_slot: AtomicU64::new(1),
                next_state: AtomicU64::new(1),
                clock: self
                    .clock
                    .unwrap_or_else(|| Arc::new(TokioClock::default())),
                overrides: Arc::default(),
                claims: Claims::default(),
            }),
        }
    }
}
