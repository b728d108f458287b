//! Usage-based limits: charging a request for what it used (tokens, rows, bytes), known only
//! once the inner service has answered, often only at the end of a streamed body.
//!
//! With [`RateLimitLayerBuilder::usage`](crate::RateLimitLayerBuilder::usage), the layer
//! checks each request against a small *reservation* (its cost: [`UsageReport::reserve`],
//! 1 by default) and, once the response is done, settles the difference between the usage the
//! service reported and the reservation, a charge or a refund, with one
//! [`Store::settle`](crate::Store::settle) call. A request that reports nothing costs its
//! reservation and no second call.
//!
//! The service reports usage in any of these ways; where several report, the first of
//! trailers, [`UsageMeter`] and response head that reported counts.
//! - a [`Usage`] in the response's extensions;
//! - a response header or trailer ([`UsageReport::header`], or a closure of your own over
//!   the head's or the trailers' fields: gRPC metadata are both);
//! - a [`UsageMeter`], which the layer puts in each request's extensions, updated by the
//!   handler while it streams its body.
//!
//! With [`UsageReport::bytes`], the response body's data bytes are the usage instead of the
//! meter.
//!
//! **Streams metered as they go.** With [`UsageReport::step`], a response is not only settled
//! at its end: each data frame passes on what the request's decisions admitted (its
//! reservation first), and a frame that needs more waits for a *step*, a decision of the store
//! by the policy's limits alone (no penalty box, no slot, no attempt). The store therefore
//! holds, while the response streams, what it sent and at most one step more, visible to
//! every instance; and once a step is refused the response is cut ([`Cut`]), so that it never
//! sends more than its decisions admitted. It is charged what it sent, when it ends, is cut
//! or the client leaves, and the unused part of its last step is refunded.
//!
//! The settle happens when the response body ends (its last frame, its trailers, an error) or
//! is dropped. It never holds up or fails the response: it runs in a task of its own, and a
//! settle the store cannot make is logged (WARN) and counted
//! (`ratelimit_settle_errors_total`, see [`metrics`](crate::metrics)).
//!
//! **Counting by outcome** ([`RateLimitLayerBuilder::count_when`](crate::RateLimitLayerBuilder::count_when)) is the same machinery with the
//! outcome as the usage: each attempt reserves its cost when it is admitted, and once its
//! response head is in, an outcome that does not count (a successful login) gives the
//! reservation back, at once rather than when the body ends.
//!
//! **What counts as a failed settle.** On Redis a settle is one script call of its own that
//! waits up to 3 s for its reply, not the decisions' time budget: Redis records it when the
//! script runs, however late the reply, so a settle that outlasts a paused or slow Redis
//! lands and is not counted. Counted are the settles that did not run (the store was found
//! unreachable moments ago, the connection failed, Redis answered an error), those with no
//! reply within 3 s (Redis down, or paused for longer: these may still run later), and those
//! abandoned under way because their runtime shut down (these may or may not have reached
//! Redis; see shutdown below).
//!
//! **Stacked layers.** A request that another layer refuses, inside this one, costs this one
//! nothing: a rate-limit layer of this crate (from its store or its deny cache) or a
//! [`BlocklistLayer`](crate::blocklist::BlocklistLayer) marks every answer of its own with
//! [`Refused`](crate::response::Refused) in the response's extensions, and a usage layer
//! outside that admitted the request settles it to zero, giving its whole reservation back,
//! whatever the meter says. Refusals by your own middleware count the same once they carry the
//! marker. A layer outside that does not limit by usage keeps the request's cost.
//!
//! **A client that disconnects early** is charged what the meter (or the head) reported so
//! far, and its reservation if nothing was reported.
//!
//! **Reported usage is trusted**: it comes from your service, never from the client, and is
//! charged as it is, up to 2^52 units: more than any state holds, so a larger value (up to
//! `u64::MAX`) is charged as 2^52 and logged, and the key is refused as long as its algorithm
//! allows for that much (`docs/operations.md`, "Range").
//!
//! **Refunds free only what still weighs**, in the state the request was recorded in: a
//! refund that lands after the key was reset (or expired, or Redis restarted) frees nothing,
//! nor does one of GCRA units that have drained since the admission (see
//! [`Store::settle`](crate::Store::settle)).
//!
//! **Refunds and the deny cache.** A refund forgets this instance's cached refusal of the key
//! (see [`deny_cache`](crate::RateLimitLayerBuilder::deny_cache)) when it is sent and again
//! when it has landed, so that the room it made is used at once; and a refusal the store
//! decided before the refund landed, whose reply comes in after, is not cached. Other
//! instances repeat their cached refusals until their `Retry-After`; where large reservations
//! are refunded often, `.deny_cache(0)` asks the store every time.
//!
//! **Settles need a tokio runtime** when the store waits for I/O (Redis): a body dropped outside
//! one is not settled, and that is logged and counted as a failure. A settle still under way
//! when the runtime shuts down is abandoned, and logged and counted as such; on graceful
//! shutdown, wait for the settles under way with
//! [`RateLimitLayer::settled`](crate::RateLimitLayer::settled) before the runtime stops.
//!
//! **What is settled**: requests the store admitted, with the store that admitted them (the
//! fallback store of [`FailureMode::Fallback`](crate::FailureMode::Fallback) when it did).
//! Requests admitted without a decision (the store failed and the layer fails open) and, in
//! shadow mode, requests passed on over the limit, recorded nothing and are not settled.
//!
//! **On the sliding log**, a request that is charged more than its reservation leaves two
//! entries: the reservation at admission and the rest when its body ends, each aging out of
//! the window on its own. A refund makes the reservation's entry lighter instead.
//!
//! **How far over a key can go.** A request is admitted only while the reservation fits, and
//! its usage is recorded afterwards, even past the limit; later requests are then refused
//! until enough usage has aged out of the window (drained, for GCRA), which their
//! `Retry-After` says. So a key's recorded usage exceeds its limit by at most the usage of
//! the requests that were in flight when it filled, less their reservations. With
//! [leases](crate::store::Leases), a charge that fills a key also ends the leases of the
//! instance that made it; other instances stop at their own next charge or lease fetch
//! (`docs/leases.md` states their bound).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};

