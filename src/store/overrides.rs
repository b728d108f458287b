//! Limits changed at run time, for one client key or for every key of a policy, kept in the
//! store so that every instance that shares it decides by them.
//!
//! An override replaces a policy's counts, never its windows or algorithm, and keeps its
//! state: the usage recorded so far still counts (see [`Policy::identity`] for what that
//! means for each algorithm). So raising `5/1h` to `8/1h` after five requests admits three
//! more, lowering it refuses until enough usage has aged out, and removing the override
//! restores the policy's own counts. A block refuses every request of the key (or of the
//! policy) until it is removed. A key's own override wins over the policy's.
//!
//! On Redis an override lives in a hash per hash tag, in the hash slot of the keys it governs
//! (`src/store/redis/overrides.rs`), and the decision's own script reads it in the same call:
//! no round trip of its own, batching unchanged. The memory store keeps them in this process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::{Key, Limit, Policy, PolicyError, StoreError};

/// Whose limits an override changes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every key of the policy that has no override of its own.
    All,
    /// One client key. A key longer than [`Key::MAX_LEN`] bytes stands for the same hashed
    /// key that the layer's extractors give such a client.
    Key(Key),
}

/// What an override sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Override {
    /// These counts, for the policy's windows (one limit per window, in any order).
    Limits(Vec<Limit>),
    /// No request passes: a limit of zero.
    Block,
}

/// Why an override could not be set, read or listed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverrideError {
    /// The limits do not fit the policy: another set of windows, or an invalid limit.
    #[error("override: {0}")]
    Policy(#[from] PolicyError),
    /// The counts are out of the algorithm's range (see [`Policy::out_of_range`]).
    #[error("override: {0}")]
    OutOfRange(&'static str),
    /// The store could not be reached, or answered with an error, before any write was sent:
    /// nothing was changed.
    #[error("override: {0}")]
    Store(#[from] StoreError),
    /// A write was sent but no reply confirmed it (a timeout, a lost connection, an error
    /// after part of it was made): the change may have landed, in whole or in part. If it
    /// did, every instance follows it as any change: the limits version is raised with it
    /// (or, in a Redis Cluster, after it, until Redis answers). Setting or removing it again
    /// is safe.
    #[error("override: the change may have landed, unconfirmed (setting it again is safe): {0}")]
    Unconfirmed(StoreError),
}

/// The operator's handle on a store's overrides: set, read, list and remove them. Cheap to
/// clone; clones share the store.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redis_ratelimit::store::{Override, Scope};
/// use tower_redis_ratelimit::{Key, Limit, MemoryStore, Policy, Store};
///
/// let store = MemoryStore::new();
/// let sms = Policy::new("sms", ["5/1h".parse::<Limit>()?])?;
/// let phone = Key::from("+44 7700 900123");
/// for _ in 0..5 {
///     assert!(store.check(&phone, &sms, 1).await?.is_allowed());
/// }
/// assert!(!store.check(&phone, &sms, 1).await?.is_allowed());
///
/// // Eight an hour for this phone from now on: three more, usage kept.
/// let overrides = store.overrides();
/// let eight = Override::Limits(vec!["8/1h".parse()?]);
/// overrides.set(&sms, &Scope::Key(phone.clone()), &eight).await?;
/// let decision = store.check(&phone, &sms, 1).await?;
/// assert!(decision.is_allowed());
/// assert_eq!(decision.limit(), 8);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Overrides {
    backend: Backend,
}

#[derive(Clone)]
enum Backend {
    Memory(Arc<Table>),
    #[cfg(feature = "redis")]
    Redis(crate::RedisStore),
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Backend::Redis(_) => "redis",
        };
        f.debug_struct("Overrides").field("store", &kind).finish()
    }
}

