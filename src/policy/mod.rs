//! Limits (`"100/1m"`) and policies (one or more limits under one name).
//!
//! One role per file: a [`Limit`] and its text (`limit`), a [`Policy`] and what it derives
//! from its limits (here), and the crate's text for a list of limits, `1/1m + 5/1h`, which
//! policies and overrides are parsed from and displayed as (`syntax`).

mod limit;
mod syntax;

use std::sync::Arc;
use std::time::Duration;

use crate::model::{Algorithm, Window, MAX_GCRA_BUCKET};
use crate::store::owner::{stable_id, Owner};

#[cfg(feature = "config")]
pub(crate) use limit::parse_window;
pub use limit::{Limit, LimitError};
pub(crate) use syntax::{parse_limits, write_limits};

/// A named set of limits that all apply to the same key, decided together.
///
/// A request is admitted only if every limit admits it; then it counts against all of them.
/// The name appears in the `RateLimit-Policy` header and in store keys, so it is restricted to
/// ASCII letters, digits, `-`, `_` and `.`.
///
/// ```
/// use tower_redis_ratelimit::{Limit, Policy};
///
/// // "at most 1 per minute, 5 per hour and 10 per day"
/// let policy: Policy = "1/1m + 5/1h + 10/1d".parse()?;
/// assert_eq!(policy.name(), "default");
/// assert_eq!(policy.limits().len(), 3);
///
/// let api = Policy::new("api", ["100/1m".parse::<Limit>()?])?;
/// assert_eq!(api.name(), "api");
///
/// // Shown in the same syntax: its limits, shortest window first.
/// assert_eq!(policy.to_string(), "1/1m + 5/1h + 10/1d");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Identity
///
/// What a policy's state is kept under, its *identity*: for a named policy its name, algorithm and
/// windows, e.g. `api:gcra:1m+1d`; for an unnamed one (parsed from a string, or made from
/// a [`Limit`], both named [`Policy::DEFAULT_NAME`]) its algorithm and whole limits, e.g.
/// `default:gcra:100/1m+5000/1d`.
///
/// Two policies share a budget exactly when their identities are equal. Every store keys
/// its state by it (in Redis, the key ends in the identity after the name).
///
/// - **A named policy owns its state by name.** Its counts may change (a new deploy,
///   an [override](crate::store::Overrides)) and the usage recorded so far carries over; instances that
///   run with other counts for one name (a rolling deploy) share the state, and each
///   refuses at its own counts. A change of algorithm or windows starts the keys afresh.
///   To keep two budgets apart, give them different names.
/// - **Unnamed policies never share by accident**: two layers that parse `"100/1m"` and
///   `"5/1m"` keep apart budgets. Two layers that parse the same text keep a budget each with
///   a store each (the default); on one store, the second fails to build
///   ([`BuildError::PolicyInUse`](crate::BuildError::PolicyInUse)) while the first is alive, so
///   that moving from a store per builder to a shared one never merges their budgets: name
///   them for a budget each, or clone one layer for a shared one. Changing an unnamed
///   policy's limits in code starts its keys afresh.
///
/// Caches outside the store (refusals, leases) key by the whole limits as well, so that
/// what was decided under some counts never answers for others.
///
/// What carrying usage over to other counts means for each algorithm: the sliding log
/// compares the same entries, the sliding window and the fixed window the same counters,
/// with the new counts. GCRA keeps each bucket's backlog, the units queued at the last
/// write: the same number of units, which drain at the new rate from that write on
/// (rounded up to GCRA's finer units, never down), so that `5/1h` raised to `8/1h` after
/// five requests at once admits three more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    // Shared, so that cloning a policy into a request's future does not allocate.
    name: Arc<str>,
    /// What the state is kept under, made once (see [identity](Policy#identity)):
    /// `<name>:<algorithm>:<windows>` for a named policy, e.g. `api:gcra:1m+1d`, and
    /// `default:<algorithm>:<limits>` for an unnamed one.
    identity: Arc<str>,
    /// A hash of `identity` (unkeyed: policies are not chosen by clients), so that maps keyed
    /// by identity and client hash eight bytes of it per lookup instead of its text.
    identity_hash: u64,
    /// The state and the limits it is decided against, `<name>:<algorithm>:<limits>`, e.g.
    /// `api:gcra:100/1m+5000/1d`: what a decision remembered outside the store (a cached
    /// refusal, a lease) holds for.
    terms: Arc<str>,
    /// A hash of `terms`, as `identity_hash`.
    terms_hash: u64,
    /// A hash of `identity` that every process and version computes alike, below 2^52 (exact
    /// in Lua's doubles): what count overrides are set for (see [`Owner`]).
    override_id: u64,
    /// Whose overrides govern the policy's decisions: its name (an unnamed policy's
    /// identity), and its plan.
    owner: Owner,
    /// Sorted by window, shortest first; no two share a window.
    limits: Arc<[Limit]>,
    /// The limits in the algorithms' units, computed once rather than per decision.
    windows: Arc<[Window]>,
    algorithm: Algorithm,
    /// Whether the algorithm can decide these limits exactly (see [`Policy::out_of_range`]).
    in_range: bool,
    /// The penalty box: how long (µs) a key that hits its limit is refused; 0 for none.
    block_micros: u64,
    /// The most requests of a key in flight at once (0: no concurrency limit).
    slots: u32,
    /// How long (µs) a slot lives without a renewal.
    slot_micros: u64,
    /// Whether the layer counts the policy's requests by their outcome
    /// ([`count_when`](crate::RateLimitLayerBuilder::count_when)): the store then keeps each
    /// admitted attempt's units apart until its outcome is in, so that a refusal caused only by
    /// attempts in flight is told from one caused by counted outcomes ([`Policy::attempts`]).
    attempts: bool,
}

