//! [`RateLimitLayer`] and its builder.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use ipnet::IpNet;
use tower_layer::Layer;

use crate::admission::{AllowList, CostFn, Limiter, Seen, SEEN_CAPACITY};
use crate::deny_cache::DenyCache;
use crate::ledger::post::{InFlight, Ledger, StoreLedger};
use crate::ledger::slots::Holds;
use crate::ledger::tab::Metering;
use crate::metered::{Metered, RequestBytes, Steps, Whole};
use crate::response::{Options, Unit};
use crate::rules::{Capabilities, Compiler, PlanFn, RequestHead, RuleTable, Rules};
use crate::usage::UsageReport;
use crate::{
    Decision, FailureMode, Key, MemoryStore, MissingKey, PeerIp, Policy, PolicyError, RateLimit,
    Rule, Store,
};

/// Applies rate-limit policies to the requests of the wrapped service.
///
/// Build one with [`RateLimitLayer::builder`]; clones share the store.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_redis_ratelimit::RateLimitLayer;
///
/// # fn main() -> Result<(), tower_redis_ratelimit::BuildError> {
/// // 5 requests per 10 seconds per client IP, in this process.
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(RateLimitLayer::builder().policy("5/10s").build()?);
/// # Ok(()) }
/// ```
///
/// `M` is [`Metered`] for a layer that meters request bodies
/// ([`request_bytes`](RateLimitLayerBuilder::request_bytes)), [`Whole`] otherwise.
pub struct RateLimitLayer<K = PeerIp, St = MemoryStore, M = Whole> {
    limiter: Arc<Limiter<K, St>>,
    bodies: PhantomData<fn() -> M>,
}

/// Entries the local deny cache holds unless told otherwise.
pub const DEFAULT_DENY_CACHE: u64 = 100_000;

impl<K, St, M> Clone for RateLimitLayer<K, St, M> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            limiter: Arc::clone(&self.limiter),
            bodies: PhantomData,
        }
    }
}

impl<K, St, M> std::fmt::Debug for RateLimitLayer<K, St, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rules", &self.limiter.table)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Starts a builder keyed by [`PeerIp`] over a new [`MemoryStore`].
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            key: PeerIp,
            store: MemoryStore::new(),
            settings: Settings::default(),
            bodies: PhantomData,
        }
    }
}

impl<K, St, M> RateLimitLayer<K, St, M> {
    /// What the layer decides with, for tests of admission without a service.
    #[cfg(test)]
    pub(crate) fn limiter(&self) -> &Limiter<K, St> {
        &self.limiter
    }

    /// The default policy in force: the one for requests that no rule matches.
    #[cfg(test)]
    pub(crate) fn policy(&self) -> Option<Policy> {
        self.limiter.table.load().default_policy().cloned()
    }

    /// The handle that replaces the layer's rules and default policy at run time (see
    /// [`RuleTable`]); the layer, its clones and the services they made follow it.
    pub fn rule_table(&self) -> RuleTable {
        self.limiter.table.clone()
    }

    /// Waits up to `timeout` for the [usage](crate::usage) settles and concurrency slot
    /// give-backs ([`Policy::concurrency`](crate::Policy::concurrency)) under way to finish;
    /// returns how many are still under way then (0: all finished). Those that start
    /// meanwhile are waited for too.
    ///
    /// A settle runs in a task of its own after its response has ended, so a server that
    /// stops its runtime at once after its last response loses the settles still waiting for
    /// Redis (each is logged and counted as failed, since it may not have been recorded). Call
    /// this on graceful shutdown, once the server has stopped taking requests, on the layer or
    /// any clone of it: clones share their settles, so a clone kept when the layer went into a
    /// router sees the router's. A layer with neither usage nor concurrency limits has none
    /// and answers 0 at once.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// use axum::{routing::get, Router};
    /// use tower_redis_ratelimit::{usage::UsageReport, RateLimitLayer};
    ///
    /// # async fn run(listener: tokio::net::TcpListener) -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::builder()
    ///     .policy("2000/1m")
    ///     .usage(UsageReport::new())
    ///     .build()?;
    /// let app: Router = Router::new()
    ///     .route("/", get(|| async { "hello" }))
    ///     .layer(layer.clone());
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
    ///     .await?;
    /// let unsettled = layer.settled(Duration::from_secs(5)).await;
    /// if unsettled > 0 {
    ///     eprintln!("{unsettled} usage settles did not finish");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn settled(&self, timeout: std::time::Duration) -> usize {
        self.limiter.holds.in_flight().settled(timeout).await
    }
}

