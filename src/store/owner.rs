//! Whose run-time overrides govern a policy's decisions ([`Overrides`](super::Overrides)).
//!
//! Overrides belong to the policy's *owner*, not to its identity: a named policy's name, or an
//! unnamed policy's identity (its algorithm and whole limits: unnamed policies never share
//! anything by accident). So a block survives a rules edit that changes a named policy's
//! windows or algorithm. Counts are set for the windows of one identity, and apply only to
//! decisions under that identity ([`Owner::fits`]); the rest is stored under the owner.
//!
//! A policy built for a plan ([`Policy::on_plan`](crate::Policy::on_plan)) carries the plan's
//! name, so that its decisions also find the plan's override.

use std::sync::Arc;

/// The owner of a policy's overrides, and the plan its decisions are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The name of a named policy, the identity of an unnamed one.
    name: Arc<str>,
    /// The field of the owner's policy-wide override on Redis ([`stable_id`] of it).
    all: u64,
    /// The plan, and the field of its override on Redis; `None` for a decision on no plan.
    plan: Option<(Arc<str>, u64)>,
}

impl Owner {
    /// The owner of a policy named `name` whose identity is `identity`, on no plan.
    pub(crate) fn new(name: &str, identity: &Arc<str>, unnamed: bool) -> Owner {
        let name: Arc<str> = if unnamed {
            Arc::clone(identity)
        } else {
            name.into()
        };
        Owner {
            all: stable_id(&["all", &name]),
            name,
            plan: None,
        }
    }

    /// The same owner, for decisions on `plan`.
    pub(crate) fn on_plan(&self, plan: &str) -> Owner {
        let id = stable_id(&["plan", &self.name, plan]);
        Owner {
            plan: Some((plan.into(), id)),
            ..self.clone()
        }
    }

    /// The name overrides are stored under: a named policy's name, an unnamed one's identity.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The field of the policy-wide override on Redis.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn all_id(&self) -> u64 {
        self.all
    }

    /// The plan, if the decision is on one.
    pub(crate) fn plan(&self) -> Option<&str> {
        self.plan.as_ref().map(|(plan, _)| &**plan)
    }

    /// The field of `plan`'s override on Redis.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn plan_id_of(&self, plan: &str) -> u64 {
        stable_id(&["plan", &self.name, plan])
    }

    /// The field of the decision's plan's override on Redis; 0 for no plan.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn plan_id(&self) -> u64 {
        self.plan.as_ref().map_or(0, |&(_, id)| id)
    }
}

/// BLAKE3 of `parts` joined by newlines, its first 52 bits (exact in Lua's doubles): the same
/// in every process and version. Never 0, which stands for no plan.
pub(crate) fn stable_id(parts: &[&str]) -> u64 {
    let digest = blake3::hash(parts.join("\n").as_bytes());
    let mut first = [0; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    (u64::from_le_bytes(first) & ((1 << 52) - 1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_part_names_plans_and_unnamed_policies() {
        let identity: Arc<str> = "api:gcra:1m".into();
        let api = Owner::new("api", &identity, false);
        assert_eq!(api.name(), "api");
        let other: Arc<str> = "api:log:1m+1h".into();
        // Another identity of one name: one owner.
        assert_eq!(Owner::new("api", &other, false), api);
        let unnamed: Arc<str> = "default:gcra:5/1m".into();
        assert_eq!(
            Owner::new("default", &unnamed, true).name(),
            "default:gcra:5/1m"
        );
        let free = api.on_plan("free");
        assert_eq!(free.plan(), Some("free"));
        assert_eq!(free.plan_id(), api.plan_id_of("free"));
        assert_ne!(free.plan_id(), api.all_id());
        assert_ne!(api.on_plan("").plan_id(), api.all_id());
        assert_eq!(api.plan_id(), 0);
    }
}
