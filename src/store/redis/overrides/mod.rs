//! Overrides in Redis (`store/overrides.rs`): one hash per lane, in the hash slot of the keys that
//! lane holds, which the algorithm scripts read in the decision's own call (`prelude.lua`).
//!
//! Which field of which hash holds an override: `place.rs` (fields go by the policy's name, not
//! its windows; a key's in its lane's hash, a plan's and the policy-wide one in every lane's
//! hash: one on a single Redis, in a cluster one per tag, so that each hash slot's calls find
//! them). What a value holds: `value.rs`.
//!
//! Every change also raises the limits version (`version.rs`), which each store reads every
//! 125 ms to follow changes made through other instances (`write.rs` says how a write
//! and its announcement are ordered).

use fred::clients::Client;
use fred::interfaces::HashesInterface;

mod known;
mod list;
mod place;
mod value;
mod version;
mod write;

pub(super) use known::{Known, Resolution};
pub(crate) use list::RedisPages;
pub(super) use place::head;
use value::decode;
pub(super) use version::{spawn_watch, Change, Limits, Reading};

use super::RedisStore;
use crate::store::overrides::{
    Backend, BoxFuture, OverrideError, Overrides, Pages, Ruling, Scope, Stored,
};
use crate::{Policy, StoreError};

impl RedisStore {
    /// The store's overrides: limits changed at run time for a key, a plan or a whole policy, kept in
    /// Redis and followed by every instance: a decision that starts 250 ms or more after the
    /// call that set one returned goes by it (see [`Overrides`]).
    pub fn overrides(&self) -> Overrides {
        Overrides::new(std::sync::Arc::new(self.clone()))
    }

    pub(crate) async fn get_override(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<Option<Stored>, StoreError> {
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
        Ok(value.and_then(|value| decode(&value).map(|(_, _, stored)| stored)))
    }
}

/// Redis's side of [`Overrides`].
impl Backend for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn is_local(&self) -> bool {
        false
    }

    fn set<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
        ruling: Ruling,
    ) -> BoxFuture<'a, Result<(), OverrideError>> {
        Box::pin(async move { self.set_override(policy, scope, &ruling).await })
    }

    fn get<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<Option<Stored>, OverrideError>> {
        Box::pin(async move { Ok(self.get_override(policy, scope).await?) })
    }

    fn remove<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<bool, OverrideError>> {
        Box::pin(async move { self.remove_override(policy, scope).await })
    }

    fn pages(&self, policy: &Policy) -> Box<dyn Pages> {
        Box::new(RedisPages::new(self.clone(), policy))
    }
}