use crate::rules::ResponseHead;
use crate::{BuildError, Policy};

/// Units a response used, put in its extensions by the inner service:
/// `response.extensions_mut().insert(Usage(512))`. In axum, a handler can return
/// `(Extension(Usage(512)), body)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Usage(pub u64);

/// The usage of one request, updated by the handler while it works, e.g. per chunk of a
/// streamed body, and settled when the response body ends or is dropped.
///
/// The layer puts one in the extensions of every request when usage is configured (several usage
/// layers, per API key and per address say, share one); clones share the count. A handler that may
/// also run without the layer takes it as an option, so that it does not fail where there is none.
/// A request that reported nothing costs its reservation: to give it back (a request that did no
/// work), set the meter to 0.
///
/// ```
/// use axum::Extension;
/// use tower_redis_ratelimit::usage::UsageMeter;
///
/// async fn export(meter: Option<Extension<UsageMeter>>) -> String {
///     let rows = ["a", "b", "c"];
///     if let Some(Extension(meter)) = meter {
///         meter.add(rows.len() as u64);
///     }
///     rows.join("\n")
/// }
///
/// let meter = UsageMeter::default();
/// assert_eq!(meter.get(), None);
/// meter.add(120);
/// meter.add(30);
/// assert_eq!(meter.get(), Some(150));
/// # let _: axum::routing::MethodRouter = axum::routing::get(export);
/// ```
#[derive(Debug, Clone)]
pub struct UsageMeter(Arc<AtomicU64>);

impl Default for UsageMeter {
    fn default() -> Self {
        UsageMeter::new()
    }
}

/// The meter's value before anything is reported: a count that no `add` reaches.
const NOT_REPORTED: u64 = u64::MAX;