impl<S, K, St, M> Layer<S> for RateLimitLayer<K, St, M> {
    type Service = RateLimit<S, K, St, M>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.limiter))
    }
}

/// Why a [`RateLimitLayer`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Neither a default policy nor a rule was given.
    #[error("no policy: call .policy(\"100/1m\") or .rule(Rule::new(..))")]
    NoPolicy,
    /// A policy is invalid.
    #[error("invalid policy")]
    Policy(#[from] PolicyError),
    /// Two different policies of one layer share a name: their state is kept apart (see
    /// [identity](Policy#identity)), but the `RateLimit` fields and metrics could not tell them apart.
    #[error("two different policies are named {0:?}; give each its own name")]
    PolicyConflict(String),
    /// Another live layer on the same store already uses this unnamed policy (one parsed from
    /// text such as `"3/1m"`): the two would share one budget on a store passed to both, and
    /// keep two with a store each, so the builder refuses rather than choose. Name the
    /// policies ([`Policy::new`]) for a budget each, or build one layer and clone it for a
    /// shared one. The claim ends when the other layer, its clones, their services and the
    /// handles on its [rule table](RateLimitLayer::rule_table) are dropped. Separate stores
    /// (two `RedisStore`s on one Redis, as instances of a fleet have) never conflict. See
    /// [identity](Policy#identity).
    #[error(
        "unnamed policy \"{0}\" is already used by another live layer on this store: name the \
         policies (Policy::new) for a budget each, or build one layer and clone it to share one"
    )]
    PolicyInUse(String),
    /// A rule's [plan](Rule::plan) is invalid: its limits, its name given twice, or the layer
    /// has no [plan function](RateLimitLayerBuilder::plan) to choose it.
    #[error("policy {policy:?}, plan {plan:?}: {why}")]
    Plan {
        /// The policy's name.
        policy: String,
        /// The plan's name.
        plan: String,
        /// What is wrong with it.
        why: String,
    },
    /// A rule's path pattern is invalid.
    #[error("path pattern {pattern:?}: {why}")]
    Pattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        why: String,
    },
    /// An allow-listed network is not in CIDR notation.
    #[error("allow-listed network {0:?} is not an address or CIDR network")]
    Network(String),
    /// The store cannot decide a policy (e.g. a leasing `RedisStore` whose GCRA headroom would
    /// leave a bucket less than one unit).
    #[error("policy {policy:?}: {why}")]
    Unsupported {
        /// The policy's name.
        policy: String,
        /// What the store said.
        why: String,
    },
    /// [`request_bytes`](RateLimitLayerBuilder::request_bytes) cannot be combined with the
    /// layer's other settings: a cost or usage of its own (the bytes are the cost), or a step
    /// of 0 bytes.
    #[error("request_bytes: {0}")]
    RequestBytes(&'static str),
}

impl From<Infallible> for BuildError {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

/// Everything the builder holds but the key extractor and the store.
#[derive(Default)]
struct Settings {
    rules: Rules,
    plan: Option<Arc<PlanFn>>,
    allow_keys: Vec<Key>,
    allow_networks: Vec<String>,
    cost: Option<Arc<CostFn>>,
    usage: Option<UsageReport>,
    missing_key: MissingKey,
    /// `None`: the default capacity; `Some(0)`: no deny cache.
    deny_cache: Option<u64>,
    options: Options,
    /// How request bodies are metered, on a layer built with `request_bytes`.
    request_bytes: Option<RequestBytes>,
}

impl Settings {
    /// A layer that meters request bodies counts their bytes: no cost or usage of its own,
    /// and steps of at least one byte.
    fn metering_alone(&self) -> Result<(), BuildError> {
        let Some(bytes) = self.request_bytes else {
            return Ok(());
        };
        if self.cost.is_some() {
            return Err(BuildError::RequestBytes(
                "a layer that meters request bodies takes no cost: the bytes are the cost",
            ));
        }
        if self.usage.is_some() {
            return Err(BuildError::RequestBytes(
                "a layer that meters request bodies takes no usage or count_when: \
                 limit those with a layer of their own",
            ));
        }
        if bytes.step == 0 {
            return Err(BuildError::RequestBytes("a step of 0 bytes admits nothing"));
        }
        Ok(())
    }

