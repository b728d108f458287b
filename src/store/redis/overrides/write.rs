//! Writing an override so that every instance follows it, whatever becomes of the reply.
//!
//! On a single Redis each write raises the limits version in the same script
//! (`scripts/override_write.lua`): a write that ran was announced, even where its reply was lost
//! to a timeout. In a Redis Cluster the version lives in its own hash slot, so a write is
//! ordered: a stamp from the version first (for a policy's override, written to every lane),
//! then the writes, then the version raised again. Where a write may have been sent and no
//! reply confirmed it, the store raises the version again in the background, every
//! quarter second until Redis answers: a raise without a change is harmless, and the change,
//! if it landed, is announced once Redis answers again.

use std::sync::{Arc, LazyLock, Weak};

use fred::clients::Client;
use fred::interfaces::LuaInterface;
use fred::types::Value;
use tokio::time::Instant;

use super::super::{Inner, RedisStore};
use super::value::encode;
use super::version::{limits_key, Reading, WATCH};
use crate::store::overrides::{Entry, OverrideError, Scope};
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
/// `places`; `stamped` where it is a policy's, written to every lane, whose lanes must end
/// alike when two writes cross.
struct Write {
    places: Vec<(String, String)>,
    value: Vec<u8>,
    stamped: bool,
}

impl RedisStore {
    pub(crate) async fn set_override(
        &self,
        policy: &Policy,
        scope: &Scope,
        entry: &Entry,
    ) -> Result<(), OverrideError> {
        let value = encode(policy, scope, entry);
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
            // A policy's override is written to every lane; in a Cluster every write is
            // stamped (see `write`).
            stamped: matches!(scope, Scope::All) || self.inner.batcher.is_clustered(),
        }
    }

    /// Runs `write`; whether a hash changed. An error after a write may have been sent says
    /// so ([`OverrideError::Unconfirmed`]).
    async fn write(&self, write: Write) -> Result<bool, OverrideError> {
        let mut sent = false;
        if !self.inner.batcher.is_clustered() {
            let written = self.write_with_version(&write, &mut sent).await;
            return written.map_err(|error| unconfirmed_if(sent, error));
        }
        // A Cluster: every write carries a stamp, so that a retry of it never undoes a later
        // one, nor does the first try landing after the retry.
        let stamp = self.announce().await?;
        let written = self.write_then_announce(&write, stamp, &mut sent).await;
        if written.is_err() && sent {
            rewrite_until_answered(Arc::downgrade(&self.inner), write, stamp);
        }
        written.map_err(|error| unconfirmed_if(sent, error))
    }

    /// A single Redis: each write raises the version in its own script.
    async fn write_with_version(&self, write: &Write, sent: &mut bool) -> Result<bool, StoreError> {
        let version = limits_key(&self.inner.prefix);
        let mut changed = false;
        for (hash, field) in &write.places {
            let keys = vec![hash.clone(), format!("{hash}:stamps"), version.clone()];
            changed |= self.write_one(keys, field, write, 0, sent).await?;
        }
        Ok(changed)
    }

    /// A Redis Cluster: the writes under `stamp`, then the version raised where something
    /// changed.
    async fn write_then_announce(
        &self,
        write: &Write,
        stamp: u64,
        sent: &mut bool,
    ) -> Result<bool, StoreError> {
        let mut changed = false;
        for (hash, field) in &write.places {
            let keys = vec![hash.clone(), format!("{hash}:stamps")];
            changed |= self.write_one(keys, field, write, stamp, sent).await?;
        }
        if changed {
            self.announce().await?;
        }
        Ok(changed)
    }

    /// One call of `override_write.lua`; whether it changed the hash.
    async fn write_one(
        &self,
        keys: Vec<String>,
        field: &str,
        write: &Write,
        stamp: u64,
        sent: &mut bool,
    ) -> Result<bool, StoreError> {
        let args: Vec<Value> = vec![
            field.into(),
            Value::Bytes(write.value.clone().into()),
            Value::Integer(stamp as i64),
            Value::Integer(i64::from(write.stamped)),
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

/// The error of a write: [`OverrideError::Unconfirmed`] where a write may have been sent.
fn unconfirmed_if(sent: bool, error: StoreError) -> OverrideError {
    match sent {
        true => OverrideError::Unconfirmed(error),
        false => OverrideError::Store(error),
    }
}

/// Writes `write` again under its `stamp`, and then raises the version, every quarter second
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
            let retried = store.write_then_announce(&write, stamp, &mut sent).await;
            if retried.is_ok() && store.announce().await.is_ok() {
                return;
            }
        }
    });
}