/// Why a [`Policy`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// One of the limits is invalid.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// No limit where one is needed: text that names none, or an override of no counts. (A
    /// policy made without limits is one a concurrency limit alone decides; see
    /// [`Policy::new`].)
    #[error("a policy needs at least one limit")]
    NoLimits,
    /// Two limits have the same window; only the smaller count could ever matter.
    #[error("two limits share the window {window}; keep the smaller count")]
    DuplicateWindow {
        /// The shared window, e.g. `1m`.
        window: String,
    },
    /// Other limits for a policy (an override's, a plan's) must keep its windows: the
    /// state is kept per window. An override ([`Override`](crate::store::Override)) may
    /// leave some of them out, which keep the policy's counts, but names no other window.
    #[error("the limits must have the policy's windows, {expected}")]
    OtherWindows {
        /// The policy's windows, e.g. `1m+1h+1d`.
        expected: String,
    },
    /// A penalty box ([`Policy::block_for`]) shorter than 1 ms or longer than 3650 days.
    #[error("a penalty box of {duration:?} is out of range: 1 ms to 3650 days")]
    Block {
        /// The duration given.
        duration: Duration,
    },
    /// A concurrency limit ([`Policy::concurrency`]) of 0, or above
    /// [`Policy::MAX_CONCURRENCY`].
    #[error("a concurrency limit of {slots} is out of range: 1 to 1048576")]
    Concurrency {
        /// The limit given.
        slots: u32,
    },
    /// A slot expiry ([`Policy::slot_expiry`]) shorter than 100 ms or longer than an hour.
    #[error("a slot expiry of {duration:?} is out of range: 100 ms to 1 hour")]
    SlotExpiry {
        /// The duration given.
        duration: Duration,
    },
    /// The name is empty, longer than 64 bytes, or has a character outside `[A-Za-z0-9_.-]`.
    #[error("policy name {name:?} must be 1 to 64 characters of A-Z a-z 0-9 _ . -")]
    Name {
        /// The rejected name.
        name: String,
    },
}

impl Policy {
    /// The name a policy parsed from text (`"1/1m + 5/1h".parse::<Policy>()`) gets.
    pub const DEFAULT_NAME: &'static str = "default";

