//! Overrides in Redis (`store/overrides.rs`): one hash per lane, in the hash slot of the keys that
//! lane holds, which the algorithm scripts read in the decision's own call (`prelude.lua`).
//!
//! A key's override is the field named like the key's state (its Redis key), in the hash of
//! the key's lane; a policy's override is the field named by its override id
//! ([`Policy::override_id`]) in every lane's hash (one on a single Redis; in a cluster one
//! per tag, so that each hash slot's calls find it). A value is 64-bit little-endian integers: the
//! number of limits `m` (0: a block), count and scale of each limit, then what listing needs:
//! 0 for a policy's override or 1 for a key's, and the policy's identity, a newline and the
//! key.
//!
//! Every change also raises the limits version (`version.rs`), which each store reads every
//! quarter second to follow changes made through other instances (`write.rs` says how a write
//! and its announcement are ordered).

use fred::clients::Client;
use fred::interfaces::HashesInterface;

mod list;
mod value;
mod version;
mod write;

pub(crate) use list::RedisPages;
use value::decode;
pub(super) use version::{spawn_watch, Change, Limits, Reading};

use super::RedisStore;
use crate::store::overrides::{Overrides, Scope};
use crate::{Policy, StoreError};

impl RedisStore {
    /// The store's overrides: limits changed at run time for a key or a whole policy, kept in
    /// Redis and read by every instance's decisions from the next one on (see
    /// [`Overrides`]).
    pub fn overrides(&self) -> Overrides {
        Overrides::redis(self.clone())
    }

    /// Where the override of `policy` for `scope` lives: (hash, field) pairs, one per lane for
    /// a policy's.
    fn fields(&self, policy: &Policy, scope: &Scope) -> Vec<(String, String)> {
        let inner = &self.inner;
        match scope {
            Scope::Key(key) => {
                let place = inner.place(key, policy);
                let hash = inner.placement.overrides_key(&inner.prefix, place.lane);
                vec![(hash, place.key)]
            }
            Scope::All => (0..inner.placement.lanes())
                .map(|lane| {
                    let hash = inner.placement.overrides_key(&inner.prefix, lane);
                    (hash, policy.override_id().to_string())
                })
                .collect(),
        }
    }

    pub(crate) async fn get_override(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<Option<Vec<u64>>, StoreError> {
        let Some((hash, field)) = self.fields(policy, scope).into_iter().next() else {
            return Ok(None);
        };
        let get = |client: Client| {
            let (hash, field) = (hash.clone(), field.clone());
            async move { client.hget::<Option<Vec<u8>>, _, _>(hash, field).await }
        };
        let value = self
            .guarded(&hash, self.inner.batcher.on(&hash, get))
            .await?;
        Ok(value.and_then(|value| decode(&value).map(|(counts, _)| counts)))
    }
}
