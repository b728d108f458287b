//! Limits changed at run time, for one client key, for the customers of one plan, or for every
//! key of a policy, kept in the store so that every instance that shares it decides by them.
//!
//! An override replaces a policy's counts (all of them, or those of the windows it names),
//! never its windows or algorithm, and keeps its state: the usage recorded so far still
//! counts (see [identity](crate::Policy#identity) for what that means for each algorithm). So raising
//! `5/1h` to `8/1h` after five requests admits three more, lowering it refuses until enough
//! usage has aged out, and removing the override restores the policy's own counts. A block
//! refuses every request of the key (or of the plan, or of the policy) until it is removed.
//! Which override decides: [`Scope`].
//!
//! On Redis an override lives in a hash per hash tag, in the hash slot of the keys it governs
//! (`src/store/redis/overrides/`), and the decision's own script reads it in the same call
//! (no round trip of its own, batching unchanged), or, for a plain decision, goes by what the
//! store read within the last 250 ms: every instance follows a change within 250 ms of the
//! call that made it. The memory store keeps them in this process (`override_table.rs`) and
//! follows a change at once.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::policy::{parse_limits, write_limits};
use crate::{Key, Limit, Policy, PolicyError, StoreError};

/// Whose limits an override changes.
///
/// # Precedence
///
/// This is the one place that states it. A request of a client key under a policy, on a plan
/// or not, is decided by the first of these that applies:
///
/// 1. the key's own override ([`Scope::Key`]);
/// 2. the override of the request's plan ([`Scope::Plan`]), for a request on a plan its rule
///    names ([`Rule::plan`](crate::Rule::plan));
/// 3. the policy-wide override ([`Scope::All`]);
/// 4. the limits of the request's plan ([`Rule::plan`](crate::Rule::plan));
/// 5. the policy's own limits.
///
/// A block ([`Override::Block`]) stands where counts of its scope stand: a key's own raise
/// lets it through a policy-wide block, and a key's block refuses it whatever its plan's or
/// the policy's override says. One scope holds one override: setting counts replaces a block
/// of that scope and a block replaces counts, so [`Overrides::get`] shows what governs.
///
/// Overrides belong to the policy's **name** (an unnamed policy's, parsed from a string, to
/// its identity), not to its windows: a block survives a change of the policy's windows or
/// algorithm (a rules edit, a deploy). Counts are set for the windows and algorithm of the
/// policy they were set with, and govern only decisions under those
/// ([identity](crate::Policy#identity)); after such a change they decide nothing, as if absent (the next
/// scope down decides), until they are set again or removed. [`Overrides::unfit`] lists them,
/// and a layer logs them at `WARN` when it is built or its rules are replaced.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every key of the policy.
    All,
    /// The customers of one plan, by the name the rules give it ([`Rule::plan`](crate::Rule::plan)).
    Plan(String),
    /// One client key. A key longer than [`Key::MAX_LEN`] bytes stands for the same hashed
    /// key that the layer's extractors give such a client.
    Key(Key),
}

/// `all`, `plan:<plan>` or `key:<key>`: one text per scope, so that a key named like a plan,
/// or `all`, is not taken for one. The key is shown as stored ([`Key`]'s `Display`): as given where it is short visible ASCII, so that an admin
/// listing names the client, and its hash otherwise. An API key is such a key: show this text
/// to operators only; `Debug` shows the key as logs may.
///
/// ```
/// use tower_redis_ratelimit::store::Scope;
/// use tower_redis_ratelimit::Key;
///
/// let scope = Scope::Key(Key::from("customer-42"));
/// assert_eq!(scope.to_string(), "key:customer-42");
/// assert!(!format!("{scope:?}").contains("customer-42"));
/// ```
impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::All => f.write_str("all"),
            Scope::Plan(plan) => write!(f, "plan:{plan}"),
            Scope::Key(key) => write!(f, "key:{}", key.as_str()),
        }
    }
}