    /// A policy named `name` made of `limits` (in any order), using the sliding-window log.
    ///
    /// No limits at all make a policy that a concurrency limit alone decides
    /// (`Policy::new("streams", [])?.concurrency(100)?`, see [`Policy::concurrency`]); without
    /// one, the layer's builder and every store refuse it.
    pub fn new(
        name: impl Into<String>,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Self, PolicyError> {
        let name = name.into();
        let name_ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !name_ok {
            return Err(PolicyError::Name { name });
        }
        let limits = sorted(limits)?;
        let windows = limits.iter().map(Window::of).collect();
        let identity = identity(&name, Algorithm::SlidingLog, &limits);
        let terms = terms(&name, Algorithm::SlidingLog, &limits, None);
        Ok(Policy {
            identity_hash: hash(&identity),
            override_id: stable_id(&[&identity]),
            owner: Owner::new(&name, &identity, name == Policy::DEFAULT_NAME),
            identity,
            terms_hash: hash(&terms),
            terms,
            name: name.into(),
            limits: limits.into(),
            windows,
            algorithm: Algorithm::SlidingLog,
            in_range: true,
            block_micros: 0,
            slots: 0,
            slot_micros: Policy::DEFAULT_SLOT_EXPIRY.as_micros() as u64,
            attempts: false,
        })
    }

    /// The same limits under another name.
    pub fn named(self, name: impl Into<String>) -> Result<Self, PolicyError> {
        let (block_micros, slots, slot_micros) = (self.block_micros, self.slots, self.slot_micros);
        let attempts = self.attempts;
        let named = Policy::new(name, self.limits.iter().copied()).map(|p| Policy {
            block_micros,
            slots,
            slot_micros,
            attempts,
            ..p.with_algorithm(self.algorithm)
        })?;
        Ok(match self.plan() {
            Some(plan) => named.on_plan(plan),
            None => named,
        })
    }

    /// The same policy for the requests of plan `plan`: its decisions also go by the store's
    /// overrides for that plan ([`Scope::Plan`](crate::store::Scope::Plan)). The layer
    /// makes the policy of each plan a rule names ([`Rule::plan`](crate::Rule::plan)) this
    /// way. The state stays the policy's (the identity does not change), and maps of
    /// decisions kept outside the store (refusals, leases) keep each plan's apart.
    pub(crate) fn on_plan(mut self, plan: &str) -> Policy {
        self.owner = self.owner.on_plan(plan);
        self.terms = terms(&self.name, self.algorithm, &self.limits, Some(plan));
        self.terms_hash = hash(&self.terms);
        self
    }

    /// The plan the policy decides for, if any (see [`Policy::on_plan`]).
    pub(crate) fn plan(&self) -> Option<&str> {
        self.owner.plan()
    }

    /// The same limits decided by another algorithm.
    ///
    /// GCRA keeps each bucket in units of `gcd(count, window in µs) / count` µs, and a bucket
    /// must hold at most 2^50 of them (`count * window / gcd`): a monthly budget of 5 000 000
    /// is 2.6 * 10^12, but a count sharing few factors with a long window (1 000 003 per
    /// 30 days) is too fine. Such a policy builds, and the layer's builder and every store
    /// refuse it ([`BuildError::Unsupported`](crate::BuildError::Unsupported)).
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        // `<name>:<algorithm>:<rest>`; a name has no colon.
        let rest = self.identity.splitn(3, ':').nth(2).unwrap_or_default();
        self.identity = format!("{}:{}:{rest}", self.name, algorithm.tag()).into();
        self.identity_hash = hash(&self.identity);
        self.override_id = stable_id(&[&self.identity]);
        let unnamed = &*self.name == Policy::DEFAULT_NAME;
        let owner = Owner::new(&self.name, &self.identity, unnamed);
        self.owner = match self.owner.plan() {
            Some(plan) => owner.on_plan(plan),
            None => owner,
        };
        self.terms = terms(&self.name, algorithm, &self.limits, self.plan());
        self.terms_hash = hash(&self.terms);
        self.in_range = in_range(algorithm, &self.windows);
        self
    }