    /// What checks the layer's rules against the rest of its settings and `store`, and
    /// compiles them: for the table the layer is built with and for every table that
    /// replaces it.
    fn compiler<St: Store>(&self, store: &St) -> Compiler {
        let overrides = store.run_time_overrides();
        let claims = store.claims();
        let store = store.clone();
        let capabilities = Capabilities {
            plan_fn: self.plan.is_some(),
            soft: self.options.soft,
            decisions: !self.options.no_decisions,
            step: self.request_bytes.map(|bytes| bytes.step),
            supports: Box::new(move |policy| store.supports(policy)),
            usage: self.usage.clone(),
        };
        let counts_outcomes = self
            .usage
            .as_ref()
            .is_some_and(UsageReport::counts_outcomes);
        Compiler {
            options: Options {
                counts_outcomes,
                ..self.options.clone()
            },
            capabilities,
            overrides,
            claims,
        }
    }
}

/// Configures a [`RateLimitLayer`]; checks everything in [`build`](Self::build).
pub struct RateLimitLayerBuilder<K = PeerIp, St = MemoryStore, M = Whole> {
    key: K,
    store: St,
    settings: Settings,
    bodies: PhantomData<fn() -> M>,
}

impl<K, St, M> std::fmt::Debug for RateLimitLayerBuilder<K, St, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("rules", &self.settings.rules)
            .finish_non_exhaustive()
    }
}

impl<K, St, M> RateLimitLayerBuilder<K, St, M> {
    /// The default policy, for requests that no [`rule`](Self::rule) matches: a [`Policy`], or
    /// text such as `"5/10s"` or `"1/1m + 5/1h"`. Invalid text is reported by
    /// [`build`](Self::build). Without a default policy, requests that no rule matches are
    /// not limited.
    pub fn policy<P>(mut self, policy: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        self.settings.rules = self.settings.rules.policy(policy);
        self
    }

