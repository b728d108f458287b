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
//! reads every [`WATCH`]: when it changes, the layer's deny cache drops the refusals decided
//! before (`Store::limits_version`), and the leases held are spent no more
//! (`lease::limits_changed`), so that every instance follows a change within that time.

use std::sync::{LazyLock, Weak};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{HashesInterface, KeysInterface};
use fred::types::scripts::Script;
use fred::types::Value;

use super::{Inner, RedisStore};
use crate::store::overrides::{Entry, Overrides, Scope};
use crate::{Key, Policy, StoreError};

/// How often a store reads the limits version.
const WATCH: Duration = Duration::from_millis(250);

/// The key of the limits version of the stores using `prefix`.
fn version_key(prefix: &str) -> String {
    format!("{prefix}:{{overrides}}:version")
}

/// Reads the limits version every [`WATCH`] until the store is dropped.
pub(super) fn spawn_watch(inner: Weak<Inner>) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(WATCH).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let key = version_key(&inner.prefix);
            let get = |client: Client| {
                let key = key.clone();
                async move { client.get::<Option<u64>, _>(key).await }
            };
            let read = tokio::time::timeout(inner.timeout, inner.batcher.on(&key, get));
            // A version that is gone (a flush, a restart) reads as 0: another one, too.
            if let Ok(Ok(version)) = read.await {
                inner.limits_seen(version.unwrap_or(0));
            }
        }
    });
}

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
            LazyLock::new(|| Script::from_lua(include_str!("scripts/override_stamp.lua")));
        static WRITE: LazyLock<Script> =
            LazyLock::new(|| Script::from_lua(include_str!("scripts/override_write.lua")));
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

    /// Increments the limits version after a change, so that every store follows it; the
    /// new version.
    async fn announce(&self) -> Result<u64, StoreError> {
        let key = version_key(&self.inner.prefix);
        let incr = |client: Client| {
            let key = key.clone();
            async move { client.incr::<u64, _>(key).await }
        };
        let version = self
            .guarded(&key, self.inner.batcher.on(&key, incr))
            .await?;
        self.inner.limits_seen(version);
        Ok(version)
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

    pub(crate) async fn list_overrides(
        &self,
        policy: &Policy,
    ) -> Result<Vec<(Scope, Vec<u64>)>, StoreError> {
        let mut listed: Vec<(Scope, Vec<u64>)> = Vec::new();
        let inner = &self.inner;
        for lane in 0..inner.placement.lanes() {
            let hash = inner.placement.overrides_key(&inner.prefix, lane);
            let all = |client: Client| {
                let hash = hash.clone();
                async move { client.hgetall::<Value, _>(hash).await }
            };
            let Value::Map(fields) = self.guarded(&hash, inner.batcher.on(&hash, all)).await?
            else {
                continue;
            };
            for value in fields.values() {
                let Some((counts, (identity, key))) = value.as_bytes().and_then(decode) else {
                    continue;
                };
                if identity != policy.identity() {
                    continue;
                }
                let scope = match key {
                    Some(key) => Scope::Key(Key::from(key)),
                    None => Scope::All,
                };
                if !listed.iter().any(|(s, _)| *s == scope) {
                    listed.push((scope, counts));
                }
            }
        }
        Ok(listed)
    }
}

/// The identity and the key (`None`: the policy's own) an override was set for.
type SetFor<'a> = (&'a str, Option<&'a str>);

/// An override's value: `m`, then count and scale of each limit, then 0 (a policy's) or 1 (a
/// key's), the identity, a newline and the key.
fn encode(policy: &Policy, scope: &Scope, entry: &Entry) -> Vec<u8> {
    let limits: Vec<(u64, u64)> = match entry {
        Entry::Limits(other) => other.windows().iter().map(|w| (w.count, w.scale)).collect(),
        Entry::Block => Vec::new(),
    };
    let (kind, key) = match scope {
        Scope::All => (0i64, ""),
        Scope::Key(key) => (1, key.as_str()),
    };
    let ints = std::iter::once(limits.len() as i64)
        .chain(limits.iter().flat_map(|&(c, s)| [c as i64, s as i64]))
        .chain([kind]);
    let mut value: Vec<u8> = ints.flat_map(i64::to_le_bytes).collect();
    value.extend_from_slice(policy.identity().as_bytes());
    value.push(b'\n');
    value.extend_from_slice(key.as_bytes());
    value
}

/// The counts of an override's value (empty: a block), with the identity and the key (`None`
/// for a policy's) it was set for.
fn decode(value: &[u8]) -> Option<(Vec<u64>, SetFor<'_>)> {
    let int = |i: usize| {
        let bytes = value.get(8 * i..8 * i + 8)?;
        Some(i64::from_le_bytes(bytes.try_into().ok()?))
    };
    let m = usize::try_from(int(0)?).ok()?;
    let counts = (0..m)
        .map(|i| int(1 + 2 * i).and_then(|c| u64::try_from(c).ok()))
        .collect::<Option<Vec<u64>>>()?;
    let kind = int(1 + 2 * m)?;
    let text = std::str::from_utf8(value.get(8 * (2 + 2 * m)..)?).ok()?;
    let (identity, key) = text.split_once('\n')?;
    Some((counts, (identity, (kind == 1).then_some(key))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::overrides::Override;

    #[test]
    fn values_read_back() {
        let policy =
            Policy::new("sms", ["1/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
        let to = Override::Limits(vec!["2/1m".parse().unwrap(), "50/1h".parse().unwrap()]);
        let entry = Entry::new(&policy, &to).unwrap();
        let key = Scope::Key(Key::from("+447700900123"));
        let value = encode(&policy, &key, &entry);
        assert_eq!(
            decode(&value),
            Some((vec![2, 50], ("sms:log:1m+1h", Some("+447700900123"))))
        );
        // A key never holds a newline (one with control characters is kept hashed), so the
        // identity and the key part unambiguously.
        let hashed = Key::from("+44\n7700");
        assert!(!hashed.as_str().contains('\n'));
        let value = encode(&policy, &Scope::All, &Entry::Block);
        assert_eq!(decode(&value), Some((vec![], ("sms:log:1m+1h", None))));
        assert_eq!(decode(&value[..12]), None);
        assert_eq!(decode(b""), None);
    }
}
