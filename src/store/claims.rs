//! Which unnamed policies the live layers of one store use, so that two layers built
//! separately never share a budget without a word.
//!
//! An unnamed policy's identity is its algorithm and limits (see
//! [identity](crate::Policy#identity)): two layers that both parse `"3/1m"` would write the same
//! keys. With a store of their own each (the default `MemoryStore` of each builder) they keep
//! apart budgets; on one store passed to both (a `RedisStore` in production) they would share
//! one. So a store keeps a registry of the unnamed identities its live layers use
//! ([`Claims`]), and a layer that asks for one another live layer holds is refused at build
//! time ([`BuildError::PolicyInUse`]). Named policies own their state by name and share it on
//! purpose: they are not claimed.
//!
//! A layer's [`Claim`] lives in its rule table, which the layer, its clones and the services
//! they made share: it goes, releasing its identities, when the last of them is dropped.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::{BuildError, Policy};

/// A store's registry of the unnamed policy identities claimed by its live layers. Clones of
/// the store share it (it sits in the store's shared state); two stores made apart (two
/// `RedisStore`s on one Redis, as two instances of a fleet have) have one each.
#[derive(Debug, Clone, Default)]
pub struct Claims {
    taken: Arc<Mutex<HashSet<Arc<str>>>>,
}

impl Claims {
    fn lock(&self) -> MutexGuard<'_, HashSet<Arc<str>>> {
        // A set of strings is never left half-changed: a panic elsewhere does not poison it.
        self.taken.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The unnamed identities one layer holds in its store's [`Claims`]; releases them when
/// dropped. A layer on a store without a registry holds none.
pub(crate) struct Claim {
    claims: Option<Claims>,
    held: Vec<Arc<str>>,
}

impl Claim {
    /// A claim of nothing yet in `claims`.
    pub(crate) fn new(claims: Option<Claims>) -> Self {
        Claim {
            claims,
            held: Vec::new(),
        }
    }

    /// Claims the unnamed identities among `policies` in place of those held so far (a
    /// layer's first table, then each table that replaces it); nothing changes when another
    /// claim holds one of them.
    pub(crate) fn take<'a>(
        &mut self,
        policies: impl IntoIterator<Item = &'a Policy>,
    ) -> Result<(), BuildError> {
        let Some(claims) = &self.claims else {
            return Ok(());
        };
        let mut wanted: Vec<(Arc<str>, &Policy)> = Vec::new();
        for policy in policies.into_iter().filter(|p| is_unnamed(p)) {
            let identity: Arc<str> = policy.identity().into();
            if !wanted.iter().any(|(id, _)| *id == identity) {
                wanted.push((identity, policy));
            }
        }
        let mut taken = claims.lock();
        let ours = |id: &Arc<str>| self.held.contains(id);
        if let Some((_, policy)) = wanted
            .iter()
            .find(|(id, _)| !ours(id) && taken.contains(id))
        {
            return Err(BuildError::PolicyInUse(policy.to_string()));
        }
        for id in &self.held {
            taken.remove(id);
        }
        self.held = wanted.into_iter().map(|(id, _)| id).collect();
        taken.extend(self.held.iter().cloned());
        Ok(())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(claims) = &self.claims {
            let mut taken = claims.lock();
            for id in &self.held {
                taken.remove(id);
            }
        }
    }
}

/// Whether `policy` is unnamed: parsed from text or made from a limit, or given the name
/// those get.
fn is_unnamed(policy: &Policy) -> bool {
    policy.name() == Policy::DEFAULT_NAME
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(text: &str) -> Policy {
        text.parse().unwrap()
    }

    #[test]
    fn an_unnamed_identity_is_held_by_one_claim_until_it_is_dropped() {
        let claims = Claims::default();
        let mut first = Claim::new(Some(claims.clone()));
        first.take([&policy("3/1m"), &policy("3/1m")]).unwrap();
        let mut second = Claim::new(Some(claims.clone()));
        assert_eq!(
            second.take([&policy("5/1m"), &policy("3/1m")]),
            Err(BuildError::PolicyInUse("3/1m".into()))
        );
        // A refused claim holds nothing.
        let mut third = Claim::new(Some(claims.clone()));
        third.take([&policy("5/1m")]).unwrap();
        drop(first);
        second.take([&policy("3/1m")]).unwrap();
    }

    #[test]
    fn a_claim_replaced_keeps_its_own_and_frees_the_rest() {
        let claims = Claims::default();
        let mut claim = Claim::new(Some(claims.clone()));
        claim.take([&policy("3/1m"), &policy("4/1m")]).unwrap();
        claim.take([&policy("3/1m")]).unwrap();
        let mut other = Claim::new(Some(claims.clone()));
        other.take([&policy("4/1m")]).unwrap();
        assert!(claim.take([&policy("4/1m")]).is_err());
        // The refused replacement left the claim as it was.
        assert!(Claim::new(Some(claims)).take([&policy("3/1m")]).is_err());
    }

    #[test]
    fn named_policies_and_stores_without_a_registry_claim_nothing() {
        let claims = Claims::default();
        let named = Policy::new("api", ["3/1m".parse().unwrap()]).unwrap();
        Claim::new(Some(claims.clone())).take([&named]).unwrap();
        let mut kept = Claim::new(Some(claims.clone()));
        kept.take([&named]).unwrap();
        Claim::new(Some(claims)).take([&named]).unwrap();
        Claim::new(None).take([&policy("3/1m")]).unwrap();
        Claim::new(None).take([&policy("3/1m")]).unwrap();
    }
}