/// What an override sets: other counts for a policy's windows, or a block.
///
/// An override is written and shown in the crate's syntax, as a policy's limits are
/// (`"1/1m + 50/1h + 100/1d"`), or `"block"`, so that an admin endpoint can take what an
/// operator typed and list what is set in the same text.
///
/// **An override may name some of the policy's windows only**, e.g. `8/1h` for a policy of
/// `1/1m + 5/1h + 10/1d`: the windows it does not name keep the counts of the policy each
/// request is decided by, when it is decided: the policy's own (`1/1m` and `10/1d` here, or
/// the counts a later deploy gives it), or for a customer on a plan ([`Rule::plan`]), the
/// plan's. [`Overrides::get`] and [`Overrides::list`] return the windows named (`8/1h`). A
/// window the policy does not have is refused ([`PolicyError::OtherWindows`]), and so are two
/// limits for one window.
///
/// [`Rule::plan`]: crate::Rule::plan
///
/// ```
/// use tower_redis_ratelimit::store::Override;
///
/// let vip: Override = "100/1d + 1/1m, 50/1h".parse()?;
/// assert_eq!(vip.to_string(), "1/1m + 50/1h + 100/1d");
/// assert_eq!("block".parse::<Override>()?, Override::Block);
/// assert_eq!(Override::Block.to_string(), "block");
/// assert!("0/1h".parse::<Override>().is_err()); // a block is written `block`
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Override {
    /// These counts, for some or all of the policy's windows (one limit per window, in any
    /// order); the windows left out keep the counts each request is decided by.
    Limits(Vec<Limit>),
    /// No request passes: a limit of zero.
    Block,
}

/// Parses `"block"` (in any case), or limits as a [`Policy`] parses them
/// (`"8/1h"`, `"1/1m + 50/1h + 100/1d"`, separated by `+` or `,`, in any order) into
/// [`Override::Limits`], shortest window first: the order [`Overrides::get`] returns them in,
/// so that an override read back equals the one parsed. A malformed limit, or two limits for
/// one window, is an error; whether the windows are the policy's is checked by
/// [`Overrides::set`], which knows the policy.
impl FromStr for Override {
    type Err = PolicyError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        if input.trim().eq_ignore_ascii_case("block") {
            return Ok(Override::Block);
        }
        parse_limits(input).map(Override::Limits)
    }
}

/// `block`, or the limits in the order held, as a [`Policy`] displays its own
/// (`1/1m + 50/1h + 100/1d`): the text [`Override::from_str`] reads back, to the same override
/// for every override it or [`Overrides::get`] makes (shortest window first, no window twice).
/// Empty limits, which no store takes, show as nothing.
impl fmt::Display for Override {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Override::Limits(limits) => write_limits(f, limits),
            Override::Block => f.write_str("block"),
        }
    }
}

/// Why an override could not be set, read or listed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverrideError {
    /// The limits do not fit the policy: another set of windows, or an invalid limit.
    #[error("override: the limits do not fit the policy")]
    Policy(#[from] PolicyError),
    /// The counts are out of the algorithm's range (`docs/operations.md`, "Range").
    #[error("override: {0}")]
    OutOfRange(&'static str),
    /// The store could not be reached, or answered with an error, before any write was sent:
    /// nothing was changed.
    #[error("override: the store failed; nothing was changed")]
    Store(#[from] StoreError),
    /// A write was sent but no reply confirmed it (a timeout, a lost connection, an error
    /// after part of it was made): the change may have landed, in whole or in part. If it
    /// did, every instance follows it as any change: the limits version is raised with it
    /// (or, in a Redis Cluster, after it, until Redis answers). Setting or removing it again
    /// is safe.
    #[error("override: the change may have landed, unconfirmed (setting it again is safe)")]
    Unconfirmed(#[source] StoreError),
}

/// The operator's handle on a store's overrides: set, read, list and remove them. Cheap to
/// clone; clones share the store. Which override decides a request: [`Scope`].
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
    backend: Arc<dyn Backend>,
}

/// A future of a store's side of the overrides.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Where a store keeps its overrides: the memory store's table (`override_table.rs`) or
/// Redis (`redis/overrides/`). Each store implements it, so that this module, which the
/// stores use, knows neither.
pub(crate) trait Backend: Send + Sync + 'static {
    /// `"memory"` or `"redis"`, for `Debug`.
    fn kind(&self) -> &'static str;
    /// Whether the overrides are kept in this process, their futures ready at once.
    fn is_local(&self) -> bool;
    fn set<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
        ruling: Ruling,
    ) -> BoxFuture<'a, Result<(), OverrideError>>;
    fn get<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<Option<Stored>, OverrideError>>;
    fn remove<'a>(
        &'a self,
        policy: &'a Policy,
        scope: &'a Scope,
    ) -> BoxFuture<'a, Result<bool, OverrideError>>;
    /// The overrides stored under `policy`'s name, a page at a time, from the start.
    fn pages(&self, policy: &Policy) -> Box<dyn Pages>;
}

