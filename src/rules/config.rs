//! Rules read from a TOML file (feature `config`): the same [`Rules`] the builder takes, so that
//! operators change limits by editing a file and [`RuleTable::watch_file`] (or a reload of
//! your own, on `SIGHUP` say) puts them in force without a redeploy.
//!
//! ```toml
//! # The policy for requests that no rule matches (optional).
//! [default]
//! limits = "300/1m"
//!
//! # Rules, first match wins. `name` keeps the state: a policy whose counts change but whose
//! # name, algorithm and windows stay keeps the usage recorded so far.
//! [[rule]]
//! name = "login"
//! limits = "5/1m + 20/1h"
//! method = "POST"
//! path = "/login"
//!
//! [[rule]]
//! name = "api"
//! limits = "60/1m + 1000/1d"
//! algorithm = "gcra"          # sliding-log (default), sliding-window, fixed-window, gcra
//! path = "/api/{*rest}"
//! plans = { pro = "600/1m + 10000/1d", enterprise = "6000/1m + 100000/1d" }
//!
//! [[rule]]
//! name = "password-reset"
//! limits = "3/1m + 10/1h"
//! path = "/password-reset"
//! soft = true                 # pass requests over the limit on, marked (Rule::soft)
//! block_for = "15m"           # the penalty box (Policy::block_for)
//!
//! [[rule]]
//! name = "export"
//! limits = "10/1h"
//! path = "/export"
//! concurrency = 2             # at most 2 in flight per key (Policy::concurrency)
//! slot_expiry = "30s"         # a dead instance's slots come back within 30 s
//! ```
//!
//! Every field is optional but `limits`, which only a policy with a `concurrency` may leave out
//! (it is then decided by its concurrency limit alone); `name` defaults to `default`, which only
//! one policy of a table can have. A rule without `method` or `path` matches every request. Plans need the
//! layer's [plan function](crate::RateLimitLayerBuilder::plan). Predicates and costs are code,
//! not configuration: give them to the builder.
//!
//! A file with an error is refused as a whole, with the line and the problem
//! ([`ConfigError`]): a table is never half-replaced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use serde::Deserialize;
use toml::Spanned;

use super::combine::{self, Names};
use super::rule::Built;
use super::{Rule, RuleTable, Rules};
use crate::{Algorithm, BuildError, Policy, PolicyError};

/// Why a rules file was refused; the rules in force stay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{} could not be read", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What reading it said.
        #[source]
        error: std::io::Error,
    },
    /// The file is not valid TOML, or not a valid table of rules.
    #[error("line {line}: {message}")]
    Invalid {
        /// The line of the problem, from 1.
        line: usize,
        /// The problem.
        message: String,
    },
    /// The layer cannot take the rules, e.g. its store cannot decide one of the policies.
    #[error(transparent)]
    Build(#[from] BuildError),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    default: Option<Spanned<Entry>>,
    #[serde(default)]
    rule: Vec<Spanned<Entry>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: Option<Spanned<String>>,
    /// Left out only with `concurrency`, for a policy without rate limits.
    limits: Option<Spanned<String>>,
    algorithm: Option<Spanned<String>>,
    method: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    #[serde(default)]
    plans: BTreeMap<String, Spanned<String>>,
    /// Pass requests over the limit on, marked (`Rule::soft`).
    #[serde(default)]
    soft: bool,
    /// The penalty box (`Policy::block_for`), e.g. `"15m"`.
    block_for: Option<Spanned<String>>,
    /// Requests of a key in flight at once (`Policy::concurrency`).
    concurrency: Option<Spanned<u32>>,
    /// How long a concurrency slot lives unrenewed (`Policy::slot_expiry`), e.g. `"30s"`.
    slot_expiry: Option<Spanned<String>>,
}

/// Reports problems by line.
struct Lines<'a>(&'a str);

impl Lines<'_> {
    fn at<T>(&self, spanned: &Spanned<T>, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::Invalid {
            line: self.line(spanned.span().start),
            message: message.to_string(),
        }
    }

    fn line(&self, offset: usize) -> usize {
        let before = self.0.get(..offset).unwrap_or(self.0);
        before.bytes().filter(|&b| b == b'\n').count() + 1
    }
}

impl Rules {
    /// Reads rules from TOML text in the format of [`config`](crate::config); an error names
    /// the line and the problem.
    ///
    /// ```
    /// use tower_redis_ratelimit::Rules;
    ///
    /// let rules = Rules::from_toml(r#"
    /// [[rule]]
    /// name = "login"
    /// limits = "5/1m"
    /// path = "/login"
    /// "#)?;
    /// let error = Rules::from_toml("[[rule]]\nname = \"login\"\nlimits = \"5/1fortnight\"\n").unwrap_err();
    /// assert!(error.to_string().starts_with("line 3:"), "{error}");
    /// # Ok::<(), tower_redis_ratelimit::config::ConfigError>(())
    /// ```
    pub fn from_toml(text: &str) -> Result<Rules, ConfigError> {
        let lines = Lines(text);
        let file: File = toml::from_str(text).map_err(|error| ConfigError::Invalid {
            line: error.span().map_or(1, |span| lines.line(span.start)),
            message: error.message().trim_end().to_owned(),
        })?;
        let mut rules = Rules::new();
        // One name, one policy: what the layer's builder checks too, reported here by line.
        let mut names = Names::default();
        let mut check = |entry: &Spanned<Entry>, rule: &Rule| -> Result<Built, ConfigError> {
            let built = rule.clone().build().map_err(|e| lines.at(entry, e))?;
            let admitted = names.admit(&built.policy, &built.plans);
            admitted.map_err(|e| lines.at(entry, e))?;
            Ok(built)
        };
        for entry in &file.rule {
            let rule = read_rule(&lines, entry)?;
            check(entry, &rule)?;
            rules = rules.rule(rule);
        }
        if let Some(entry) = &file.default {
            let fields = entry.get_ref();
            if let Some(field) = fields.method.as_ref().or(fields.path.as_ref()) {
                return Err(lines.at(field, "the default policy takes no method or path"));
            }
            let built = check(entry, &read_rule(&lines, entry)?)?;
            rules = rules.policy(built.policy);
            rules.default_soft = built.soft;
            for (plan, limits) in built.plans {
                rules = rules.plan(plan, limits);
            }
        }
        let any = combine::some_policy(file.default.is_some(), file.rule.len());
        any.map_err(|error| ConfigError::Invalid {
            line: 1,
            message: error.to_string(),
        })?;
        Ok(rules)
    }
}