    /// Adds a rule; the first rule that matches a request chooses its policy.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.settings.rules = self.settings.rules.rule(rule);
        self
    }

    /// Starts from these rules and default policy (e.g. read from a file), replacing those
    /// given so far; [`RateLimitLayer::rule_table`] replaces them at run time.
    pub fn rules(mut self, rules: Rules) -> Self {
        self.settings.rules = rules;
        self
    }

    /// Which plan a request is on, for policies with [plans](Rule::plan): a plan name from
    /// the request's head, typically an extension that your authentication middleware set, or
    /// a claim of a verified token. `None`, or a plan the policy does not name, gets the
    /// policy's own limits. Asked only for requests whose policy has plans.
    ///
    /// A plan read from a header the client sets is the client's choice: read it from
    /// something the client cannot forge.
    pub fn plan<F>(mut self, plan: F) -> Self
    where
        F: for<'a> Fn(&RequestHead<'a>) -> Option<&'a str> + Send + Sync + 'static,
    {
        self.settings.plan = Some(Arc::new(plan));
        self
    }

    /// How requests are told apart (default [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> RateLimitLayerBuilder<K2, St, M> {
        RateLimitLayerBuilder {
            key,
            store: self.store,
            settings: self.settings,
            bodies: PhantomData,
        }
    }

    /// Where state is kept (default a new [`MemoryStore`]).
    pub fn store<St2: Store>(self, store: St2) -> RateLimitLayerBuilder<K, St2, M> {
        RateLimitLayerBuilder {
            key: self.key,
            store,
            settings: self.settings,
            bodies: PhantomData,
        }
    }

    /// Limits the bytes of request bodies, metered as they stream: the layer's policies count
    /// bytes, and the inner service gets each body as a [`MeteredBody`](crate::metered::MeteredBody),
    /// which passes on only what the store admitted. However many uploads of a key run at
    /// once, on however many instances share the store, their handlers get at most a limit's
    /// count of bytes per window.
    ///
    /// A request is admitted for its declared length (`Content-Length`, else the body's exact
    /// size hint), reserved whole; one larger than a limit's count itself is answered `413
    /// Content Too Large` before its body is read. A body that declares no length is admitted
    /// for one [step](RequestBytes::step) and asks the store for one more each time it has
    /// passed what was admitted; steps neither box the key nor take a concurrency slot. When
    /// a step is refused the body is cut: the handler's next read fails with a
    /// [`QuotaExceeded`](crate::usage::QuotaExceeded), and the layer answers instead of the
    /// handler, `413` when the upload can never fit, `429` with a `Retry-After` after which a
    /// retry of it is admitted otherwise (gRPC: `RESOURCE_EXHAUSTED`). What was admitted and
    /// not read is refunded when the body ends or is dropped. A handler that sent its response
    /// head before it read its body cannot have it replaced: it sees the error alone.
    ///
    /// The bytes are the cost: a layer that meters bodies takes no [`cost`](Self::cost), nor
    /// [`usage`](Self::usage) or [`count_when`](Self::count_when).
    ///
    /// ```
    /// use axum::{body::Bytes, routing::post, Router};
    /// use tower_redis_ratelimit::{metered::RequestBytes, RateLimitLayer};
    ///
    /// async fn upload(body: Bytes) -> String {
    ///     format!("{} bytes stored\n", body.len())
    /// }
    ///
    /// // 1 MB of uploads an hour per client address.
    /// let layer = RateLimitLayer::builder()
    ///     .policy("1000000/1h")
    ///     .request_bytes(RequestBytes::new())
    ///     .build()?;
    /// let app: Router = Router::new().route("/upload", post(upload)).layer(layer);
    /// # Ok::<(), tower_redis_ratelimit::BuildError>(())
    /// ```
    pub fn request_bytes(mut self, bytes: RequestBytes) -> RateLimitLayerBuilder<K, St, Metered> {
        self.settings.request_bytes = Some(bytes);
        self.settings.options.unit = Unit::ContentBytes;
        RateLimitLayerBuilder {
            key: self.key,
            store: self.store,
            settings: self.settings,
            bodies: PhantomData,
        }
    }

    /// Never limits this key (e.g. an internal API key or a monitoring address).
    pub fn allow_key(mut self, key: impl Into<Key>) -> Self {
        self.settings.allow_keys.push(key.into());
        self
    }

    /// Never limits clients whose address (or IPv6 prefix) is inside `network` (`10.0.0.0/8`,
    /// `2001:db8::/32` or one address); checked by [`build`](Self::build). Applies to keys made
    /// by [`PeerIp`] and [`ClientIp`](crate::ClientIp): a header value that looks like an
    /// address is not one.
    pub fn allow_network(mut self, network: impl Into<String>) -> Self {
        self.settings.allow_networks.push(network.into());
        self
    }

    /// How many units a request costs (default 1), e.g. 10 for a bulk endpoint. A request
    /// that costs 0 is admitted without being counted.
    ///
    /// ```
    /// use tower_redis_ratelimit::RateLimitLayer;
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .policy("100/1m")
    ///     .cost(|head| if head.uri.path().starts_with("/bulk") { 10 } else { 1 })
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn cost<F>(mut self, cost: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> u32 + Send + Sync + 'static,
    {
        self.settings.cost = Some(Arc::new(cost));
        self
    }

    /// Limits by what requests used, as the inner service reports it after answering (LLM
    /// tokens, rows, bytes): each request is checked for room for a reservation
    /// ([`UsageReport::reserve`], 1 by default) and, when its response body ends, charged
    /// the rest of its usage or refunded what it did not use. See [`usage`](crate::usage)
    /// for the ways to report usage and for how far over a key can go.
    ///
    /// ```
    /// use axum::{routing::get, Extension, Router};
    /// use tower_redis_ratelimit::usage::{UsageMeter, UsageReport};
    /// use tower_redis_ratelimit::{key::Header, RateLimitLayer};
    ///
    /// async fn search(Extension(meter): Extension<UsageMeter>) -> String {
    ///     let rows = vec!["a", "b", "c"];
    ///     meter.set(rows.len() as u64);
    ///     rows.join("\n")
    /// }
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .key(Header::new(http::HeaderName::from_static("x-api-key")))
    ///     .policy("10000/1h")
    ///     .usage(UsageReport::new())
    ///     .build()?;
    /// let app: Router = Router::new().route("/search", get(search)).layer(layer);
    /// # Ok::<(), tower_redis_ratelimit::BuildError>(())
    /// ```
    pub fn usage(mut self, report: UsageReport) -> Self {
        self.settings.usage = Some(report);
        self
    }

    /// Counts a request only when its response matches `outcome`, e.g. a failed login's
    /// `401`: each attempt holds its cost from its admission until its response head is in,
    /// and gives it back then unless it matches, so no more attempts than the limit reach the
    /// handler at once; a key is refused (or marked over, when soft) once its counted and
    /// in-flight attempts leave no room for one more. Short for
    /// `.usage(UsageReport::count_when(outcome))`, which says more.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_redis_ratelimit::{key::Header, Policy, RateLimitLayer};
    ///
    /// // Three failed logins a minute per user name.
    /// let layer = RateLimitLayer::builder()
    ///     .key(Header::new(http::HeaderName::from_static("x-user")))
    ///     .policy(Policy::new("login-failures", ["3/1m".parse()?])?)
    ///     .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn count_when<F>(self, outcome: F) -> Self
    where
        F: Fn(&crate::ResponseHead<'_>) -> bool + Send + Sync + 'static,
    {
        self.usage(UsageReport::count_when(outcome))
    }

    /// Shadow mode, for a safe roll-out: requests are counted and their responses carry the
    /// `RateLimit` fields, but a request over the limit is passed on instead of refused, and a
    /// `tracing` event (target `tower_redis_ratelimit`, level INFO) reports it.
    pub fn shadow(mut self, enabled: bool) -> Self {
        self.settings.options.shadow = enabled;
        self
    }

    /// Whether the layer puts its decision into each request's [`Decisions`](crate::Decisions)
    /// (default `true`). A request's extensions are a map that the first insert allocates and
    /// that grows as layers and the router insert more; off, a service whose handlers never
    /// read the decisions saves that: about 1 100 instructions and 2 allocations per request
    /// through an axum router (`benches/layer.rs` under callgrind, `docs/performance.md`). A
    /// soft limit needs them on, for its handler to see that a request is over.
    pub fn decisions(mut self, enabled: bool) -> Self {
        self.settings.options.no_decisions = !enabled;
        self
    }

    /// Whether admitted responses carry the `RateLimit-Policy` and `RateLimit` fields
    /// (default `true`). Rejections always carry them.
    pub fn headers_on_allowed(mut self, enabled: bool) -> Self {
        self.settings.options.hide_allowed_headers = !enabled;
        self
    }

    /// Builds the response to a refused request instead of the default plain-text 429.
    /// gRPC requests are still refused the gRPC way.
    ///
    /// The layer adds `Retry-After`, `RateLimit-Policy` and `RateLimit` unless the response
    /// already has them.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_redis_ratelimit::RateLimitLayer;
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .policy("100/1m")
    ///     .on_rejection(|_| {
    ///         let mut r = Response::new(Bytes::from_static(br#"{"error":"slow down"}"#));
    ///         *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    ///         r
    ///     })
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn on_rejection<F>(mut self, rejection: F) -> Self
    where
        F: Fn(&Decision) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.settings.options.on_rejection = Some(Arc::new(rejection));
        self
    }

    /// What to do with a request that yields no key (default [`MissingKey::Reject`]).
    pub fn on_missing_key(mut self, missing_key: MissingKey) -> Self {
        self.settings.missing_key = missing_key;
        self
    }

    /// The local deny cache: after the store refuses a key with a retry-after, requests for
    /// that key and policy are refused locally, with no store call, until the retry-after has
    /// passed. `0` turns it off. It never admits anything the store would refuse, and shadow
    /// mode does not use it. Default: [`DEFAULT_DENY_CACHE`] entries for a remote store such
    /// as [`RedisStore`](crate::RedisStore), off for the [`MemoryStore`], which answers as
    /// quickly.
    pub fn deny_cache(mut self, capacity: u64) -> Self {
        self.settings.deny_cache = Some(capacity);
        self
    }

    /// Counts each decided request's key in Redis HyperLogLogs by minute, hour and day, for
    /// [`UniqueClients::count`](crate::unique::UniqueClients::count). Recording is queued and
    /// pipelined; it never delays a response. Feature `redis`.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn unique_clients(mut self, recorder: crate::unique::UniqueClients) -> Self {
        self.settings.options.unique = Some(recorder);
        self
    }

    /// How long a request refused only for a concurrency slot
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) waits for one before it is refused
    /// (default zero: refused at once). A key's waiters are served in one queue across every
    /// instance that shares the store, in the order of their deadlines (arrival order among
    /// layers with the same `max_wait`): the store puts a refused waiter in the key's queue and
    /// keeps a slot given back for the first in it. On each instance the first of a
    /// key's waiters asks again when a slot of the key is given back here, and every 50 ms for
    /// slots that free on other instances or expire. A request refused by a rate limit never
    /// waits.
    /// Keep it short (it is capped at an hour): a waiting request holds its connection, and
    /// the readiness of the service the layer wraps (a `Buffer` or `ConcurrencyLimit` below
    /// the layer keeps a permit for it); a client's own timeout may end it first (it then
    /// leaves the queue). Not in soft or shadow mode, where nothing is refused, nor for
    /// decisions of a fallback store.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::{Policy, RateLimitLayer};
    ///
    /// let streams = Policy::new("streams", ["60/1m".parse()?])?.concurrency(2)?;
    /// let layer = RateLimitLayer::builder()
    ///     .policy(streams)
    ///     .max_wait(Duration::from_secs(2))
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn max_wait(mut self, wait: std::time::Duration) -> Self {
        self.settings.options.max_wait = wait.min(std::time::Duration::from_secs(3600));
        self
    }

    /// What to do when the store cannot decide (default [`FailureMode::Open`]).
    pub fn failure_mode(mut self, mode: FailureMode) -> Self {
        self.settings.options.failure_mode = mode;
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<K, St, M>, BuildError>
    where
        St: Store,
    {
        self.settings.metering_alone()?;
        let compiler = self.settings.compiler(&self.store);
        let falls_back = matches!(self.settings.options.failure_mode, FailureMode::Fallback(_));
        let Settings {
            rules,
            plan,
            allow_keys,
            allow_networks,
            cost,
            usage,
            missing_key,
            deny_cache,
            request_bytes,
            // Read by the compiler above.
            options: _,
        } = self.settings;
        let table = RuleTable::new(compiler, rules)?;
        let networks = networks(&allow_networks)?;
        let default_cost = usage.as_ref().map_or(1, |report| report.reserve);
        let ledger: Arc<dyn Ledger> = Arc::new(StoreLedger(self.store.clone()));
        let in_flight: Arc<InFlight> = Arc::default();
        let metering = usage.map(|report| {
            Arc::new(Metering {
                report,
                ledger: Arc::clone(&ledger),
                in_flight: Arc::clone(&in_flight),
            })
        });
        let steps = request_bytes.map(|bytes| {
            Arc::new(Steps {
                step: bytes.step,
                ledger: Arc::clone(&ledger),
                in_flight: Arc::clone(&in_flight),
            })
        });
        let holds = Arc::new(Holds::new(in_flight));
        let deny_cache = deny_cache_of(&self.store, deny_cache);
        Ok(RateLimitLayer {
            limiter: Arc::new(Limiter {
                key: self.key,
                store: self.store,
                table,
                plan,
                allow: AllowList::new(allow_keys.into_iter().collect(), networks),
                cost,
                default_cost,
                missing_key,
                usage: metering,
                holds,
                ledger,
                deny_cache,
                seen: falls_back.then(|| Arc::new(Seen::new(SEEN_CAPACITY))),
                steps,
            }),
            bodies: PhantomData,
        })
    }
}