/// A page of the overrides stored under a policy's name, governing it or not.
pub(crate) type StoredPage = Vec<(Scope, Stored)>;

/// A listing under way (see [`Backend::pages`]).
pub(crate) trait Pages: Send {
    /// The next page of overrides stored under the policy's name, governing or not, never
    /// empty; `None` at the end. After an error the next call asks for the same page again.
    fn next(&mut self) -> BoxFuture<'_, Option<Result<StoredPage, StoreError>>>;
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = self.backend.kind();
        f.debug_struct("Overrides").field("store", &kind).finish()
    }
}

impl Overrides {
    /// The overrides a store keeps in `backend`.
    pub(crate) fn new(backend: Arc<dyn Backend>) -> Overrides {
        Overrides { backend }
    }

    /// Whether the overrides are kept in this process, their futures ready at once.
    pub(crate) fn is_local(&self) -> bool {
        self.backend.is_local()
    }

    /// Sets the override of `policy` for `scope`, replacing any before it, counts or block
    /// alike (for a plan, `policy` may be the policy or its plan's: they share a name).
    ///
    /// Counts for some of the policy's windows only leave the others at the counts of the
    /// policy each request is decided by, when it is decided: the policy's own, as the code
    /// running then sets them, or a plan's for the plan's customers ([`Override`]).
    /// [`get`](Self::get) returns the windows set. A window the policy does not have is
    /// refused ([`PolicyError::OtherWindows`]), nothing written.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redis_ratelimit::store::{Override, Scope};
    /// use tower_redis_ratelimit::{Key, MemoryStore, Policy, Store};
    ///
    /// let store = MemoryStore::new();
    /// let sms = Policy::new("sms", ["1/1m".parse()?, "5/1h".parse()?, "10/1d".parse()?])?;
    /// let phone = Scope::Key(Key::from("+44 7700 900123"));
    /// let overrides = store.overrides();
    /// // What an operator typed: the hour raised, the minute and the day kept.
    /// overrides.set(&sms, &phone, &"8/1h".parse()?).await?;
    /// let set = overrides.get(&sms, &phone).await?.expect("set");
    /// assert_eq!(set.to_string(), "8/1h");
    /// assert!(overrides.set(&sms, &phone, &"8/2h".parse()?).await.is_err());
    /// # Ok(()) }
    /// ```
    ///
    /// Writers at once: each override is written whole, never half, and the last write wins.
    /// On Redis a policy-wide or plan override is one write per hash tag; of two at once,
    /// every tag ends with the one stamped later by Redis' clock, even where the other
    /// arrived last (the earlier `set` still returns `Ok`: it was replaced).
    pub async fn set(
        &self,
        policy: &Policy,
        scope: &Scope,
        to: &Override,
    ) -> Result<(), OverrideError> {
        let ruling = Ruling::new(policy, to)?;
        self.backend.set(policy, scope, ruling).await
    }

    /// The override of `policy` for `scope` (not the policy's, for a key that has none), if
    /// one governs: counts set for other windows or another algorithm than `policy`'s decide
    /// nothing, and read as none ([`Overrides::unfit`] lists them).
    pub async fn get(
        &self,
        policy: &Policy,
        scope: &Scope,
    ) -> Result<Option<Override>, OverrideError> {
        let stored = self.backend.get(policy, scope).await?;
        Ok(stored.and_then(|stored| stored.governing(policy)))
    }

    /// Removes the override of `policy` for `scope`, whether it governs or not; whether there
    /// was one.
    pub async fn remove(&self, policy: &Policy, scope: &Scope) -> Result<bool, OverrideError> {
        self.backend.remove(policy, scope).await
    }

