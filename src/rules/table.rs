//! The rule table: which policy, and which of its plans' limits, decide a request. A layer reads
//! it once per request through an [`ArcSwap`], so that [`RuleTable::replace`] changes it for
//! the requests that follow without a lock on the request path and without a redeploy.
//!
//! Replacing the table changes which limits decide, never whose state they decide: state is
//! kept by policy identity (name, algorithm, windows; see [identity](crate::Policy#identity)), so a policy
//! whose counts change keeps its usage, as with an override in the store. The deny cache and
//! the leases hold for the exact limits they were decided against, so a raise is not shadowed
//! by a refusal cached under the old counts.

use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use tokio::runtime::Handle;

use super::combine::{self, Capabilities, Names};
use super::orphans::Checks;
use super::rule::{Built, Matcher, PlanFn, RequestHead};
use crate::response::{Options, Responder};
use crate::store::claims::{Claim, Claims};
use crate::store::Overrides;
use crate::{BuildError, Policy, Rule};

/// A layer's rules and default policy, as a value: what [`RuleTable::replace`] puts in force,
/// and what [`RateLimitLayerBuilder::rules`](crate::RateLimitLayerBuilder::rules) starts from.
#[cfg_attr(
    feature = "config",
    doc = "With the `config` feature it can be read from a TOML file (see [`Rules::from_toml`])."
)]
#[cfg_attr(
    not(feature = "config"),
    doc = "With the `config` feature it can be read from a TOML file (see `Rules::from_toml`)."
)]
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

    /// The default policy's limits for requests on plan `plan`, as [`Rule::plan`] (a rules
    /// file's default plans).
    #[cfg(feature = "config")]
    pub(crate) fn plan<P>(mut self, plan: impl Into<String>, limits: P) -> Self
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
    #[cfg(test)]
    pub(crate) fn default_policy(&self) -> Option<&Policy> {
        self.default.as_ref().map(|choice| &choice.own.policy)
    }

    /// The default policy's name, and whether it limits its requests (a soft policy passes
    /// those over the limit on), for the file watcher's warning.
    #[cfg(feature = "config")]
    pub(crate) fn default_limits(&self) -> Option<(String, bool)> {
        let choice = self.default.as_ref()?;
        Some((
            choice.own.policy.name().to_owned(),
            !choice.own.options.soft,
        ))
    }

    /// A request of each rule (see `Matcher::probe`), with the rule's policy name.
    #[cfg(feature = "config")]
    pub(crate) fn probes(&self) -> Vec<(String, http::Method, String)> {
        let probe = |(matcher, choice): &(Matcher, Choice)| {
            let (method, path) = matcher.probe()?;
            Some((choice.own.policy.name().to_owned(), method, path))
        };
        self.rules.iter().filter_map(probe).collect()
    }

    /// The policy name that decides a request of `method` and `path` (on no plan), and whether
    /// it limits it; `None` where nothing decides it.
    #[cfg(feature = "config")]
    pub(crate) fn decides(&self, method: &http::Method, path: &str) -> Option<(String, bool)> {
        let uri = http::Uri::try_from(path).ok()?;
        let (headers, extensions) = (http::HeaderMap::new(), http::Extensions::new());
        let head = RequestHead {
            method,
            uri: &uri,
            headers: &headers,
            extensions: &extensions,
        };
        let responder = self.responder(&head, None)?;
        Some((responder.policy.name().to_owned(), !responder.options.soft))
    }

    /// The policies of the rules, in order, then the default policy.
    fn policies(&self) -> impl Iterator<Item = &Policy> {
        let rules = self.rules.iter().map(|(_, choice)| choice);
        rules.chain(&self.default).map(|choice| &choice.own.policy)
    }
}

/// What checks a table against the layer and makes it: the layer's response options, and what
/// its policies must fit.
pub(crate) struct Compiler {
    pub(crate) options: Options,
    pub(crate) capabilities: Capabilities,
    /// The store's overrides, which each table put in force is checked against (`orphans`).
    pub(crate) overrides: Option<Overrides>,
    /// The store's registry of the unnamed policies its live layers use, which each table
    /// put in force claims its own in (`store/claims.rs`).
    pub(crate) claims: Option<Claims>,
}