impl UsageMeter {
    /// A meter with nothing reported.
    pub(crate) fn new() -> Self {
        UsageMeter(Arc::new(AtomicU64::new(NOT_REPORTED)))
    }

    /// Adds `units` to the usage reported so far.
    pub fn add(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let base = if now == NOT_REPORTED { 0 } else { now };
                Some(base.saturating_add(units).min(NOT_REPORTED - 1))
            });
    }

    /// Sets the usage to `units`, e.g. a total the upstream reported.
    pub fn set(&self, units: u64) {
        self.0.store(units.min(NOT_REPORTED - 1), Ordering::Release);
    }

    /// The usage reported so far; `None` before anything was.
    pub fn get(&self) -> Option<u64> {
        match self.0.load(Ordering::Acquire) {
            NOT_REPORTED => None,
            units => Some(units),
        }
    }
}

/// Reads a usage from a response's head or trailers.
pub(crate) type FieldsFn = dyn Fn(&HeaderMap) -> Option<u64> + Send + Sync;

/// Whether a response is an outcome that counts ([`UsageReport::count_when`]).
pub(crate) type OutcomeFn = dyn Fn(&ResponseHead<'_>) -> bool + Send + Sync;

/// How the inner service reports usage, and what the layer reserves before calling it; given
/// to [`RateLimitLayerBuilder::usage`](crate::RateLimitLayerBuilder::usage).
///
/// The [`Usage`] extension and the [`UsageMeter`] always count; add a header, a trailer or a
/// closure for services that report usage in their fields.
///
/// ```
/// use tower_redis_ratelimit::{usage::UsageReport, RateLimitLayer};
///
/// // 2 000 tokens per minute; each request reserves 1 and is charged what its response's
/// // (or its trailers') `x-usage-tokens` field says.
/// let layer = RateLimitLayer::builder()
///     .policy("2000/1m")
///     .usage(UsageReport::new().header(http::HeaderName::from_static("x-usage-tokens")))
///     .build()?;
/// # Ok::<(), tower_redis_ratelimit::BuildError>(())
/// ```
#[derive(Clone)]
pub struct UsageReport {
    pub(crate) reserve: u32,
    pub(crate) head: Option<Arc<FieldsFn>>,
    pub(crate) trailers: Option<Arc<FieldsFn>>,
    /// Count a request only when its response matches: see [`UsageReport::count_when`].
    pub(crate) outcome: Option<Arc<OutcomeFn>>,
    /// The units a step of a response metered as it streams asks for: see
    /// [`UsageReport::step`]. `None`: settled once, at the end.
    pub(crate) step: Option<u32>,
    /// Whether the usage is the response body's data bytes ([`UsageReport::bytes`]).
    pub(crate) bytes: bool,
    /// How a metered response ends when a step is refused.
    pub(crate) cut: Cut,
}

/// How a response metered as it streams ([`UsageReport::step`]) ends once a step of it is
/// refused, its quota spent: given to [`UsageReport::on_cut`].
///
/// A gRPC response (`content-type: application/grpc…`) ends the gRPC way whatever this says:
/// with trailers `grpc-status: 8` (`RESOURCE_EXHAUSTED`) and a `grpc-message` naming the quota.
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Cut {
    /// The body ends with an error, a boxed [`QuotaExceeded`]: the server then aborts the
    /// response (HTTP/1.1 closes the connection before the body's end, HTTP/2 resets the
    /// stream), which every client sees as a failed, incomplete response.
    #[default]
    Abort,
    /// The body ends normally after these bytes, e.g. a server-sent event saying that the
    /// quota is spent: for clients that read a stream to its end, such as an SSE client.
    Final(Bytes),
}

impl Default for UsageReport {
    fn default() -> Self {
        UsageReport::new()
    }
}

impl std::fmt::Debug for UsageReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageReport")
            .field("reserve", &self.reserve)
            .field("head", &self.head.is_some())
            .field("trailers", &self.trailers.is_some())
            .field("outcome", &self.outcome.is_some())
            .field("step", &self.step)
            .field("bytes", &self.bytes)
            .field("cut", &self.cut)
            .finish()
    }
}