/// Reads one entry, reporting a problem at the line of the field that has it.
fn read_rule(lines: &Lines<'_>, spanned: &Spanned<Entry>) -> Result<Rule, ConfigError> {
    let entry = spanned.get_ref();
    let mut rule = Rule::new(read_policy(lines, spanned)?);
    if entry.soft {
        rule = rule.soft();
    }
    if let Some(method) = &entry.method {
        rule = rule.method(read_method(lines, method)?);
    }
    if let Some(path) = &entry.path {
        let with_path = rule.clone().path(path.get_ref().as_str());
        with_path.clone().build().map_err(|e| lines.at(path, e))?;
        rule = with_path;
    }
    for (plan, limits) in &entry.plans {
        let plan_limits: Policy = limits
            .get_ref()
            .parse()
            .map_err(|e: PolicyError| lines.at(limits, format!("plan {plan:?}: {e}")))?;
        let with_plan = rule.clone().plan(plan.as_str(), plan_limits);
        with_plan.clone().build().map_err(|e| lines.at(limits, e))?;
        rule = with_plan;
    }
    Ok(rule)
}

/// Reads an entry's policy: its limits, name, algorithm, penalty box and concurrency.
fn read_policy(lines: &Lines<'_>, spanned: &Spanned<Entry>) -> Result<Policy, ConfigError> {
    let entry = spanned.get_ref();
    let limits: Policy = match &entry.limits {
        Some(limits) => limits
            .get_ref()
            .parse()
            .map_err(|e: PolicyError| lines.at(limits, e))?,
        None if entry.concurrency.is_some() => {
            Policy::new(Policy::DEFAULT_NAME, []).map_err(|e| lines.at(spanned, e))?
        }
        None => {
            let why = "a policy needs `limits`, or a `concurrency` limit alone";
            return Err(lines.at(spanned, why));
        }
    };
    let mut policy = match &entry.name {
        Some(name) => limits
            .named(name.get_ref().as_str())
            .map_err(|e| lines.at(name, e))?,
        None => limits,
    };
    if let Some(algorithm) = &entry.algorithm {
        policy = policy.with_algorithm(read_algorithm(lines, algorithm)?);
    }
    if let Some(block) = &entry.block_for {
        let duration = read_duration(lines, block)?;
        policy = policy.block_for(duration).map_err(|e| lines.at(block, e))?;
    }
    if let Some(slots) = &entry.concurrency {
        policy = policy
            .concurrency(*slots.get_ref())
            .map_err(|e| lines.at(slots, e))?;
    }
    if let Some(expiry) = &entry.slot_expiry {
        let duration = read_duration(lines, expiry)?;
        policy = policy
            .slot_expiry(duration)
            .map_err(|e| lines.at(expiry, e))?;
    }
    Ok(policy)
}

/// Reads a duration such as `"15m"`, in the units of a limit's window.
fn read_duration(lines: &Lines<'_>, field: &Spanned<String>) -> Result<Duration, ConfigError> {
    crate::policy::parse_window(field.get_ref().trim()).map_err(|e| lines.at(field, e))
}

fn read_algorithm(lines: &Lines<'_>, field: &Spanned<String>) -> Result<Algorithm, ConfigError> {
    algorithm_named(field.get_ref()).ok_or_else(|| {
        let why = format!(
            "unknown algorithm {:?}: sliding-log, sliding-window, fixed-window or gcra",
            field.get_ref()
        );
        lines.at(field, why)
    })
}

/// Reads a method, of the standard ones only: an extension method is more likely a typo
/// ("PSOT") that would never match than a method the service serves.
fn read_method(lines: &Lines<'_>, field: &Spanned<String>) -> Result<Method, ConfigError> {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::PATCH,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    let given = field.get_ref().to_ascii_uppercase();
    let parsed = KNOWN.into_iter().find(|known| known.as_str() == given);
    parsed.ok_or_else(|| {
        let why = format!(
            "unknown method {:?}: GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, CONNECT or TRACE",
            field.get_ref()
        );
        lines.at(field, why)
    })
}

fn algorithm_named(name: &str) -> Option<Algorithm> {
    Some(match name.to_ascii_lowercase().replace('_', "-").as_str() {
        "sliding-log" => Algorithm::SlidingLog,
        "sliding-window" => Algorithm::SlidingWindow,
        "fixed-window" => Algorithm::FixedWindow,
        "gcra" => Algorithm::Gcra,
        _ => return None,
    })
}

impl RuleTable {
    /// Reads the rules file at `path` and puts its rules in force (see [`RuleTable::replace`]);
    /// on an error the rules in force stay. Rules that leave requests unlimited where the
    /// rules in force limited them are logged at WARN, as [`RuleTable::watch_file`] does.
    /// Feature `config`.
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<(), ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_owned(),
            error,
        })?;
        self.replace_warning(path, Rules::from_toml(&text)?)
    }
}
