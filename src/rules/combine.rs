//! Which rules a layer can take: the rules on how its policies combine with one another and
//! with the layer's other options (its plan function, its store, soft limits, decisions). A table is checked against them when the layer is built and again
//! each time it is replaced at run time ([`RuleTable::replace`](super::RuleTable::replace), a
//! rules file), so each rule is one function here, returning the [`BuildError`] that reports
//! it.

use super::rule::Plans;
use crate::usage::UsageReport;
use crate::{BuildError, Policy, StoreError};

/// Whether the layer's store can decide a policy ([`Store::supports`](crate::Store::supports)).
pub(crate) type Supports = dyn Fn(&Policy) -> Result<(), StoreError> + Send + Sync;

/// What a layer has that its policies must fit, fixed when it is built.
pub(crate) struct Capabilities {
    /// Whether the layer has a plan function: without one, plans would never apply.
    pub(crate) plan_fn: bool,
    /// Whether every policy of the layer is soft.
    pub(crate) soft: bool,
    /// Whether the layer puts its decisions into the requests.
    pub(crate) decisions: bool,
    /// The step of a layer that meters request bodies, which every limit must admit.
    pub(crate) step: Option<u32>,
    /// Whether the layer's store can decide a policy.
    pub(crate) supports: Box<Supports>,
    /// How the layer reports usage, whose step must fit each policy.
    pub(crate) usage: Option<UsageReport>,
}

impl Capabilities {
    /// Checks one policy of a table, with its plans and whether its rule is soft, against the
    /// layer and against the policies of the table checked before it (`names`).
    pub(crate) fn validate(
        &self,
        names: &mut Names,
        policy: &Policy,
        plans: &Plans,
        soft: bool,
    ) -> Result<(), BuildError> {
        self.plans_need_plan_fn(policy, plans)?;
        self.store_decides(policy, plans)?;
        self.step_fits(policy, plans)?;
        names.admit(policy, plans)?;
        self.soft_needs_decisions(policy, soft)
    }

    /// Plans need the layer's plan function, which says which plan a request is on: without
    /// one they would never apply.
    fn plans_need_plan_fn(&self, policy: &Policy, plans: &Plans) -> Result<(), BuildError> {
        match (self.plan_fn, plans.first()) {
            (false, Some((plan, _))) => Err(BuildError::Plan {
                policy: policy.name().to_owned(),
                plan: plan.clone(),
                why: "the layer has no plan function (RateLimitLayerBuilder::plan)".into(),
            }),
            _ => Ok(()),
        }
    }

    /// The store must be able to decide the policy and each plan's limits.
    fn store_decides(&self, policy: &Policy, plans: &Plans) -> Result<(), BuildError> {
        let plans = plans.iter().map(|(_, plan)| plan);
        for policy in std::iter::once(policy).chain(plans) {
            (self.supports)(policy).map_err(|error| BuildError::Unsupported {
                policy: policy.name().to_owned(),
                why: error.to_string(),
            })?;
        }
        Ok(())
    }

    /// A step, of a usage report ([`UsageReport::step`](crate::usage::UsageReport::step)) or
    /// of a layer that meters request bodies, must be admissible under the policy and each
    /// plan's limits: a step larger than a limit's count could never be admitted, and every
    /// body past its first credit would be cut.
    fn step_fits(&self, policy: &Policy, plans: &Plans) -> Result<(), BuildError> {
        let plans = plans.iter().map(|(_, plan)| plan);
        for policy in std::iter::once(policy).chain(plans) {
            if let Some(report) = &self.usage {
                report.check_step(policy)?;
            }
            if let Some(step) = self.step {
                request_step_fits(step, policy)?;
            }
        }
        Ok(())
    }

    /// A soft limit passes a request over it on, so the handler must be able to see its
    /// decision.
    fn soft_needs_decisions(&self, policy: &Policy, soft: bool) -> Result<(), BuildError> {
        if (self.soft || soft) && !self.decisions {
            return Err(BuildError::Unsupported {
                policy: policy.name().to_owned(),
                why: "a soft limit needs the decisions in the requests (.decisions(true)), \
                      for the handler to see a request over it"
                    .into(),
            });
        }
        Ok(())
    }
}

/// A request body's step (`RequestBytes::step`) of `step` bytes fits `policy` when no limit
/// that admits anything counts fewer (a limit of 0 refuses steps of every size alike).
fn request_step_fits(step: u32, policy: &Policy) -> Result<(), BuildError> {
    let counts = policy.limits().iter().map(|l| l.count()).filter(|&c| c > 0);
    match counts.min() {
        Some(count) if u64::from(step) > count => Err(BuildError::Unsupported {
            policy: policy.name().to_owned(),
            why: format!(
                "a step of {step} bytes is more than the limit of {count}: make the step \
                 (RequestBytes::step) at most the smallest count"
            ),
        }),
        _ => Ok(()),
    }
}

/// A table needs a policy: a default one (`default`) or at least one rule.
pub(crate) fn some_policy(default: bool, rules: usize) -> Result<(), BuildError> {
    if !default && rules == 0 {
        return Err(BuildError::NoPolicy);
    }
    Ok(())
}

/// The policies of a table by name: policies of one name must agree in every rule, plans
/// included, since the fields and the metrics name them and their state is one.
#[derive(Default)]
pub(crate) struct Names(Vec<(Policy, Plans)>);

impl Names {
    /// Takes in `policy` with `plans`; the conflict with an earlier policy of its name, if
    /// they differ.
    pub(crate) fn admit(&mut self, policy: &Policy, plans: &Plans) -> Result<(), BuildError> {
        match self.0.iter().find(|(p, _)| p.name() == policy.name()) {
            Some((same, same_plans)) if same != policy || same_plans != plans => {
                Err(BuildError::PolicyConflict(policy.name().to_owned()))
            }
            Some(_) => Ok(()),
            None => {
                self.0.push((policy.clone(), plans.clone()));
                Ok(())
            }
        }
    }
}
