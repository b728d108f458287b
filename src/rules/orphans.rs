//! Overrides a rules table leaves without effect, logged at `WARN` when the table is put in
//! force (the layer built, [`RuleTable::replace`](super::RuleTable::replace), a rules file):
//!
//! - count overrides of a policy of the new table set for other windows or another algorithm
//!   ([`Overrides::unfit`]): checked for each policy whose name the table in force before did
//!   not have with the same identity, and for every policy when the layer is built (a deploy
//!   may have changed them);
//! - every override of a policy of the table before whose name (an unnamed policy's limits)
//!   the new table no longer has: blocks included, since nothing follows them any more.
//!
//! Blocks of a policy whose windows or algorithm change stay in force (`store::Scope`); these
//! reports say which counts do not. The store answers in a task of its own (Redis); a memory
//! store's before the table is replaced.

use std::collections::HashMap;
use std::future::Future;
use std::task::{Context, Waker};

use tokio::runtime::Handle;

use crate::store::{Overrides, Scope};
use crate::Policy;

/// What to check of a table just put in force.
#[derive(Debug, Default)]
pub(crate) struct Checks {
    /// Policies of the new table whose count overrides may no longer fit.
    changed: Vec<Policy>,
    /// Policies of the table before whose overrides no policy of the new one follows.
    gone: Vec<Policy>,
}

impl Checks {
    /// What changed from the policies `before` (none: the layer is being built) to `now`.
    pub(crate) fn between(before: Option<Vec<Policy>>, now: Vec<Policy>) -> Checks {
        let Some(before) = before else {
            return Checks {
                changed: now,
                gone: Vec::new(),
            };
        };
        let owners = |policies: &[Policy]| -> HashMap<String, String> {
            let by_owner = policies.iter().map(|policy| {
                let owner = policy.owner().name().to_owned();
                (owner, policy.identity().to_owned())
            });
            by_owner.collect()
        };
        let (was, is) = (owners(&before), owners(&now));
        let changed = now
            .into_iter()
            .filter(|p| was.get(p.owner().name()).map(String::as_str) != Some(p.identity()))
            .collect();
        let gone = before
            .into_iter()
            .filter(|p| !is.contains_key(p.owner().name()))
            .collect();
        Checks { changed, gone }
    }

    /// Runs the checks against `overrides`: at once for a memory store's, else in a task on
    /// the current runtime, or on `runtime` (the one the layer was built on).
    pub(crate) fn run(self, overrides: &Overrides, runtime: Option<&Handle>) {
        if self.changed.is_empty() && self.gone.is_empty() {
            return;
        }
        let mut report = Box::pin(self.report(overrides.clone()));
        if overrides.is_local() {
            let _ = report
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()));
            return;
        }
        match Handle::try_current().ok().or_else(|| runtime.cloned()) {
            Some(runtime) => drop(runtime.spawn(report)),
            None => tracing::warn!(
                "the store's overrides were not checked against the new rules: no Tokio runtime"
            ),
        }
    }

    /// Logs what the checks find.
    async fn report(self, overrides: Overrides) {
        for policy in &self.changed {
            match overrides.unfit(policy).await {
                Ok(unfit) => {
                    for (scope, set_for) in unfit {
                        tracing::warn!(
                            policy = policy.name(),
                            scope = %loggable(&scope),
                            set_for,
                            now = policy.identity(),
                            "a count override no longer fits its policy (other windows or \
                             algorithm) and decides nothing: set it again or remove it"
                        );
                    }
                }
                Err(error) => unchecked(policy, &error),
            }
        }
        for policy in &self.gone {
            match overrides.list(policy).await {
                Ok(listed) => {
                    for (scope, to) in listed {
                        tracing::warn!(
                            policy = policy.identity(),
                            scope = %loggable(&scope),
                            %to,
                            "the rules in force no longer have this override's policy: \
                             it decides nothing"
                        );
                    }
                }
                Err(error) => unchecked(policy, &error),
            }
        }
    }
}

/// `scope` as logs show it: a key as its `Debug` shows it (hashed, unless it is an address), so
/// that an override set for an API key does not put the key in the logs.
fn loggable(scope: &Scope) -> String {
    match scope {
        Scope::Key(key) => format!("key:{}", key.loggable()),
        Scope::All | Scope::Plan(_) => scope.to_string(),
    }
}

/// Logs that `policy`'s overrides could not be checked.
fn unchecked(policy: &Policy, error: &(dyn std::error::Error + 'static)) {
    tracing::warn!(
        policy = policy.name(),
        error = %crate::chain::Chain(error),
        "the store's overrides could not be checked against the new rules"
    );
}
