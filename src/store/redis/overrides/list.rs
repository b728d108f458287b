//! Listing a policy's overrides.

use fred::clients::Client;
use fred::interfaces::HashesInterface;
use fred::types::Value;

use super::super::RedisStore;
use super::value::decode;
use crate::store::overrides::{Scope, Stored};
use crate::{Policy, StoreError};

impl RedisStore {
    pub(crate) async fn list_overrides(
        &self,
        policy: &Policy,
    ) -> Result<Vec<(Scope, Stored)>, StoreError> {
        let mut listed: Vec<(Scope, Stored)> = Vec::new();
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
                let Some((owner, scope, stored)) = value.as_bytes().and_then(decode) else {
                    continue;
                };
                if owner != policy.owner().name() {
                    continue;
                }
                if !listed.iter().any(|(s, _)| *s == scope) {
                    listed.push((scope, stored));
                }
            }
        }
        Ok(listed)
    }
}
