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
//! Every change also increments a version (`<prefix>:{overrides}:version`), which each store
//! reads every `WATCH` (`version.rs`): when it changes, the layer's deny cache drops the refusals decided
//! before (`Store::limits_version`), and the leases held are spent no more
//! (`lease::limits_changed`), so that every instance follows a change within that time.

use std::sync::LazyLock;

use fred::clients::Client;
use fred::interfaces::HashesInterface;
use fred::types::scripts::Script;
use fred::types::Value;

mod list;
mod value;
mod version;

pub(crate) use list::RedisPages;
use value::{decode, encode};
pub(super) use version::spawn_watch;
use version::version_key;

use super::RedisStore;
use crate::store::overrides::{Entry, Overrides, Scope};
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

    pub(crate) async fn set_override(
        &self,
        policy: &Policy,
        scope: &Scope,
        entry: &Entry,
    ) -> Result<(), StoreError> {
        let value = encode(policy, scope, entry);
        match scope {
            Scope::Key(_) => {
                for (hash, field) in self.fields(policy, scope) {
                    let set = |client: Client| {
                        let (hash, field, value) = (hash.clone(), field.clone(), value.clone());
                        async move { client.hset::<(), _, _>(hash, (field, value)).await }
                    };
                    let written = self.inner.batcher.on(&hash, set);
                    self.guarded(&hash, written).await?;
                }
            }
            Scope::All => {
                self.write_everywhere(policy, value).await?;
            }
        }
        self.announce().await.map(drop)
    }

    /// Writes (or, with an empty `value`, removes) `policy`'s own override in every lane's
    /// hash through `scripts/override_write.lua`, stamped so that of two writes at once every
    /// lane ends with the later one's value; whether a hash changed.
    async fn write_everywhere(&self, policy: &Policy, value: Vec<u8>) -> Result<bool, StoreError> {
        static STAMP: LazyLock<Script> =
            LazyLock::new(|| Script::from_lua(include_str!("../scripts/override_stamp.lua")));
        static WRITE: LazyLock<Script> =
            LazyLock::new(|| Script::from_lua(include_str!("../scripts/override_write.lua")));
        let key = version_key(&self.inner.prefix);
        let take = |client: Client| {
            let keys = vec![key.clone(), format!("{key}:stamp")];
            async move {
                STAMP
                    .evalsha_with_reload::<Vec<i64>, _, _>(&client, keys, ())
                    .await
            }
        };
        let stamp = self
            .guarded(&key, self.inner.batcher.on(&key, take))
            .await?;
        let [seconds, micros, version] = stamp[..] else {
            let why = format!("override stamp: {stamp:?}");
            let error = fred::error::Error::new(fred::error::ErrorKind::Parse, why);
            return Err(StoreError::Redis(error));
        };
        self.inner.limits_seen(version as u64);
        let mut changed = false;
        for (hash, field) in self.fields(policy, &Scope::All) {
            let write = |client: Client| {
                let keys = vec![hash.clone(), format!("{hash}:stamps")];
                let args: Vec<Value> = vec![
                    field.clone().into(),
                    Value::Bytes(value.clone().into()),
                    Value::Integer(seconds),
                    Value::Integer(micros),
                    Value::Integer(version),
                ];
                async move {
                    WRITE
                        .evalsha_with_reload::<i64, _, _>(&client, keys, args)
                        .await
                }
            };
            let reply = self
                .guarded(&hash, self.inner.batcher.on(&hash, write))
                .await?;
            changed |= reply == 1;
        }
        Ok(changed)
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

    pub(crate) async fn remove_override(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<bool, StoreError> {
        let removed = match scope {
            Scope::All => self.write_everywhere(policy, Vec::new()).await?,
            Scope::Key(_) => {
                let mut removed = false;
                for (hash, field) in self.fields(policy, scope) {
                    let del = |client: Client| {
                        let (hash, field) = (hash.clone(), field.clone());
                        async move { client.hdel::<u64, _, _>(hash, field).await }
                    };
                    removed |= self
                        .guarded(&hash, self.inner.batcher.on(&hash, del))
                        .await?
                        > 0;
                }
                removed
            }
        };
        if removed {
            self.announce().await?;
        }
        Ok(removed)
    }
}