impl Compiler {
    /// Checks `rules` and makes the table requests read.
    pub(crate) fn compile(&self, mut rules: Rules) -> Result<Table, BuildError> {
        let default = rules.default_rule();
        combine::some_policy(default.is_some(), rules.rules.len())?;
        let mut names = Names::default();
        let rules = rules
            .rules
            .into_iter()
            .map(|rule| self.choice(&mut names, rule.build()?))
            .collect::<Result<Vec<_>, BuildError>>()?;
        let default = match default.transpose()? {
            Some(rule) => Some(self.choice(&mut names, rule.build()?)?.1),
            None => None,
        };
        Ok(Table { rules, default })
    }

    /// Checks a rule's policy and plans against the layer and the rules before it (`names`),
    /// and makes their responders.
    fn choice(&self, names: &mut Names, rule: Built) -> Result<(Matcher, Choice), BuildError> {
        let Built {
            matcher,
            policy,
            plans,
            soft,
        } = rule;
        self.capabilities.validate(names, &policy, &plans, soft)?;
        let mut options = self.options.clone();
        options.soft |= soft;
        let responder = |policy| Arc::new(Responder::new(policy, options.clone()));
        let plans = plans
            .into_iter()
            .map(|(name, policy)| (name.into_boxed_str(), responder(policy)))
            .collect();
        let own = responder(policy);
        Ok((matcher, Choice { own, plans }))
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
/// assert_eq!(table.policies()[0].to_string(), "200/1m");
/// // An invalid table is refused, and the one in force stays.
/// assert!(table.replace(Rules::new().policy("200/1parsec")).is_err());
/// assert_eq!(table.policies()[0].to_string(), "200/1m");
/// # Ok::<(), tower_redis_ratelimit::BuildError>(())
/// ```
#[derive(Clone)]
pub struct RuleTable {
    shared: Arc<Shared>,
}

struct Shared {
    current: ArcSwap<Table>,
    compiler: Compiler,
    /// The unnamed policies of the table in force, claimed in the store; locked while a
    /// table replaces it, so that the claim and the table change together. Released when
    /// the layer, its clones, their services and every handle on the table are gone.
    claim: Mutex<Claim>,
    /// The runtime the layer was built on, for the checks of a table replaced outside one.
    runtime: Option<Handle>,
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
        let mut claim = Claim::new(compiler.claims.clone());
        claim.take(table.policies())?;
        let checks = Checks::between(None, table.policies().cloned().collect());
        let table = RuleTable {
            shared: Arc::new(Shared {
                current: ArcSwap::from_pointee(table),
                compiler,
                claim: Mutex::new(claim),
                runtime: Handle::try_current().ok(),
            }),
        };
        table.validate(checks);
        Ok(table)
    }

    /// Logs at `WARN` the store's overrides that a table just put in force leaves without
    /// effect (see `orphans.rs`).
    fn validate(&self, checks: Checks) {
        if let Some(overrides) = &self.shared.compiler.overrides {
            checks.run(overrides, self.shared.runtime.as_ref());
        }
    }

    /// The table in force, for one request.
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Table>> {
        self.shared.current.load()
    }

    /// Checks `rules` as [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build)
    /// does and puts them in force for the requests that follow; on an error, the rules in
    /// force stay. An unnamed policy that another live layer on the store uses is refused as
    /// at build time ([`BuildError::PolicyInUse`]).
    ///
    /// Overrides in the store that the new rules leave without effect are logged at `WARN`:
    /// count overrides of a policy whose windows or algorithm changed (blocks stay in force;
    /// see [`Scope`](crate::store::Scope)), and every override of a policy the rules no longer
    /// have.
    pub fn replace(&self, rules: Rules) -> Result<(), BuildError> {
        let table = self.shared.compiler.compile(rules)?;
        let mut claim = self
            .shared
            .claim
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        claim.take(table.policies())?;
        let now = table.policies().cloned().collect();
        let before = self.shared.current.swap(Arc::new(table));
        drop(claim);
        self.validate(Checks::between(
            Some(before.policies().cloned().collect()),
            now,
        ));
        Ok(())
    }

    /// The policies in force: each rule's, in order, then the default policy.
    pub fn policies(&self) -> Vec<Policy> {
        self.load().policies().cloned().collect()
    }
}