impl Overrides {
    pub(crate) fn memory(table: Arc<Table>) -> Overrides {
        Overrides {
            backend: Backend::Memory(table),
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn redis(store: crate::RedisStore) -> Overrides {
        Overrides {
            backend: Backend::Redis(store),
        }
    }

    /// Sets the override of `policy` for `scope`, replacing any before it.
    ///
    /// Writers at once: each override is written whole, never half, and the last write wins.
    /// On Redis a policy's own override ([`Scope::All`]) is one write per hash tag; of two at
    /// once, every tag ends with the one stamped later by Redis' clock, even where the other
    /// arrived last (the earlier `set` still returns `Ok`: it was replaced).
    pub async fn set(
        &self,
        policy: &Policy,
        scope: &Scope,
        to: &Override,
    ) -> Result<(), OverrideError> {
        let entry = Entry::new(policy, to)?;
        match &self.backend {
            Backend::Memory(table) => table.set(policy, scope, entry),
            #[cfg(feature = "redis")]
            Backend::Redis(store) => store.set_override(policy, scope, &entry).await?,
        }
        Ok(())
    }

    /// The override of `policy` for `scope` (not the policy's, for a key that has none).
    pub async fn get(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<Option<Override>, OverrideError> {
        let counts = match &self.backend {
            Backend::Memory(table) => table.get(policy, scope).map(|entry| entry.counts()),
            #[cfg(feature = "redis")]
            Backend::Redis(store) => store.get_override(policy, scope).await?,
        };
        Ok(counts.map(|counts| Override::from_counts(policy, &counts)))
    }

    /// Removes the override of `policy` for `scope`; whether there was one.
    pub async fn remove(&self, policy: &Policy, scope: &Scope) -> Result<bool, OverrideError> {
        Ok(match &self.backend {
            Backend::Memory(table) => table.remove(policy, scope),
            #[cfg(feature = "redis")]
            Backend::Redis(store) => store.remove_override(policy, scope).await?,
        })
    }

    /// Every override of `policy`: the policy's own first, then its keys' in no set order.
    /// All of [`pages`](Self::pages) collected: one call per page of the policy's overrides,
    /// each within its own budget, so listing never slows a decision by more than a page.
    pub async fn list(&self, policy: &Policy) -> Result<Vec<(Scope, Override)>, OverrideError> {
        let mut pages = self.pages(policy);
        let mut listed = Vec::new();
        while let Some(page) = pages.next().await {
            listed.extend(page?);
        }
        listed.sort_by_key(|(scope, _)| *scope != Scope::All);
        Ok(listed)
    }

    /// The overrides of `policy` a page at a time, for an admin tool that shows them as they
    /// come rather than waiting for all of them (see [`OverridePages`]). Reads nothing until
    /// the first [`next`](OverridePages::next).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redis_ratelimit::store::{Override, Scope};
    /// use tower_redis_ratelimit::{Key, MemoryStore, Policy};
    ///
    /// let store = MemoryStore::new();
    /// let sms = Policy::new("sms", ["5/1h".parse()?])?;
    /// let overrides = store.overrides();
    /// overrides.set(&sms, &Scope::Key(Key::from("+44 7700 900123")), &Override::Block).await?;
    /// let mut pages = overrides.pages(&sms);
    /// let mut count = 0;
    /// while let Some(page) = pages.next().await {
    ///     count += page?.len();
    /// }
    /// assert_eq!(count, 1);
    /// # Ok(()) }
    /// ```
    pub fn pages(&self, policy: &Policy) -> OverridePages {
        let pages = match &self.backend {
            Backend::Memory(table) => Pages::Memory(Some(table.clone())),
            #[cfg(feature = "redis")]
            Backend::Redis(store) => {
                Pages::Redis(crate::store::redis::RedisPages::new(store.clone(), policy))
            }
        };
        OverridePages {
            policy: policy.clone(),
            pages,
        }
    }
}

/// A policy's overrides, a page at a time: what [`Overrides::pages`] returns.
///
/// On Redis a page is one `HSCAN` of up to about 1 000 overrides, with a budget of its own
/// (1 s) outside the decisions' time budget and breaker: Redis runs one command at a time, so
/// a decision waits for one page at most, and a list that is slow or fails never makes the
/// decisions fail (or pass unchecked). An override set or removed during the listing may or
/// may not be listed; every other is listed exactly once. On the memory store, all the
/// overrides come as one page (it holds them in this process; listing takes no round trip).
pub struct OverridePages {
    policy: Policy,
    pages: Pages,
}

enum Pages {
    /// The table, until its one page is taken.
    Memory(Option<Arc<Table>>),
    #[cfg(feature = "redis")]
    Redis(crate::store::redis::RedisPages),
}

impl std::fmt::Debug for OverridePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let policy = self.policy.identity();
        f.debug_struct("OverridePages")
            .field("policy", &policy)
            .finish()
    }
}

impl OverridePages {
    /// The next page: overrides not listed yet, never an empty page; `None` when all are
    /// listed. After an error, the next call asks for the same page again, so an admin tool
    /// can retry a page that timed out without starting over.
    pub async fn next(&mut self) -> Option<Result<Vec<(Scope, Override)>, OverrideError>> {
        let page: Result<_, StoreError> = match &mut self.pages {
            Pages::Memory(table) => Some(table.take()?.list(&self.policy))
                .filter(|page| !page.is_empty())
                .map(Ok),
            #[cfg(feature = "redis")]
            Pages::Redis(pages) => pages.next().await,
        }?;
        let policy = &self.policy;
        let page = page.map(|page| {
            let with = |(scope, counts): (Scope, Vec<u64>)| {
                let to = Override::from_counts(policy, &counts);
                (scope, to)
            };
            page.into_iter().map(with).collect()
        });
        Some(page.map_err(OverrideError::from))
    }
}

impl Override {
    /// The override whose counts, one per limit of `policy` in its order, are `counts`
    /// (all 0: a block).
    pub(crate) fn from_counts(policy: &Policy, counts: &[u64]) -> Override {
        if counts.iter().all(|&c| c == 0) {
            return Override::Block;
        }
        let limits = policy.limits().iter().zip(counts);
        Override::Limits(
            limits
                .filter_map(|(limit, &count)| Limit::new(count, limit.window()).ok())
                .collect(),
        )
    }
}

/// An override as a store applies it: the policy under its counts, or a block.
#[derive(Debug, Clone)]
pub(crate) enum Entry {
    Limits(Policy),
    Block,
}

impl Entry {
    /// `to` for `policy`, checked: limits must keep the policy's windows, and be in range.
    pub(crate) fn new(policy: &Policy, to: &Override) -> Result<Entry, OverrideError> {
        Ok(match to {
            Override::Limits(limits) => {
                let other = policy.with_limits(limits.iter().copied())?;
                if let Some(why) = other.out_of_range() {
                    return Err(OverrideError::OutOfRange(why));
                }
                Entry::Limits(other)
            }
            Override::Block => Entry::Block,
        })
    }