impl UsageReport {
    /// Usage from the [`Usage`] extension and the [`UsageMeter`]; a reservation of 1.
    pub fn new() -> Self {
        UsageReport {
            reserve: 1,
            head: None,
            trailers: None,
            outcome: None,
            step: None,
            bytes: false,
            cut: Cut::Abort,
        }
    }

    /// Counts a request only when its response matches `outcome` (a failed login's `401`, a wrong
    /// OTP), for its cost (1 unless a cost closure says otherwise), and nothing otherwise; what
    /// else reports usage is not read.
    ///
    /// **Attempts in flight hold a unit.** An attempt is admitted only while the key has room
    /// for it, and it holds its cost from then on: when its response head is in, an outcome
    /// that does not count gives the unit back (one [`Store::settle`](crate::Store::settle)
    /// there and then, not when the body ends), and one that counts keeps it. So with `3/1m`,
    /// no more than 3 attempts reach the handler unmarked in a minute, however many are sent
    /// at once, on however many instances: the fourth failure is refused (or marked over, under
    /// a [soft](crate::Rule::soft) policy). The price: while 3 attempts are in flight, a fourth
    /// is refused even if all three will succeed; but such a refusal, which only attempts in
    /// flight cause, is *busy* ([`Decision::is_busy`](crate::Decision::is_busy)): it starts no
    /// [penalty box](crate::Policy::block_for), a soft policy does not mark it over, and its
    /// `Retry-After` is a second, an estimate of when the attempts end. So a user with no
    /// counted failure is never boxed nor asked for a captcha, however many attempts they make
    /// at once. An attempt whose head never comes (the client went away, the service failed)
    /// keeps its unit, as a failure. An attempt of cost 0 (a
    /// [cost closure](crate::RateLimitLayerBuilder::cost) may say so) holds and counts
    /// nothing: such attempts are not limited. A decision the store could not make in time
    /// may still be recorded when Redis runs it late; its units are given back when its reply
    /// comes, within 10 s (`docs/operations.md`, "A failed decision is given back when Redis
    /// answers late").
    ///
    /// A request passed on over a soft limit reserved nothing; it is charged when it matches,
    /// so that failures past the captcha still add up (towards a longer limit of the same
    /// policy, say). A request that a layer inside this one refused gives its unit back.
    ///
    /// The request's `RateLimit` fields and [`Decisions`](crate::Decisions) say what is left
    /// once the request's own unit is taken, as on every layer.
    ///
    /// [`RateLimitLayerBuilder::count_when`](crate::RateLimitLayerBuilder::count_when) is the
    /// short way to set it.
    pub(crate) fn count_when<F>(outcome: F) -> Self
    where
        F: Fn(&ResponseHead<'_>) -> bool + Send + Sync + 'static,
    {
        UsageReport {
            outcome: Some(Arc::new(outcome)),
            ..UsageReport::new()
        }
    }

    /// Whether requests are counted by their outcome ([`count_when`](Self::count_when)).
    pub(crate) fn counts_outcomes(&self) -> bool {
        self.outcome.is_some()
    }

    /// The units a request must find room for before it is called (default 1), and that it is
    /// charged if it reports no usage. `0` refuses a request only while the key is over its
    /// limit. A cost closure ([`RateLimitLayerBuilder::cost`](crate::RateLimitLayerBuilder::cost)),
    /// when set, gives each request's reservation instead.
    pub fn reserve(mut self, units: u32) -> Self {
        self.reserve = units;
        self
    }

    /// Meters the response **as it streams**, a store decision per step of `units`, rather than
    /// settling its usage once, when it ends.
    ///
    /// The request's reservation is its first credit. After each data frame of the response
    /// body, its units (the growth of the [`UsageMeter`] since the frame before, which the
    /// handler adds to before it yields the frame; or the frame's bytes, with
    /// [`bytes`](Self::bytes)) pass while the credit covers them; when it does not, the frame
    /// waits for a step of `units` (or of what the frame lacks, when it outweighs a step),
    /// decided by the policy's limits alone (no penalty box, no concurrency slot). An admitted
    /// step lets the frame pass; a refused one drops it and ends the response as
    /// [`on_cut`](Self::on_cut) says.
    ///
    /// So a response never sends more than its steps admitted, and the store holds, while it
    /// streams, between what it sent and that plus one step. When it ends or the client leaves,
    /// it is charged what it sent (or what the trailers or the head report, when that is
    /// more), and the unused credit is refunded.
    ///
    /// `units` must be at least 1 and at most the smallest count of the policy's limits (a
    /// larger step could never be admitted): [`build`](crate::RateLimitLayerBuilder::build)
    /// says [`BuildError::Unsupported`] otherwise.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_redis_ratelimit::{usage::{Cut, UsageReport}, RateLimitLayer};
    ///
    /// // 10 000 tokens a minute, decided 500 at a time while the stream runs; a stream cut
    /// // short ends with an event that says so.
    /// let layer = RateLimitLayer::builder()
    ///     .policy("10000/1m")
    ///     .usage(
    ///         UsageReport::new()
    ///             .step(500)
    ///             .on_cut(Cut::Final(Bytes::from_static(b"event: error\ndata: quota\n\n"))),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tower_redis_ratelimit::BuildError>(())
    /// ```
    pub fn step(mut self, units: u32) -> Self {
        self.step = Some(units);
        self
    }

    /// The usage is the response body's data bytes, counted as they are sent (with
    /// [`step`](Self::step)) or once at the end; the [`UsageMeter`] is not read.
    pub fn bytes(mut self) -> Self {
        self.bytes = true;
        self
    }

    /// How a response metered with [`step`](Self::step) ends once a step is refused (default
    /// [`Cut::Abort`]).
    pub fn on_cut(mut self, cut: Cut) -> Self {
        self.cut = cut;
        self
    }

    /// Checks the step against `policy`: at least 1, and at most the smallest count of its
    /// limits, or no step of it could ever be admitted.
    pub(crate) fn check_step(&self, policy: &Policy) -> Result<(), BuildError> {
        let Some(step) = self.step else {
            return Ok(());
        };
        let unsupported = |why: String| BuildError::Unsupported {
            policy: policy.name().to_owned(),
            why,
        };
        if step == 0 {
            return Err(unsupported("a usage step must be at least 1 unit".into()));
        }
        // A limit of 0 blocks every request, steps alike: no step size would change that.
        let counts = policy.limits().iter().map(|l| l.count()).filter(|&c| c > 0);
        let smallest = counts.min();
        match smallest {
            Some(count) if u64::from(step) > count => Err(unsupported(format!(
                "a usage step of {step} units is more than its limit of {count} admits"
            ))),
            _ => Ok(()),
        }
    }

    /// Usage from the response field `name`, a decimal number, in the head or in the trailers
    /// (gRPC: initial or trailing metadata).
    pub fn header(self, name: HeaderName) -> Self {
        let read = move |fields: &HeaderMap| -> Option<u64> {
            fields.get(&name)?.to_str().ok()?.trim().parse().ok()
        };
        let read: Arc<FieldsFn> = Arc::new(read);
        UsageReport {
            head: Some(Arc::clone(&read)),
            trailers: Some(read),
            ..self
        }
    }

    /// Usage from the response head's fields, as `read` finds it (`None`: not reported).
    pub fn from_head<F>(mut self, read: F) -> Self
    where
        F: Fn(&HeaderMap) -> Option<u64> + Send + Sync + 'static,
    {
        self.head = Some(Arc::new(read));
        self
    }

    /// Usage from the response's trailers, as `read` finds it (`None`: not reported).
    pub fn from_trailers<F>(mut self, read: F) -> Self
    where
        F: Fn(&HeaderMap) -> Option<u64> + Send + Sync + 'static,
    {
        self.trailers = Some(Arc::new(read));
        self
    }
}

/// Why a metered body was cut: a step of it was refused, so its quota is spent. A request
/// body's handler sees it as its body's error (find it with `downcast_ref` on the error or in
/// its source chain); it names the quota, the units that passed before the cut, and when a
/// retry of the same body would be admitted, if ever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaExceeded {
    policy: String,
    passed: u64,
    retry_after: Option<Duration>,
    limit: u64,
    window: Duration,
}