/// The allow-listed networks, each given in CIDR notation or as one address.
fn networks(networks: &[String]) -> Result<Vec<IpNet>, BuildError> {
    networks
        .iter()
        .map(|n| {
            n.parse::<IpNet>()
                .or_else(|_| n.parse::<IpAddr>().map(IpNet::from))
                .map(|net| net.trunc())
                .map_err(|_| BuildError::Network(n.clone()))
        })
        .collect()
}

/// The deny cache of `capacity` entries (0: none); by default, one for a remote store only,
/// since a local store answers as fast as the cache would.
fn deny_cache_of<St: Store>(store: &St, capacity: Option<u64>) -> Option<DenyCache> {
    let default = if store.is_local() {
        0
    } else {
        DEFAULT_DENY_CACHE
    };
    match capacity.unwrap_or(default) {
        0 => None,
        capacity => {
            let store = store.clone();
            Some(DenyCache::new(
                capacity,
                Arc::new(move || store.limits_version()),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_reports_bad_and_missing_policies() {
        assert_eq!(
            RateLimitLayer::builder().build().unwrap_err(),
            BuildError::NoPolicy
        );
        let err = RateLimitLayer::builder()
            .policy("5/10parsecs")
            .build()
            .unwrap_err();
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        assert!(cause.is_some_and(|c| c.contains("10parsecs")), "{err:?}");
        let layer = RateLimitLayer::builder().policy("5/10s").build().unwrap();
        assert_eq!(layer.policy().unwrap().limits()[0].count(), 5);
        let conflict = RateLimitLayer::builder()
            .rule(Rule::new("5/1m").path("/a"))
            .policy("6/1m")
            .build();
        assert_eq!(
            conflict.unwrap_err(),
            BuildError::PolicyConflict("default".into())
        );
        let pattern = RateLimitLayer::builder()
            .rule(Rule::new("5/1m").path("nope"))
            .build();
        assert!(matches!(pattern, Err(BuildError::Pattern { .. })));
        let network = RateLimitLayer::builder()
            .policy("5/1m")
            .allow_network("10.0.0.0/99")
            .build();
        assert_eq!(
            network.unwrap_err(),
            BuildError::Network("10.0.0.0/99".into())
        );
    }

    #[test]
    fn request_bytes_takes_no_cost_or_usage_and_a_step_every_limit_admits() {
        let metered = || {
            RateLimitLayer::builder()
                .policy("1000000/1h")
                .request_bytes(RequestBytes::new())
        };
        assert!(metered().build().is_ok());
        let cost = metered().cost(|_| 5).build();
        assert!(matches!(cost, Err(BuildError::RequestBytes(_))), "{cost:?}");
        let usage = metered().usage(UsageReport::new()).build();
        assert!(
            matches!(usage, Err(BuildError::RequestBytes(_))),
            "{usage:?}"
        );
        let outcome = metered().count_when(|_| true).build();
        assert!(matches!(outcome, Err(BuildError::RequestBytes(_))));
        let zero = metered().request_bytes(RequestBytes::new().step(0)).build();
        assert!(matches!(zero, Err(BuildError::RequestBytes(_))), "{zero:?}");
        // A step over the smallest count of a rule's policy could never be admitted.
        let small = Policy::new("avatars", ["10000/1m".parse().unwrap()]).unwrap();
        let over = metered().rule(Rule::new(small).path("/avatar")).build();
        let Err(BuildError::Unsupported { policy, why }) = over else {
            panic!("{over:?}");
        };
        assert_eq!(policy, "avatars");
        assert!(why.contains("65536"), "{why}");
        let fits = RateLimitLayer::builder()
            .policy("10000/1m")
            .request_bytes(RequestBytes::new().step(10_000))
            .build();
        assert!(fits.is_ok());
    }

    #[test]
    fn layer_is_clone_send_sync() {
        fn check<T: Clone + Send + Sync + 'static>() {}
        check::<RateLimitLayer>();
        #[cfg(feature = "redis")]
        check::<RateLimitLayer<crate::key::Header, crate::RedisStore>>();
        check::<RateLimitLayer<PeerIp, MemoryStore, Metered>>();
    }
}
