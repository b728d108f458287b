//! The rule table: which policy, and which of its plans' limits, decide a request. A layer reads
//! it once per request through an [`ArcSwap`], so that [`RuleTable::replace`] changes it for
//! the requests that follow without a lock on the request path and without a redeploy.
//!
//! Replacing the table changes which limits decide, never whose state they decide: state is
//! kept by policy identity (name, algorithm, windows; see [`Policy::identity`]), so a policy
//! whose counts change keeps its usage, as with an override in the store. The deny cache and
//! the leases hold for the exact limits they were decided against, so a raise is not shadowed
//! by a refusal cached under the old counts.

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::response::{Options, Responder};
use crate::rule::{Built, Matcher, PlanFn, Plans, RequestHead};
use crate::{Algorithm, BuildError, Policy, Rule, StoreError};

/// A layer's rules and default policy, as a value: what [`RuleTable::replace`] puts in force,
/// and what [`RateLimitLayerBuilder::rules`](crate::RateLimitLayerBuilder::rules) starts from.
/// With the `config` feature it can be read from a TOML file (see [`Rules::from_toml`]).
///
/// ```
/// use tower_redis_ratelimit::{Policy, Rules, Rule};
///
/// let rules = Rules::new()
///     .rule(Rule::new(Policy::new("login", ["5/1m".parse()?])?).path("/login"))
///     .policy("300/1m");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Rules {
    pub(crate) default: Option<Result<Policy, BuildError>>,
    pub(crate) rules: Vec<Rule>,
    /// The default policy's plans.
    pub(crate) default_plans: Vec<(String, Result<Policy, BuildError>)>,
    /// Whether the default policy is soft (a rules file's `soft = true` under `[default]`).
    pub(crate) default_soft: bool,
}

impl Rules {
    /// No rules and no default policy (which no table accepts: give it one or the other).
    pub fn new() -> Self {
        Rules::default()
    }

    /// The default policy, for requests that no rule matches: a [`Policy`] or text such as
    /// `"300/1m"`. Without one, requests that no rule matches are not limited.
    pub fn policy<P>(mut self, policy: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        self.default = Some(policy.try_into().map_err(Into::into));
        self
    }

    /// Adds a rule; the first rule that matches a request chooses its policy.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// The default policy's limits for requests on plan `plan`, as [`Rule::plan`].
    pub fn plan<P>(mut self, plan: impl Into<String>, limits: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        let limits = limits.try_into().map_err(Into::into);
        self.default_plans.push((plan.into(), limits));
        self
    }

    /// The default policy as a catch-all rule, so that it is checked like any rule's.
    fn default_rule(&mut self) -> Option<Result<Rule, BuildError>> {
        let policy = self.default.take()?;
        let plans = std::mem::take(&mut self.default_plans);
        let soft = self.default_soft;
        Some(policy.map(|policy| {
            let rule = plans
                .into_iter()
                .fold(Rule::new(policy), |rule, (plan, limits)| {
                    rule.plan_checked(plan, limits)
                });
            if soft {
                rule.soft()
            } else {
                rule
            }
        }))
    }
}

/// The checked form of [`Rules`], as requests read it.
pub(crate) struct Table {
    rules: Vec<(Matcher, Choice)>,
    default: Option<Choice>,
}

/// A policy and its plans, each with the responder that answers for it.
struct Choice {
    own: Arc<Responder>,
    plans: Box<[(Box<str>, Arc<Responder>)]>,
}

impl Choice {
    fn pick(&self, head: &RequestHead<'_>, plan: Option<&PlanFn>) -> &Arc<Responder> {
        // A policy without plans does not ask which plan the request is on.
        if self.plans.is_empty() {
            return &self.own;
        }
        let Some(name) = plan.and_then(|plan| plan(head)) else {
            return &self.own;
        };
        self.plans
            .iter()
            .find(|(plan, _)| **plan == *name)
            .map_or(&self.own, |(_, responder)| responder)
    }
}

impl Table {
    /// The responder of the policy, and the limits of the plan, that apply to `head`, if any.
    pub(crate) fn responder(
        &self,
        head: &RequestHead<'_>,
        plan: Option<&PlanFn>,
    ) -> Option<&Arc<Responder>> {
        self.rules
            .iter()
            .find(|(matcher, _)| matcher.matches(head))
            .map(|(_, choice)| choice)
            .or(self.default.as_ref())
            .map(|choice| choice.pick(head, plan))
    }

    /// The default policy.
    pub(crate) fn default_policy(&self) -> Option<&Policy> {
        self.default.as_ref().map(|choice| &choice.own.policy)
    }