impl QuotaExceeded {
    /// A cut of `policy` after `passed` units; `retry_after` as the store answered for the
    /// whole body (`None`: it can never fit, or the key is blocked), `limit` and `window` the
    /// limit that refused it.
    pub(crate) fn new(
        policy: impl Into<String>,
        passed: u64,
        retry_after: Option<Duration>,
        limit: u64,
        window: Duration,
    ) -> QuotaExceeded {
        QuotaExceeded {
            policy: policy.into(),
            passed,
            retry_after,
            limit,
            window,
        }
    }

    /// The name of the policy whose quota is spent.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// The units that passed before the cut; they stay charged.
    pub fn passed(&self) -> u64 {
        self.passed
    }

    /// How long until a retry of the same body would be admitted; `None` when it never
    /// would (it exceeds the limit itself) or the key is blocked.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether the body can never fit: it exceeds the limit's count itself (HTTP's `413
    /// Content Too Large` for a body metered in bytes). Not so for a blocked key (count 0).
    pub fn is_too_large(&self) -> bool {
        self.retry_after.is_none() && self.limit > 0
    }
}

impl std::fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let policy = &self.policy;
        if self.is_too_large() {
            let (count, window) = (self.limit, self.window.as_secs());
            return write!(
                f,
                "the body exceeds the limit \"{policy}\" ({count} per {window} s) itself"
            );
        }
        write!(
            f,
            "rate limit \"{policy}\" exceeded after {} units",
            self.passed
        )?;
        match self.retry_after {
            // Whole seconds, rounded up, as `Retry-After` says it.
            Some(wait) => write!(f, "; retry in {} s", wait.as_secs_f64().ceil() as u64),
            None => Ok(()),
        }
    }
}