    /// The penalty box: once a key hits the policy's limit (a request refused by it, or a
    /// charge, such as a failed login counted by outcome, that leaves no room for one more),
    /// every request of the key is refused for at least `duration`, and until its limits admit
    /// it again; `Retry-After` is the later of the two
    /// ([`Decision::in_penalty_box`](crate::Decision::in_penalty_box)). With `10/1h` and a box
    /// of 15 minutes, ten failures in a burst lock the key out for the hour the limit refuses
    /// (`Retry-After: 3600`), ten spread over the hour for the 15 minutes
    /// (`Retry-After: 900`). The `retry_after` of a boxed refusal is the time until the same
    /// request would be admitted, never early (on Redis, `Retry-After` rounds it up to whole
    /// seconds): the later of the box's end and the limits' own retry for its cost, looked at
    /// without recording, under the limits in force for the key (an
    /// [override](crate::store::Overrides)'s included). Units held by requests in flight
    /// (attempts counted by outcome, usage reservations) weigh in it as they weigh at that
    /// moment: when they are given back later, the key is admitted earlier than it said.
    ///
    /// Requests refused during the box, and charges, never extend it: a box is set only where
    /// the key is in none, and once its length has passed, requests are decided by the limits
    /// again, their refusals answered as the box's (and setting no new one) until the key is
    /// admitted. The box is set in the same atomic step as the decision that triggers it (one
    /// script call on Redis), repeated by the deny cache a second at a time, and cleared by
    /// [`Store::reset`](crate::Store::reset); an override that raises the key's limits does not
    /// lift it. A look ([`Store::peek`](crate::Store::peek)) never sets it, and a request that
    /// no wait helps (larger than a limit itself) neither sets it nor is answered by it. The
    /// memory store keeps boxed keys when it is full (see [`MemoryStore`](crate::MemoryStore)).
    /// A boxed policy is never leased (`store::Leases`). The duration is from
    /// 1 ms to 3650 days.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::Policy;
    ///
    /// // Ten failures an hour, then fifteen minutes out.
    /// let failures = Policy::new("login-failures", ["10/1h".parse()?])?
    ///     .block_for(Duration::from_secs(15 * 60))?;
    /// # drop(failures);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn block_for(mut self, duration: Duration) -> Result<Policy, PolicyError> {
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        if duration < Duration::from_millis(1) || duration > Limit::MAX_WINDOW {
            return Err(PolicyError::Block { duration });
        }
        self.block_micros = micros;
        Ok(self)
    }

    /// The penalty box's duration, if the policy has one (see [`Policy::block_for`]).
    pub(crate) fn block(&self) -> Option<Duration> {
        (self.block_micros > 0).then(|| Duration::from_micros(self.block_micros))
    }

    /// The concurrency limit: at most `slots` requests of a key in flight at once, across
    /// every instance that shares the store, on top of the policy's rate limits.
    ///
    /// A request takes a slot when it is admitted, in the same atomic step as the rate limits
    /// (one script call on Redis: a request refused by either takes nothing from the other),
    /// and gives it back when its response body ends, fails or is dropped (a client that
    /// disconnects mid-stream), gRPC streams included. Each slot expires after
    /// [`slot_expiry`](Policy::slot_expiry) unless renewed: the layer that holds it renews
    /// its slots in batches every quarter of that while their requests run, so a request may
    /// run for hours, and the slots of an instance that dies come back within one expiry.
    /// A request refused for a slot answers `429` (gRPC `RESOURCE_EXHAUSTED`) with a
    /// `Retry-After` of the key's typical hold time across the fleet, which the store keeps from
    /// the give-backs (capped at the slot expiry, never under 1 s), and [`Decision::is_concurrency_limit`](crate::Decision::is_concurrency_limit)
    /// tells it apart from a rate refusal. The limit is from 1 to
    /// [`MAX_CONCURRENCY`](Policy::MAX_CONCURRENCY).
    ///
    /// A policy made without rate limits (`Policy::new(name, [])`) is decided by its
    /// concurrency limit alone: its requests record nothing but their slot, an admitted
    /// decision describes the concurrency limit
    /// ([`is_concurrency_limit`](crate::Decision::is_concurrency_limit), nothing counted in
    /// [`remaining`](crate::Decision::remaining)), and its responses carry `RateLimit-Policy`
    /// (the concurrency quota) but no `RateLimit` field while admitted. It takes no penalty
    /// box (nothing refuses for one to follow) and no event times.
    ///
    /// ```
    /// use tower_redis_ratelimit::Policy;
    ///
    /// // 60 requests a minute, and 2 streams at once.
    /// let streams = Policy::new("streams", ["60/1m".parse()?])?.concurrency(2)?;
    /// // 100 requests in flight at once, at any rate: no rate limit at all.
    /// let uploads = Policy::new("uploads", [])?.concurrency(100)?;
    /// # drop((streams, uploads));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn concurrency(mut self, slots: u32) -> Result<Policy, PolicyError> {
        if slots == 0 || slots > Policy::MAX_CONCURRENCY {
            return Err(PolicyError::Concurrency { slots });
        }
        self.slots = slots;
        Ok(self)
    }

    /// The largest concurrency limit, 2^20.
    pub const MAX_CONCURRENCY: u32 = 1 << 20;

    /// How long a concurrency slot lives without a renewal unless told otherwise: 10 s.
    pub const DEFAULT_SLOT_EXPIRY: Duration = Duration::from_secs(10);

    /// How long an instance cut off from the store can go on without losing its concurrency
    /// slots (default [`DEFAULT_SLOT_EXPIRY`](Policy::DEFAULT_SLOT_EXPIRY)), `L`. On Redis a
    /// slot is stored for `1.5 L + 2 B` after it was taken or last renewed (`B` the store's
    /// time budget, `RedisStoreBuilder::timeout`): that is
    /// the longest an instance that dies keeps its slots (`docs/operations.md`, "Requests in
    /// flight"). In the memory store a slot lives `L` after it was taken or renewed. From
    /// 100 ms to one hour.
    pub fn slot_expiry(mut self, expiry: Duration) -> Result<Policy, PolicyError> {
        if expiry < Duration::from_millis(100) || expiry > Duration::from_secs(3600) {
            return Err(PolicyError::SlotExpiry { duration: expiry });
        }
        self.slot_micros = expiry.as_micros() as u64;
        Ok(self)
    }

    /// The concurrency limit, if the policy has one (see [`Policy::concurrency`]).
    pub(crate) fn concurrency_limit(&self) -> Option<u32> {
        (self.slots > 0).then_some(self.slots)
    }

    /// How long a concurrency slot lives without a renewal (see [`Policy::slot_expiry`]).
    pub(crate) fn slot_lifetime(&self) -> Duration {
        Duration::from_micros(self.slot_micros)
    }

    /// The slot lifetime in µs.
    pub(crate) fn slot_micros(&self) -> u64 {
        self.slot_micros
    }

    /// The penalty box's duration in µs; 0 for none.
    pub(crate) fn block_micros(&self) -> u64 {
        self.block_micros
    }

    /// The same policy, its requests counted by their outcome: each admitted request is an
    /// attempt whose units the store keeps apart until its outcome is in (a refund or a
    /// [`Settlement::counted`](crate::Settlement)), so that a refusal those units alone cause
    /// is busy, not over: it sets no penalty box (`model::attempts`). The layer's builder
    /// makes every policy of a layer with `count_when` so.
    pub(crate) fn counting_attempts(mut self) -> Policy {
        self.attempts = true;
        self
    }

    /// Whether the policy's requests are counted by their outcome
    /// ([`counting_attempts`](Policy::counting_attempts)).
    pub(crate) fn attempts(&self) -> bool {
        self.attempts
    }

    /// The same policy decided against other counts: `limits` must have the policy's windows
    /// (in any order), and the state stays the policy's, so that usage recorded under the old
    /// counts still counts. Raising `5/1h` to `8/1h` after five requests admits three more;
    /// lowering it refuses until enough usage has aged out. See [identity](Policy#identity) for what
    /// carrying the state over means for each algorithm.
    pub(crate) fn with_limits(
        &self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Policy, PolicyError> {
        let other = Policy::new(self.name.to_string(), limits)?;
        let same_windows = other.limits.len() == self.limits.len()
            && other
                .limits
                .iter()
                .zip(self.limits.iter())
                .all(|(a, b)| a.window() == b.window());
        if !same_windows {
            return Err(PolicyError::OtherWindows {
                expected: window_labels(&self.limits).join("+"),
            });
        }
        let mut policy = self.clone();
        policy.windows = other.windows;
        policy.limits = other.limits;
        policy.terms = terms(&self.name, self.algorithm, &policy.limits, self.plan());
        policy.terms_hash = hash(&policy.terms);
        policy.in_range = in_range(self.algorithm, &policy.windows);
        Ok(policy)
    }

    /// Whether `other` is this policy but for its counts: the same identity, plan, penalty
    /// box and concurrency limit.
    pub(crate) fn same_but_counts(&self, other: &Policy) -> bool {
        self.identity == other.identity
            && self.owner == other.owner
            && self.block_micros == other.block_micros
            && self.slots == other.slots
            && self.slot_micros == other.slot_micros
    }

    /// Why the policy's algorithm cannot decide its limits exactly, if it cannot: a GCRA
    /// limit whose bucket, `count * window (µs) / gcd(count, window)`, is over 2^50. The
    /// layer's builder fails with [`BuildError::Unsupported`](crate::BuildError::Unsupported)
    /// for it and stores answer [`StoreError::Unsupported`](crate::StoreError::Unsupported);
    /// a count with more factors in common with the window, or another algorithm, fits.
    pub(crate) fn out_of_range(&self) -> Option<&'static str> {
        if self.limits.is_empty() && self.slots == 0 {
            return Some("a policy needs a rate limit or a concurrency limit");
        }
        if self.limits.is_empty() && self.block_micros > 0 {
            return Some("a penalty box needs a rate limit to follow: nothing else refuses");
        }
        (!self.in_range).then_some(
            "a GCRA limit's count * window (us) / gcd(count, window) is over 2^50; \
             choose a count that divides the window more evenly, or another algorithm",
        )
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name, shared.
    pub(crate) fn shared_name(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// What the policy's state is kept under (see [the type's docs](Policy#identity)).
    pub(crate) fn identity(&self) -> &str {
        &self.identity
    }

    /// A hash of the identity that every instance computes alike: what a count override is
    /// set for, which decides only requests of the same identity (see [`Owner`]).
    pub(crate) fn override_id(&self) -> u64 {
        self.override_id
    }

    /// Whose overrides govern the policy's decisions, and its plan.
    pub(crate) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// What maps of state key by: the identity.
    pub(crate) fn state_id(&self) -> Id<'_> {
        Id {
            text: &self.identity,
            hash: self.identity_hash,
        }
    }

    /// What maps of decisions kept outside the store (refusals, leases) key by: the name,
    /// algorithm and whole limits, so that other counts under one identity miss them.
    pub(crate) fn terms_id(&self) -> Id<'_> {
        Id {
            text: &self.terms,
            hash: self.terms_hash,
        }
    }

    /// The identity after the name and its colon: `<algorithm>:<windows>`, or
    /// `<algorithm>:<limits>` for an unnamed policy.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn shape(&self) -> &str {
        &self.identity[self.name.len() + 1..]
    }

    /// The limits, shortest window first.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// The limits as the algorithms take them, in the same order.
    pub(crate) fn windows(&self) -> &[Window] {
        &self.windows
    }

    /// The algorithm that decides this policy.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The longest window: how long a key's state must be kept after its last event.
    pub(crate) fn longest_window(&self) -> Duration {
        self.limits.last().map(Limit::window).unwrap_or_default()
    }

    /// The name of limit `index` in rate-limit headers: the policy name for a one-limit
    /// policy, otherwise the policy name and the window, e.g. `default-1h`.
    pub(crate) fn limit_name(&self, index: usize) -> String {
        match (&self.limits[..], self.limits.get(index)) {
            ([_], _) | (_, None) => self.name.to_string(),
            (_, Some(limit)) => format!("{}-{}", self.name, limit.window_label()),
        }
    }
}