    /// Every override that governs decisions of `policy`: the policy-wide one first, then
    /// the plans' by name, then the keys' by key. Read a page at a time: one
    /// call per page of the policy's overrides, each within its own budget, so listing never
    /// slows a decision by more than a page.
    ///
    /// A listing for operators shows each in the crate's syntax: a [`Scope`] displays as
    /// `all`, `plan:<plan>` or `key:<key>`, the key as stored, and an [`Override`] as its
    /// limits or `block`, which [`set`](Self::set) takes back.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redis_ratelimit::store::{Override, Scope};
    /// use tower_redis_ratelimit::{Key, MemoryStore, Policy};
    ///
    /// let store = MemoryStore::new();
    /// let api = Policy::new("api", ["1/1s".parse()?, "100/1h".parse()?])?;
    /// let overrides = store.overrides();
    /// overrides.set(&api, &Scope::All, &"1/1s + 500/1h".parse()?).await?;
    /// overrides.set(&api, &Scope::Key(Key::from("customer-42")), &Override::Block).await?;
    /// let lines: Vec<String> = overrides
    ///     .list(&api)
    ///     .await?
    ///     .iter()
    ///     .map(|(scope, to)| format!("{scope}\t{to}"))
    ///     .collect();
    /// assert_eq!(lines, ["all\t1/1s + 500/1h", "key:customer-42\tblock"]);
    /// # Ok(()) }
    /// ```
    pub async fn list(&self, policy: &Policy) -> Result<Vec<(Scope, Override)>, OverrideError> {
        let mut pages = self.pages(policy);
        let mut listed = Vec::new();
        while let Some(page) = pages.next().await {
            listed.extend(page?);
        }
        listed.sort_by(|(a, _), (b, _)| scope_order(a, b));
        Ok(listed)
    }

    /// The count overrides stored under `policy`'s name that decide nothing, because they
    /// were set for other windows or another algorithm (see [`Scope`]), each with the
    /// identity it was set for ([identity](crate::Policy#identity)), e.g. `api:gcra:1m`. Set them again
    /// for the policy's windows, or remove them. Read a page at a time, as
    /// [`list`](Self::list).
    pub async fn unfit(&self, policy: &Policy) -> Result<Vec<(Scope, String)>, OverrideError> {
        let mut pages = self.pages(policy);
        let mut unfit = Vec::new();
        while let Some(page) = pages.next_stored().await {
            let of_other = |(scope, stored): (Scope, Stored)| match stored.identity {
                Some(identity) if *identity != *policy.identity() => Some((scope, identity.into())),
                _ => None,
            };
            unfit.extend(page?.into_iter().filter_map(of_other));
        }
        unfit.sort_by(|(a, _), (b, _)| scope_order(a, b));
        Ok(unfit)
    }

    /// The overrides of `policy` a page at a time (see [`OverridePages`]). Reads nothing
    /// until the first [`next`](OverridePages::next).
    pub(crate) fn pages(&self, policy: &Policy) -> OverridePages {
        OverridePages {
            policy: policy.clone(),
            pages: self.backend.pages(policy),
        }
    }
}

/// The policy-wide override first, then the plans' by name, then the keys' by key.
fn scope_order(a: &Scope, b: &Scope) -> std::cmp::Ordering {
    rank(a).cmp(&rank(b))
}

