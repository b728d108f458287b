//! The limits version: a counter that every change of an override increments, which each
//! store reads every [`WATCH`] to follow changes made through other instances.

use std::sync::Weak;
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::KeysInterface;

use super::super::{Inner, RedisStore};
use crate::StoreError;

/// How often a store reads the limits version.
const WATCH: Duration = Duration::from_millis(250);

/// The key of the limits version of the stores using `prefix`.
pub(super) fn version_key(prefix: &str) -> String {
    format!("{prefix}:{{overrides}}:version")
}

/// Reads the limits version every [`WATCH`] until the store is dropped.
pub(in crate::store::redis) fn spawn_watch(inner: Weak<Inner>) {
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
    /// Increments the limits version after a change, so that every store follows it; the
    /// new version.
    pub(super) async fn announce(&self) -> Result<u64, StoreError> {
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
}