    /// The policies of the rules, in order, then the default policy.
    fn policies(&self) -> impl Iterator<Item = &Policy> {
        let rules = self.rules.iter().map(|(_, choice)| choice);
        rules.chain(&self.default).map(|choice| &choice.own.policy)
    }
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

/// Whether the layer's store can decide a policy ([`Store::supports`](crate::Store::supports)).
pub(crate) type Supports = dyn Fn(&Policy) -> Result<(), StoreError> + Send + Sync;

/// What checks a table against the layer: its algorithm, its store, its response options.
pub(crate) struct Compiler {
    pub(crate) algorithm: Option<Algorithm>,
    pub(crate) options: Options,
    pub(crate) supports: Box<Supports>,
    /// Whether the layer has a plan function: without one, plans would never apply.
    pub(crate) plans_apply: bool,
    /// Whether the layer counts requests by outcome: its store only looks before a call.
    pub(crate) counts_outcomes: bool,
}

impl Compiler {
    /// Checks `rules` and makes the table requests read.
    pub(crate) fn compile(&self, mut rules: Rules) -> Result<Table, BuildError> {
        let default = rules.default_rule();
        if default.is_none() && rules.rules.is_empty() {
            return Err(BuildError::NoPolicy);
        }
        let mut names = Names::default();
        let mut choice = |policy: Policy, plans: Plans, soft: bool| -> Result<Choice, BuildError> {
            if let (false, Some((plan, _))) = (self.plans_apply, plans.first()) {
                return Err(BuildError::Plan {
                    policy: policy.name().to_owned(),
                    plan: plan.clone(),
                    why: "the layer has no plan function (RateLimitLayerBuilder::plan)".into(),
                });
            }
            let (policy, plans) = match self.algorithm {
                Some(a) => {
                    let plans = plans.into_iter().map(|(n, p)| (n, p.with_algorithm(a)));
                    (policy.with_algorithm(a), plans.collect())
                }
                None => (policy, plans),
            };
            for policy in std::iter::once(&policy).chain(plans.iter().map(|(_, p)| p)) {
                if let Err(error) = (self.supports)(policy) {
                    return Err(BuildError::Unsupported {
                        policy: policy.name().to_owned(),
                        why: error.to_string(),
                    });
                }
            }
            names.admit(&policy, &plans)?;
            let mut options = self.options.clone();
            options.soft |= soft;
            if options.soft && options.no_decisions {
                return Err(BuildError::Unsupported {
                    policy: policy.name().to_owned(),
                    why: "a soft limit needs the decisions in the requests (.decisions(true)), \
                          for the handler to see a request over it"
                        .into(),
                });
            }
            if self.counts_outcomes && policy.concurrency_limit().is_some() {
                return Err(BuildError::Unsupported {
                    policy: policy.name().to_owned(),
                    why: "a concurrency limit takes a slot when a request is checked, and a layer \
                          that counts by outcome only looks; limit concurrency in a layer of \
                          its own"
                        .into(),
                });
            }
            let responder = |policy| Arc::new(Responder::new(policy, options.clone()));
            let plans = plans
                .into_iter()
                .map(|(name, policy)| (name.into_boxed_str(), responder(policy)))
                .collect();
            Ok(Choice {
                own: responder(policy),
                plans,
            })
        };
        let rules = rules
            .rules
            .into_iter()
            .map(|rule| {
                let Built {
                    matcher,
                    policy,
                    plans,
                    soft,
                } = rule.build()?;
                Ok((matcher, choice(policy, plans, soft)?))
            })
            .collect::<Result<Vec<_>, BuildError>>()?;
        let default = match default.transpose()? {
            Some(rule) => {
                let built = rule.build()?;
                Some(choice(built.policy, built.plans, built.soft)?)
            }
            None => None,
        };
        Ok(Table { rules, default })
    }
}

/// The handle on a layer's rule table: replaces its rules and default policy for the requests
/// that follow, atomically (a request is decided by the old table or the new one, never by a
/// mix). Get it from [`RateLimitLayer::rule_table`](crate::RateLimitLayer::rule_table); clones
/// share the table.
///
/// What stays is the layer's: its key, store, algorithm, plan function, costs and options. A
/// replaced policy that keeps its name, algorithm and windows keeps its state, so new counts
/// apply to the usage recorded so far. For limits of one client, or a change every instance
/// of a fleet must make at once, use the store's [overrides](crate::store::Overrides) instead:
/// a table is one process's.
///
/// ```
/// use tower_redis_ratelimit::{RateLimitLayer, Rules};
///
/// let layer = RateLimitLayer::builder().policy("100/1m").build()?;
/// let table = layer.rule_table();
/// table.replace(Rules::new().policy("200/1m"))?;
/// assert_eq!(layer.policy().unwrap().limits()[0].count(), 200);
/// // An invalid table is refused, and the one in force stays.
/// assert!(table.replace(Rules::new().policy("200/1parsec")).is_err());
/// assert_eq!(layer.policy().unwrap().limits()[0].count(), 200);
/// # Ok::<(), tower_redis_ratelimit::BuildError>(())
/// ```
#[derive(Clone)]
pub struct RuleTable {
    shared: Arc<Shared>,
}

struct Shared {
    current: ArcSwap<Table>,
    compiler: Compiler,
}

impl std::fmt::Debug for RuleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self
            .policies()
            .iter()
            .map(|p| p.identity().to_owned())
            .collect();
        f.debug_struct("RuleTable")
            .field("policies", &names)
            .finish()
    }
}

impl RuleTable {
    pub(crate) fn new(compiler: Compiler, rules: Rules) -> Result<Self, BuildError> {
        let table = compiler.compile(rules)?;
        Ok(RuleTable {
            shared: Arc::new(Shared {
                current: ArcSwap::from_pointee(table),
                compiler,
            }),
        })
    }

    /// The table in force, for one request.
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Table>> {
        self.shared.current.load()
    }

    /// Checks `rules` as [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build)
    /// does and puts them in force for the requests that follow; on an error, the rules in
    /// force stay.
    pub fn replace(&self, rules: Rules) -> Result<(), BuildError> {
        let table = self.shared.compiler.compile(rules)?;
        self.shared.current.store(Arc::new(table));
        Ok(())
    }

    /// The policies in force: each rule's, in order, then the default policy.
    pub fn policies(&self) -> Vec<Policy> {
        self.load().policies().cloned().collect()
    }
}