/// A policy's key in a map ([`Policy::state_id`] or [`Policy::terms_id`]): its text,
/// shared, and a hash of it made once, so that a lookup hashes eight bytes of it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Id<'a> {
    pub(crate) text: &'a Arc<str>,
    pub(crate) hash: u64,
}

impl Id<'_> {
    /// Whether `text` is this key: the same shared text (a clone of the policy made it), or
    /// equal text.
    pub(crate) fn is(&self, text: &Arc<str>) -> bool {
        Arc::ptr_eq(text, self.text) || **text == **self.text
    }
}

impl From<Limit> for Policy {
    fn from(limit: Limit) -> Self {
        let identity = identity(Self::DEFAULT_NAME, Algorithm::SlidingLog, &[limit]);
        Policy {
            identity_hash: hash(&identity),
            override_id: stable_id(&[&identity]),
            owner: Owner::new(Self::DEFAULT_NAME, &identity, true),
            terms_hash: hash(&identity),
            terms: Arc::clone(&identity),
            identity,
            name: Self::DEFAULT_NAME.into(),
            limits: Arc::new([limit]),
            windows: Arc::new([Window::of(&limit)]),
            algorithm: Algorithm::SlidingLog,
            in_range: true,
            block_micros: 0,
            slots: 0,
            slot_micros: Policy::DEFAULT_SLOT_EXPIRY.as_micros() as u64,
            attempts: false,
        }
    }
}