impl std::error::Error for QuotaExceeded {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_exceeded_names_the_quota_and_says_whether_a_wait_helps() {
        let hour = Duration::from_secs(3600);
        let wait = Some(Duration::from_millis(11_200));
        let later = QuotaExceeded::new("uploads", 983_040, wait, 1_000_000, hour);
        assert!(!later.is_too_large());
        assert_eq!(
            later.to_string(),
            "rate limit \"uploads\" exceeded after 983040 units; retry in 12 s"
        );
        let never = QuotaExceeded::new("uploads", 0, None, 1_000_000, hour);
        assert!(never.is_too_large());
        assert_eq!(
            never.to_string(),
            "the body exceeds the limit \"uploads\" (1000000 per 3600 s) itself"
        );
        let blocked = QuotaExceeded::new("uploads", 5, None, 0, hour);
        assert!(!blocked.is_too_large());
        assert_eq!(blocked.policy(), "uploads");
        assert_eq!(blocked.passed(), 5);
        assert_eq!(blocked.retry_after(), None);
    }

    #[test]
    fn meter_adds_sets_and_saturates() {
        let meter = UsageMeter::new();
        let clone = meter.clone();
        assert_eq!(meter.get(), None);
        clone.add(0);
        assert_eq!(meter.get(), Some(0));
        meter.add(u64::MAX);
        assert_eq!(meter.get(), Some(u64::MAX - 1));
        clone.set(7);
        assert_eq!(meter.get(), Some(7));
    }

    #[test]
    fn header_reads_a_decimal_field() {
        let report = UsageReport::new().header(HeaderName::from_static("x-usage"));
        let mut fields = HeaderMap::new();
        let read = report.head.unwrap();
        assert_eq!(read(&fields), None);
        fields.insert("x-usage", " 42 ".parse().unwrap());
        assert_eq!(read(&fields), Some(42));
        fields.insert("x-usage", "lots".parse().unwrap());
        assert_eq!(read(&fields), None);
    }
}