fn rank(scope: &Scope) -> (u8, &str) {
    match scope {
        Scope::All => (0, ""),
        Scope::Plan(plan) => (1, plan.as_str()),
        Scope::Key(key) => (2, key.as_str()),
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
pub(crate) struct OverridePages {
    policy: Policy,
    pages: Box<dyn Pages>,
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
    /// The next page: overrides not listed yet that govern the policy's decisions (see
    /// [`Overrides::list`]), never an empty page; `None` when all are listed. After an error,
    /// the next call asks for the same page again, so an admin tool can retry a page that
    /// timed out without starting over.
    pub(crate) async fn next(&mut self) -> Option<Result<Vec<(Scope, Override)>, OverrideError>> {
        loop {
            let page = match self.next_stored().await? {
                Ok(page) => page,
                Err(error) => return Some(Err(error)),
            };
            let policy = &self.policy;
            let governing = |(scope, stored): (Scope, Stored)| {
                let to = stored.governing(policy)?;
                Some((scope, to))
            };
            let page: Vec<_> = page.into_iter().filter_map(governing).collect();
            if !page.is_empty() {
                return Some(Ok(page));
            }
        }
    }

    /// The next page of the overrides stored under the policy's name, governing or not.
    async fn next_stored(&mut self) -> Option<Result<Vec<(Scope, Stored)>, OverrideError>> {
        let page = self.pages.next().await?;
        Some(page.map_err(OverrideError::from))
    }
}

impl Override {
    /// The override whose counts, one per limit of `policy` in its order, are `counts` (0: a
    /// window it leaves out; all 0: a block).
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

/// An override as a store applies it: counts, or a block.
#[derive(Debug, Clone)]
pub(crate) enum Ruling {
    Limits(Counts),
    Block,
}

/// An override's counts for a policy's windows. The windows it leaves out keep the counts of
/// the policy each request is decided by (the policy's own, or a plan's): they are not fixed
/// when the override is set, so that a plan's customers keep the plan's counts there.
#[derive(Debug, Clone)]
pub(crate) struct Counts {
    /// The policy given to `set`, under the override's counts and its own for the windows left
    /// out.
    given: Policy,
    /// Per limit of the policy, in its order: whether the override leaves its window out.
    left_out: Box<[bool]>,
}

impl Counts {
    /// The policy the counts were set for.
    pub(crate) fn given(&self) -> &Policy {
        &self.given
    }

    /// What a request decided by `own` (of the identity the counts were set for) goes by:
    /// `own` (its penalty box, concurrency limit and plan) under the override's counts, and
    /// `own`'s for the windows the override leaves out. The policy given to `set`, where it is
    /// that already (the common case), so that no policy is built per decision.
    pub(crate) fn under(&self, own: &Policy) -> Policy {
        let set = self.given.limits().iter().zip(self.left_out.iter());
        let limits = set
            .zip(own.limits())
            .map(|((set, &out), own)| if out { *own } else { *set });
        if own.same_but_counts(&self.given)
            && limits.clone().eq(self.given.limits().iter().copied())
        {
            return self.given.clone();
        }
        // Same windows (the identity matched): never refused; `own` as it is if it were.
        own.with_limits(limits).unwrap_or_else(|_| own.clone())
    }

    /// The counts, one per limit in the policy's order, 0 for a window left out.
    fn counts(&self) -> Vec<u64> {
        let limits = self.given.limits().iter().zip(self.left_out.iter());
        limits
            .map(|(limit, &out)| if out { 0 } else { limit.count() })
            .collect()
    }

    /// Count and scale of each limit, in the policy's order; `(0, 0)` for a window left out
    /// (`prelude.lua` keeps the request's own there).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn count_scales(&self) -> Vec<(u64, u64)> {
        let windows = self.given.windows().iter().zip(self.left_out.iter());
        windows
            .map(|(w, &out)| if out { (0, 0) } else { (w.count, w.scale) })
            .collect()
    }
}

impl Ruling {
    /// `to` for `policy`, checked: limits must be for the policy's windows, and be in range.
    /// The windows they leave out keep the counts of the policy each request is decided by
    /// (see [`Override`]).
    pub(crate) fn new(policy: &Policy, to: &Override) -> Result<Ruling, OverrideError> {
        Ok(match to {
            // Counts for no window change nothing: refused, as a policy of no limits is.
            Override::Limits(limits) if limits.is_empty() => {
                return Err(OverrideError::Policy(PolicyError::NoLimits))
            }
            Override::Limits(limits) => {
                let given = policy.with_limits(completed(policy, limits))?;
                if let Some(why) = given.out_of_range() {
                    return Err(OverrideError::OutOfRange(why));
                }
                let named = |limit: &Limit| limits.iter().any(|l| l.window() == limit.window());
                let left_out = given.limits().iter().map(|l| !named(l)).collect();
                Ruling::Limits(Counts { given, left_out })
            }
            Override::Block => Ruling::Block,
        })
    }

    /// The counts, one per limit in the policy's order (0 for a window left out); none for a
    /// block.
    pub(crate) fn counts(&self) -> Vec<u64> {
        match self {
            Ruling::Limits(counts) => counts.counts(),
            Ruling::Block => Vec::new(),
        }
    }
}

/// `limits` and, where every window they name is one of `policy`'s, `policy`'s own limit for
/// each window they leave out; otherwise (none, or another window) `limits` as they are, for
/// [`Policy::with_limits`] to refuse.
fn completed(policy: &Policy, limits: &[Limit]) -> Vec<Limit> {
    let named = |window| limits.iter().any(|l| l.window() == window);
    let own = policy.limits();
    let known = limits
        .iter()
        .all(|l| own.iter().any(|o| o.window() == l.window()));
    if limits.is_empty() || !known {
        return limits.to_vec();
    }
    let kept = own.iter().filter(|o| !named(o.window())).copied();
    limits.iter().copied().chain(kept).collect()
}

/// An override as a store keeps it: its counts (empty: a block) and, for counts, the identity
/// of the policy they were set for, which they govern alone (see [`Scope`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) counts: Vec<u64>,
    pub(crate) identity: Option<Box<str>>,
}

impl Stored {
    /// The override, if it governs decisions of `policy`: a block always, counts under the
    /// identity they were set for.
    pub(crate) fn governing(&self, policy: &Policy) -> Option<Override> {
        match &self.identity {
            None => Some(Override::Block),
            Some(identity) if **identity == *policy.identity() => {
                Some(Override::from_counts(policy, &self.counts))
            }
            Some(_) => None,
        }
    }
}

impl Ruling {
    /// How a store keeps it.
    pub(crate) fn stored(&self) -> Stored {
        Stored {
            counts: self.counts(),
            identity: match self {
                Ruling::Limits(counts) => Some(counts.given().identity().into()),
                Ruling::Block => None,
            },
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{MemoryStore, Store};

    fn limits(text: &str) -> Override {
        text.parse().unwrap()
    }

    fn limit(count: u64, secs: u64) -> Limit {
        Limit::new(count, Duration::from_secs(secs)).unwrap()
    }

    async fn admitted(store: &MemoryStore, key: &Key, policy: &Policy, tries: usize) -> usize {
        let mut admitted = 0;
        for _ in 0..tries {
            admitted += usize::from(store.check(key, policy, 1).await.unwrap().is_allowed());
        }
        admitted
    }

    #[tokio::test(start_paused = true)]
    async fn a_partial_override_keeps_the_policys_other_counts() {
        let store = MemoryStore::new();
        let sms = Policy::new("sms", ["2/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
        let phone = Key::from("+447700900123");
        let scope = Scope::Key(phone.clone());
        let overrides = store.overrides();
        overrides.set(&sms, &scope, &limits("3/1m")).await.unwrap();
        let set = overrides.get(&sms, &scope).await.unwrap();
        assert_eq!(set, Some(limits("3/1m")), "get returns the windows named");
        assert_eq!(
            admitted(&store, &phone, &sms, 10).await,
            3,
            "the minute raised"
        );
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(
            admitted(&store, &phone, &sms, 10).await,
            2,
            "the hour kept at 5"
        );
        // Listed in the text it was set in.
        let listed = overrides.list(&sms).await.unwrap();
        assert_eq!(listed[0].1.to_string(), "3/1m");
        // A deploy that raises the hour to 8: the override's other window follows.
        let raised =
            Policy::new("sms", ["2/1m".parse().unwrap(), "8/1h".parse().unwrap()]).unwrap();
        tokio::time::advance(Duration::from_secs(3_700)).await;
        assert_eq!(admitted(&store, &phone, &raised, 10).await, 3, "the minute");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(admitted(&store, &phone, &raised, 10).await, 3, "the minute");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(
            admitted(&store, &phone, &raised, 10).await,
            2,
            "the raised hour, 8"
        );
    }

    /// A plan's customer keeps the plan's counts for the windows an override leaves out, for
    /// an override of the plan and of the customer's key alike.
    #[test]
    fn a_partial_override_keeps_the_counts_of_the_policy_decided() {
        let api: Policy = "2/1s + 20/1m".parse().unwrap();
        let pro = api
            .with_limits(["20/1s".parse().unwrap(), "200/1m".parse().unwrap()])
            .unwrap()
            .on_plan("pro");
        let Ruling::Limits(counts) = Ruling::new(&api, &limits("300/1m")).unwrap() else {
            panic!("counts")
        };
        let shown = |p: Policy| p.to_string();
        assert_eq!(shown(counts.under(&pro)), "20/1s + 300/1m");
        assert_eq!(shown(counts.under(&api)), "2/1s + 300/1m");
    }

    #[tokio::test]
    async fn other_windows_none_or_one_twice_are_refused() {
        let store = MemoryStore::new();
        let sms = Policy::new("sms", ["2/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
        let overrides = store.overrides();
        let twice = Override::Limits(vec!["3/1m".parse().unwrap(), "4/60s".parse().unwrap()]);
        let refused = [
            (limits("8/2h"), "the policy's windows, 1m+1h"),
            (limits("3/1m + 8/2h"), "the policy's windows, 1m+1h"),
            (twice, "two limits share the window 1m"),
            (Override::Limits(vec![]), "at least one limit"),
        ];
        for (to, why) in refused {
            let error = overrides.set(&sms, &Scope::All, &to).await.unwrap_err();
            let OverrideError::Policy(cause) = &error else {
                panic!("{to:?}: {error:?}");
            };
            let source = std::error::Error::source(&error).map(ToString::to_string);
            assert_eq!(source, Some(cause.to_string()), "the cause is the source");
            assert!(cause.to_string().contains(why), "{to:?}: {cause}");
        }
        assert_eq!(
            overrides.list(&sms).await.unwrap(),
            vec![],
            "nothing written"
        );
    }

    #[test]
    fn a_partial_override_stores_the_windows_it_names() {
        let sms: Policy = "1/1m + 5/1h + 10/1d".parse().unwrap();
        let counts = |to: &str| Ruling::new(&sms, &limits(to)).unwrap().counts();
        assert_eq!(counts("8/1h"), [0, 8, 0]);
        assert_eq!(counts("20/1d, 2/1m"), [2, 0, 20]);
        assert_eq!(counts("3/1m + 4/1h + 5/1d"), [3, 4, 5]);
        assert!(Ruling::new(&sms, &Override::Block)
            .unwrap()
            .counts()
            .is_empty());
    }

    #[test]
    fn the_text_of_an_override() {
        let cases = [
            ("block", Override::Block, "block"),
            (" BLOCK\n", Override::Block, "block"),
            ("8/1h", Override::Limits(vec![limit(8, 3_600)]), "8/1h"),
            (
                "100/1d + 1/60s, 50/1h",
                Override::Limits(vec![limit(1, 60), limit(50, 3_600), limit(100, 86_400)]),
                "1/1m + 50/1h + 100/1d",
            ),
        ];
        for (text, parsed, shown) in cases {
            assert_eq!(text.parse::<Override>(), Ok(parsed.clone()), "{text:?}");
            assert_eq!(parsed.to_string(), shown, "{text:?}");
        }
        for bad in [
            "",
            "blocked",
            "0/1h",
            "5/1h + 6/60m",
            "5/1fortnight",
            "block + 5/1h",
        ] {
            assert!(bad.parse::<Override>().is_err(), "{bad:?}");
        }
    }

    proptest::proptest! {
        /// What `parse` or `get` makes (shortest window first, no window twice) reads back as
        /// itself.
        #[test]
        fn display_parses_back(
            counts in proptest::collection::vec(1..=Limit::MAX_COUNT, 1..5),
            block: bool,
        ) {
            let windows = [1, 90, 3_600, 86_400 * 7];
            let held: Vec<Limit> = counts
                .iter()
                .zip(windows)
                .map(|(&count, secs)| Limit::new(count, Duration::from_secs(secs)).unwrap())
                .collect();
            let to = if block { Override::Block } else { Override::Limits(held) };
            proptest::prop_assert_eq!(to.to_string().parse::<Override>(), Ok(to));
        }
    }
}