/// `limits` shortest window first, checked: no two with one window. None at all makes a policy
/// that a concurrency limit alone decides ([`Policy::out_of_range`] says so of one without).
fn sorted(limits: impl IntoIterator<Item = Limit>) -> Result<Vec<Limit>, PolicyError> {
    let mut limits: Vec<Limit> = limits.into_iter().collect();
    limits.sort_by_key(|l| (l.window(), l.count()));
    if let Some(pair) = limits.windows(2).find(|p| p[0].window() == p[1].window()) {
        return Err(PolicyError::DuplicateWindow {
            window: pair[0].window_label(),
        });
    }
    Ok(limits)
}

/// What the state of a policy is kept under (see [identity](Policy#identity)):
/// `<name>:<algorithm>:<window>+<window>...` for a named policy, the full limits (as
/// [`terms`]) for an unnamed one.
fn identity(name: &str, algorithm: Algorithm, limits: &[Limit]) -> Arc<str> {
    if name == Policy::DEFAULT_NAME {
        return terms(name, algorithm, limits, None);
    }
    format!(
        "{name}:{}:{}",
        algorithm.tag(),
        window_labels(limits).join("+")
    )
    .into()
}

/// `<name>:<algorithm>:<limit>+<limit>...`, limits shortest first as [`Limit`] displays them,
/// then `@<plan>` for a policy on a plan (whose plan's overrides may differ from another's).
fn terms(name: &str, algorithm: Algorithm, limits: &[Limit], plan: Option<&str>) -> Arc<str> {
    let limits: Vec<String> = limits.iter().map(Limit::to_string).collect();
    let text = format!("{name}:{}:{}", algorithm.tag(), limits.join("+"));
    match plan {
        Some(plan) => format!("{text}@{plan}").into(),
        None => text.into(),
    }
}

