//! The overrides of a [`MemoryStore`](crate::MemoryStore): per owner (a named policy's name,
//! an unnamed one's identity; see `owner.rs`), the policy-wide override, the plans' and the
//! keys'. Which one decides a request: [`Scope`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::overrides::{
    Applied, Backend, BoxFuture, OverrideError, Pages, Ruling, Scope, Stored, StoredPage,
};
use crate::{Key, Policy, StoreError};

/// The overrides of a memory store.
#[derive(Default)]
pub(crate) struct OverrideTable {
    by_owner: RwLock<HashMap<Box<str>, OwnerOverrides>>,
    /// Whether any override is set, so that a store without any skips the lock.
    any: AtomicBool,
    /// Bumped by every change.
    version: AtomicU64,
}

/// The overrides of one owner, one per scope.
#[derive(Default)]
struct OwnerOverrides {
    all: Option<Ruling>,
    plans: HashMap<Box<str>, Ruling>,
    keys: HashMap<Key, Ruling>,
}

impl OwnerOverrides {
    fn get(&self, scope: &Scope) -> Option<&Ruling> {
        match scope {
            Scope::All => self.all.as_ref(),
            Scope::Plan(plan) => self.plans.get(plan.as_str()),
            Scope::Key(key) => self.keys.get(key),
        }
    }

    /// Sets (`Some`) or removes (`None`) the override of `scope`; whether there was one.
    fn put(&mut self, scope: &Scope, ruling: Option<Ruling>) -> bool {
        let before = match (scope, ruling) {
            (Scope::All, ruling) => std::mem::replace(&mut self.all, ruling),
            (Scope::Plan(plan), Some(ruling)) => self.plans.insert(plan.as_str().into(), ruling),
            (Scope::Plan(plan), None) => self.plans.remove(plan.as_str()),
            (Scope::Key(key), Some(ruling)) => self.keys.insert(key.clone(), ruling),
            (Scope::Key(key), None) => self.keys.remove(key),
        };
        before.is_some()
    }

    fn is_empty(&self) -> bool {
        self.all.is_none() && self.plans.is_empty() && self.keys.is_empty()
    }

    /// What governs a decision of `key` under `policy` (see [`Scope`]): the first of the
    /// key's, the plan's and the policy-wide override that is a block or counts set for the
    /// policy's identity.
    fn governing(&self, key: &Key, policy: &Policy) -> Option<&Ruling> {
        let plan = policy.plan().and_then(|plan| self.plans.get(plan));
        let fits = |ruling: &&Ruling| match ruling {
            Ruling::Block => true,
            Ruling::Limits(counts) => {
                let given = counts.given();
                given.override_id() == policy.override_id() && given.identity() == policy.identity()
            }
        };
        [self.keys.get(key), plan, self.all.as_ref()]
            .into_iter()
            .flatten()
            .find(fits)
    }
}

impl OverrideTable {
    /// What a decision of `key` under `policy` goes by.
    pub(crate) fn apply<'a>(&self, key: &Key, policy: &'a Policy) -> Applied<'a> {
        if !self.any.load(Ordering::Acquire) {
            return Applied::Own(policy);
        }
        let by_owner = self.by_owner.read().unwrap_or_else(|e| e.into_inner());
        let Some(overrides) = by_owner.get(policy.owner().name()) else {
            return Applied::Own(policy);
        };
        match overrides.governing(key, policy) {
            // The override's counts, set for the request's identity (name, algorithm and
            // windows), and the request's own for the windows it leaves out.
            Some(Ruling::Limits(counts)) => Applied::Other(counts.under(policy)),
            Some(Ruling::Block) => Applied::Blocked,
            None => Applied::Own(policy),
        }
    }

    /// How many changes there have been.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub(crate) fn set(&self, policy: &Policy, scope: &Scope, ruling: Ruling) {
        let mut by_owner = self.by_owner.write().unwrap_or_else(|e| e.into_inner());
        let owner = policy.owner().name();
        if !by_owner.contains_key(owner) {
            by_owner.insert(owner.into(), OwnerOverrides::default());
        }
        if let Some(overrides) = by_owner.get_mut(owner) {
            overrides.put(scope, Some(ruling));
        }
        self.any.store(true, Ordering::Release);
        self.version.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn get(&self, policy: &Policy, scope: &Scope) -> Option<Stored> {
        let by_owner = self.by_owner.read().unwrap_or_else(|e| e.into_inner());
        let overrides = by_owner.get(policy.owner().name())?;
        overrides.get(scope).map(Ruling::stored)
    }

    pub(crate) fn remove(&self, policy: &Policy, scope: &Scope) -> bool {
        let mut by_owner = self.by_owner.write().unwrap_or_else(|e| e.into_inner());
        let owner = policy.owner().name();
        let Some(overrides) = by_owner.get_mut(owner) else {
            return false;
        };
        let removed = overrides.put(scope, None);
        if overrides.is_empty() {
            by_owner.remove(owner);
        }
        self.any.store(!by_owner.is_empty(), Ordering::Release);
        self.version.fetch_add(1, Ordering::AcqRel);
        removed
    }

    /// Every override stored under `policy`'s owner, governing or not.
    pub(crate) fn list(&self, policy: &Policy) -> Vec<(Scope, Stored)> {
        let by_owner = self.by_owner.read().unwrap_or_else(|e| e.into_inner());
        let Some(overrides) = by_owner.get(policy.owner().name()) else {
            return Vec::new();
        };
        let all = overrides
            .all
            .iter()
            .map(|ruling| (Scope::All, ruling.stored()));
        let plans = overrides
            .plans
            .iter()
            .map(|(plan, ruling)| (Scope::Plan(plan.to_string()), ruling.stored()));
        let keys = overrides
            .keys
            .iter()
            .map(|(key, ruling)| (Scope::Key(key.clone()), ruling.stored()));
        all.chain(plans).chain(keys).collect()
    }
}

/// The memory store's side of [`Overrides`](super::Overrides): in this process, every future
/// ready at once.
impl Backend for OverrideTable {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn is_local(&self) -> bool {
        true
    }

    fn set<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
        ruling: Ruling,
    ) -> BoxFuture<'a, Result<(), OverrideError>> {
        OverrideTable::set(self, policy, scope, ruling);
        Box::pin(std::future::ready(Ok(())))
    }

    fn get<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<Option<Stored>, OverrideError>> {
        Box::pin(std::future::ready(Ok(OverrideTable::get(
            self, policy, scope,
        ))))
    }

    fn remove<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<bool, OverrideError>> {
        Box::pin(std::future::ready(Ok(OverrideTable::remove(
            self, policy, scope,
        ))))
    }

    /// All of them as one page: listing takes no round trip.
    fn pages(&self, policy: &Policy) -> Box<dyn Pages> {
        let page = self.list(policy);
        Box::new(OnePage((!page.is_empty()).then_some(page)))
    }
}

/// The memory store's one page, until it is taken.
struct OnePage(Option<StoredPage>);

impl Pages for OnePage {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<StoredPage, StoreError>>> {
        Box::pin(std::future::ready(self.0.take().map(Ok)))
    }
}

/// A handle on `table` as the store's overrides.
pub(crate) fn overrides(table: &Arc<OverrideTable>) -> super::Overrides {
    super::Overrides::new(Arc::clone(table) as Arc<dyn Backend>)
}