    /// The counts, one per limit in the policy's order; all 0 for a block.
    pub(crate) fn counts(&self) -> Vec<u64> {
        match self {
            Entry::Limits(policy) => policy.limits().iter().map(Limit::count).collect(),
            Entry::Block => Vec::new(),
        }
    }
}

/// What a decision goes by.
pub(crate) enum Applied<'a> {
    /// The request's own policy.
    Own(&'a Policy),
    /// An override's counts.
    Other(Policy),
    /// A block.
    Blocked,
}

/// The overrides of a [`MemoryStore`](crate::MemoryStore): per policy identity, the policy's
/// own and its keys'.
#[derive(Default)]
pub(crate) struct Table {
    by_policy: RwLock<HashMap<Arc<str>, PolicyOverrides>>,
    /// Whether any override is set, so that a store without any skips the lock.
    any: AtomicBool,
    /// Bumped by every change.
    version: AtomicU64,
}

#[derive(Default)]
struct PolicyOverrides {
    all: Option<Entry>,
    keys: HashMap<Key, Entry>,
}

impl Table {
    /// What a decision of `key` under `policy` goes by.
    pub(crate) fn apply<'a>(&self, key: &Key, policy: &'a Policy) -> Applied<'a> {
        if !self.any.load(Ordering::Acquire) {
            return Applied::Own(policy);
        }
        let by_policy = self.by_policy.read().unwrap_or_else(|e| e.into_inner());
        let Some(overrides) = by_policy.get(policy.identity()) else {
            return Applied::Own(policy);
        };
        match overrides.keys.get(key).or(overrides.all.as_ref()) {
            // The override's counts under the request's policy (the same identity: name,
            // algorithm and windows).
            Some(Entry::Limits(other)) => Applied::Other(other.clone()),
            Some(Entry::Block) => Applied::Blocked,
            None => Applied::Own(policy),
        }
    }

    /// How many changes there have been.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    fn set(&self, policy: &Policy, scope: &Scope, entry: Entry) {
        let mut by_policy = self.by_policy.write().unwrap_or_else(|e| e.into_inner());
        let overrides = by_policy.entry(Arc::from(policy.identity())).or_default();
        match scope {
            Scope::All => overrides.all = Some(entry),
            Scope::Key(key) => {
                overrides.keys.insert(key.clone(), entry);
            }
        }
        self.any.store(true, Ordering::Release);
        self.version.fetch_add(1, Ordering::AcqRel);
    }

    fn get(&self, policy: &Policy, scope: &Scope) -> Option<Entry> {
        let by_policy = self.by_policy.read().unwrap_or_else(|e| e.into_inner());
        let overrides = by_policy.get(policy.identity())?;
        match scope {
            Scope::All => overrides.all.clone(),
            Scope::Key(key) => overrides.keys.get(key).cloned(),
        }
    }

    fn remove(&self, policy: &Policy, scope: &Scope) -> bool {
        let mut by_policy = self.by_policy.write().unwrap_or_else(|e| e.into_inner());
        let Some(overrides) = by_policy.get_mut(policy.identity()) else {
            return false;
        };
        let removed = match scope {
            Scope::All => overrides.all.take().is_some(),
            Scope::Key(key) => overrides.keys.remove(key).is_some(),
        };
        if overrides.all.is_none() && overrides.keys.is_empty() {
            by_policy.remove(policy.identity());
        }
        self.any.store(!by_policy.is_empty(), Ordering::Release);
        self.version.fetch_add(1, Ordering::AcqRel);
        removed
    }

    fn list(&self, policy: &Policy) -> Vec<(Scope, Vec<u64>)> {
        let by_policy = self.by_policy.read().unwrap_or_else(|e| e.into_inner());
        let Some(overrides) = by_policy.get(policy.identity()) else {
            return Vec::new();
        };
        let all = overrides
            .all
            .iter()
            .map(|entry| (Scope::All, entry.counts()));
        let keys = overrides
            .keys
            .iter()
            .map(|(key, entry)| (Scope::Key(key.clone()), entry.counts()));
        all.chain(keys).collect()
    }
}