/// Whether `algorithm` decides `windows` exactly (see [`Policy::out_of_range`]).
fn in_range(algorithm: Algorithm, windows: &[Window]) -> bool {
    match algorithm {
        Algorithm::Gcra => windows.iter().all(|w| w.gcra_bucket() <= MAX_GCRA_BUCKET),
        Algorithm::SlidingLog | Algorithm::SlidingWindow | Algorithm::FixedWindow => true,
    }
}

/// Each limit's window as [`Limit`] displays it, e.g. `1m`.
fn window_labels(limits: &[Limit]) -> Vec<String> {
    limits.iter().map(Limit::window_label).collect()
}

fn hash(identity: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_counts_and_plans_keep_the_identity() {
        let limit = |text: &str| text.parse::<Limit>().unwrap();
        let sms = Policy::new("sms", [limit("1/1m"), limit("5/1h"), limit("10/1d")]).unwrap();
        let vip = sms
            .with_limits([limit("1/1m"), limit("50/1h"), limit("100/1d")])
            .unwrap();
        assert_eq!(vip.identity(), sms.identity());
        assert_eq!(vip.limits()[1].count(), 50);
        let free = sms.clone().on_plan("free");
        assert_eq!(free.plan(), Some("free"));
        assert_eq!(free.identity(), sms.identity());
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn policy_sorts_and_validates() {
        let p: Policy = "10/1d + 1/1m, 5/1h".parse().unwrap();
        let windows: Vec<_> = p.limits().iter().map(|l| l.window_label()).collect();
        assert_eq!(windows, ["1m", "1h", "1d"]);
        assert_eq!(p.longest_window(), ms(86_400_000));
        assert_eq!(p.limit_name(1), "default-1h");
        assert_eq!(
            "1/1m + 2/60s".parse::<Policy>(),
            Err(PolicyError::DuplicateWindow {
                window: "1m".into()
            })
        );
        assert!(matches!(
            Policy::new("has space", [p.limits()[0]]),
            Err(PolicyError::Name { .. })
        ));
        // No limits at all: a policy that only a concurrency limit can decide.
        let none = Policy::new("x", std::iter::empty()).unwrap();
        assert!(none.out_of_range().is_some());
        assert!(none.concurrency(1).unwrap().out_of_range().is_none());
        let single: Policy = "5/10s".parse().unwrap();
        assert_eq!(single.limit_name(0), "default");
    }
}
