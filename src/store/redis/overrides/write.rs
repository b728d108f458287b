//! Writing an override so that every instance follows it, whatever becomes of the reply.
//!
//! Every write takes a stamp first (a limits version, `scripts/limits_bump.lua`) and carries
//! it, so a write that lands late never undoes one stamped after it (`override_write.lua`).
//! On a single Redis each write then raises the limits version in its own script: a write
//! that ran was announced, even where its reply was lost to a timeout. In a Redis Cluster the
//! version lives in its own hash slot, so the store raises it after the writes; where a write
//! may have been sent and no reply confirmed it, the store writes it again under the same
//! stamp and raises the version every 125 ms until Redis answers: the retry is
//! refused where the first try landed, and the raise announces whatever landed. A write to
//! every lane (a policy's or a plan's override) tries every lane even where one fails, so a
//! primary that is gone delays only the keys it holds.

use std::sync::{Arc, LazyLock, Weak};

use fred::clients::Client;
use fred::interfaces::LuaInterface;
use fred::types::Value;
use tokio::time::Instant;

use super::super::{Inner, RedisStore};
use super::value::encode;
use super::version::{limits_key, Reading, WATCH};
use crate::store::overrides::{OverrideError, Ruling, Scope};
use crate::{Policy, StoreError};

/// The scripts' shared text on the limits version.
const LIMITS: &str = include_str!("../scripts/limits_version.lua");

// Sent whole with EVAL, not by hash: an EVALSHA that Redis answers NOSCRIPT after the caller
// gave up waiting (the first write to a Redis that is asleep) would never be sent again, and
// the write would be lost where the error says it may have landed.
static WRITE: LazyLock<String> =
    LazyLock::new(|| [LIMITS, include_str!("../scripts/override_write.lua")].concat());

static BUMP: LazyLock<String> =
    LazyLock::new(|| [LIMITS, include_str!("../scripts/limits_bump.lua")].concat());

/// One override to write (or, with an empty value, remove) at every (hash, field) of
/// `places`.
struct Write {
    places: Vec<(String, String)>,
    value: Vec<u8>,
}

impl RedisStore {
    pub(crate) async fn set_override(
        &self,
        policy: &Policy,
        scope: &Scope,
        ruling: &Ruling,
    ) -> Result<(), OverrideError> {
        let value = encode(policy, scope, ruling);
        self.write(self.write_of(policy, scope, value))
            .await
            .map(drop)
    }

    pub(crate) async fn remove_override(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<bool, OverrideError> {
        self.write(self.write_of(policy, scope, Vec::new())).await
    }

    fn write_of(&self, policy: &Policy, scope: &Scope, value: Vec<u8>) -> Write {
        Write {
            places: self.fields(policy, scope),
            value,
        }
    }

    /// Runs `write`; whether a hash changed. An error after a write may have been sent says
    /// so ([`OverrideError::Unconfirmed`]).
    async fn write(&self, write: Write) -> Result<bool, OverrideError> {
        let stamp = self.announce().await?;
        let mut sent = false;
        let written = self.write_at(&write, stamp, &mut sent).await;
        if written.is_err() && sent && self.inner.batcher.is_clustered() {
            rewrite_until_answered(Arc::downgrade(&self.inner), write, stamp);
        }
        written.map_err(|error| match sent {
            true => OverrideError::Unconfirmed(error),
            false => OverrideError::Store(error),
        })
    }

    /// Writes `write` under `stamp` at every place, each even where another failed; then, in
    /// a Cluster, raises the version where something changed. Whether a hash changed, or the
    /// first error.
    async fn write_at(
        &self,
        write: &Write,
        stamp: u64,
        sent: &mut bool,
    ) -> Result<bool, StoreError> {
        let clustered = self.inner.batcher.is_clustered();
        let version = limits_key(&self.inner.prefix);
        let (mut changed, mut failed) = (false, None);
        for (hash, field) in &write.places {
            let mut keys = vec![hash.clone(), format!("{hash}:stamps")];
            if !clustered {
                keys.push(version.clone());
            }
            match self.write_one(keys, field, &write.value, stamp, sent).await {
                Ok(one) => changed |= one,
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if changed && clustered {
            if let Err(error) = self.announce().await {
                failed = failed.or(Some(error));
            }
        }
        failed.map_or(Ok(changed), Err)
    }

    /// One call of `override_write.lua`; whether it changed the hash.
    async fn write_one(
        &self,
        keys: Vec<String>,
        field: &str,
        value: &[u8],
        stamp: u64,
        sent: &mut bool,
    ) -> Result<bool, StoreError> {
        let args: Vec<Value> = vec![
            field.into(),
            Value::Bytes(value.to_vec().into()),
            Value::Integer(stamp as i64),
        ];
        let hash = keys[0].clone();
        let call = |client: Client| {
            let (keys, args) = (keys.clone(), args.clone());
            async move {
                client
                    .eval::<(i64, u64, String), _, _, _>(WRITE.as_str(), keys, args)
                    .await
            }
        };
        let started = Instant::now();
        let reply = self
            .guarded(&hash, self.inner.batcher.on(&hash, call))
            .await;
        *sent |= !matches!(reply, Err(StoreError::Unavailable));
        let (changed, version, epoch) = reply?;
        if version > 0 {
            let epoch = Some(epoch);
            self.inner.limits_seen(Reading { epoch, version }, started);
        }
        Ok(changed == 1)
    }

    /// Raises the limits version, so that every store follows a change; the new version.
    async fn announce(&self) -> Result<u64, StoreError> {
        let started = Instant::now();
        let reading = bump(&self.inner).await?;
        let version = reading.version;
        self.inner.limits_seen(reading, started);
        Ok(version)
    }
}

/// One call of `limits_bump.lua`, behind the breaker of the version's lane.
async fn bump(inner: &Inner) -> Result<Reading, StoreError> {
    let key = limits_key(&inner.prefix);
    let call = |client: Client| {
        let keys = vec![key.clone()];
        async move {
            client
                .eval::<(u64, String), _, _, _>(BUMP.as_str(), keys, ())
                .await
        }
    };
    let lane = inner.lane_of(&key);
    let (version, epoch) = inner.guarded(lane, inner.batcher.on(&key, call)).await?;
    let epoch = Some(epoch);
    Ok(Reading { epoch, version })
}

/// Writes `write` again under its `stamp`, and then raises the version, every [`WATCH`]
/// until Redis answers or the store is dropped. A write in a Cluster whose reply was lost may
/// land after the version was raised; the retry is answered only once the first try can
/// change nothing more (the same stamp is refused), so the raise after it announces whatever
/// landed.
fn rewrite_until_answered(inner: Weak<Inner>, write: Write, stamp: u64) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(WATCH).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let store = RedisStore { inner };
            let mut sent = false;
            let retried = store.write_at(&write, stamp, &mut sent).await;
            if retried.is_ok() && store.announce().await.is_ok() {
                return;
            }
        }
    });
}
