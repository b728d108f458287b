//! Counting by outcome (`count_when`): failed logins count, successes never do; the fourth
//! failure of `3/1m` meets the refusal (or, soft, the captcha), never the fifth. Each attempt
//! holds a unit from its admission until its response head says whether it counts, so no more
//! attempts than the limit reach the password check at once, however many are sent. On both
//! stores, every algorithm.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use axum::routing::post;
use axum::{Extension, Router};
use futures::StreamExt;
use http::{HeaderMap, HeaderName, Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::{
    Algorithm, Decisions, Header, MemoryStore, Policy, RateLimitLayer, Rule, Store,
};

/// The login form: `x-password: right` logs in. A request over a soft limit must solve the
/// captcha first (`x-password: captcha-solved <password>` stands for it here).
async fn login(
    decisions: Option<Extension<Decisions>>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    let given = headers.get("x-password").and_then(|v| v.to_str().ok());
    let (solved, password) = match given.and_then(|p| p.strip_prefix("captcha-solved ")) {
        Some(password) => (true, Some(password)),
        None => (false, given),
    };
    if decisions.is_some_and(|Extension(d)| d.is_over()) && !solved {
        return (StatusCode::FORBIDDEN, "captcha");
    }
    match password {
        Some("right") => (StatusCode::OK, "welcome"),
        _ => (StatusCode::UNAUTHORIZED, "wrong password"),
    }
}

fn form<St: Store>(
    store: St,
    algorithm: Algorithm,
    soft: bool,
) -> (Router, RateLimitLayer<Header, St>) {
    let policy = Policy::new("login-failures", ["3/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    let rule = if soft {
        Rule::new(policy).soft()
    } else {
        Rule::new(policy)
    };
    let layer = counting_failures(store, rule);
    let app = Router::new()
        .route("/login", post(login))
        .layer(layer.clone());
    (app, layer)
}

/// A layer of `rule` over `store`, keyed by `x-user`, that counts failed logins (401) only.
pub(crate) fn counting_failures<St: Store>(store: St, rule: Rule) -> RateLimitLayer<Header, St> {
    RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .store(store)
        .rule(rule)
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap()
}

/// One attempt, its status once every count it caused has landed.
async fn attempt<St: Store>(
    (app, layer): &(Router, RateLimitLayer<Header, St>),
    user: &str,
    password: &str,
) -> u16 {
    let request = Request::post("/login")
        .header("x-user", user)
        .header("x-password", password)
        .body(axum::body::Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    status
}

async fn outcomes<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let hard = form(store.clone(), algorithm, false);
        let what = format!("{algorithm:?}");
        let mut seen = Vec::new();
        for password in ["bad", "bad", "right", "bad", "bad", "right"] {
            seen.push(attempt(&hard, &format!("ann-{what}"), password).await);
        }
        assert_eq!(
            seen,
            [401, 401, 200, 401, 429, 429],
            "{what}: the fourth failure is refused"
        );

        let mut successes = Vec::new();
        for _ in 0..10 {
            successes.push(attempt(&hard, &format!("bob-{what}"), "right").await);
        }
        assert!(successes.iter().all(|&s| s == 200), "{what}: {successes:?}");

        let soft = form(store.clone(), algorithm, true);
        let mut seen = Vec::new();
        for password in ["bad", "bad", "bad", "right", "bad"] {
            seen.push(attempt(&soft, &format!("dan-{what}"), password).await);
        }
        assert_eq!(
            seen,
            [401, 401, 401, 403, 403],
            "{what}: the captcha from the fourth on"
        );
    }
}

#[tokio::test]
async fn failures_count_and_successes_never_do_on_memory() {
    outcomes(MemoryStore::new()).await;
}

#[tokio::test]
async fn failures_count_and_successes_never_do_on_redis() {
    let server = RedisServer::start();
    outcomes(server.store().await).await;
}

/// Failures past the captcha still count: `3/1m + 5/1h`, soft. After three failures the
/// form asks for a captcha; two more failures with it solved fill the hour's limit, so the
/// captcha is still asked once the minute is over. Had they not counted, the form would be
/// open again a minute later.
#[tokio::test]
async fn failures_over_a_soft_limit_still_count() {
    use std::time::UNIX_EPOCH;
    use tower_redis_ratelimit::store::ManualClock;

    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = Policy::new("login", ["3/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .store(store)
        .rule(Rule::new(policy).soft())
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let form = (
        Router::new()
            .route("/login", post(login))
            .layer(layer.clone()),
        layer,
    );
    let mut seen = Vec::new();
    for password in [
        "bad",
        "bad",
        "bad",
        "bad",
        "captcha-solved bad",
        "captcha-solved bad",
    ] {
        seen.push(attempt(&form, "eve", password).await);
    }
    assert_eq!(seen, [401, 401, 401, 403, 401, 401]);
    clock.advance(Duration::from_secs(61));
    assert_eq!(attempt(&form, "eve", "bad").await, 403, "the hour is full");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(attempt(&form, "eve", "right").await, 200);
}

fn failures(limit: &str) -> Policy {
    Policy::new("login-failures", [limit.parse().unwrap()]).unwrap()
}

/// A password check that holds every attempt reaching it until the test opens it, counting
/// the attempts that reached it.
#[derive(Clone)]
struct HeldCheck {
    reached: Arc<AtomicUsize>,
    open: tokio::sync::watch::Receiver<bool>,
}

impl HeldCheck {
    fn new() -> (HeldCheck, tokio::sync::watch::Sender<bool>) {
        let (open, opened) = tokio::sync::watch::channel(false);
        let check = HeldCheck {
            reached: Arc::default(),
            open: opened,
        };
        (check, open)
    }

    fn reached(&self) -> usize {
        self.reached.load(Ordering::SeqCst)
    }

    /// `login` behind the held check.
    fn app<St: Store>(&self, store: St, policy: Policy) -> (Router, RateLimitLayer<Header, St>) {
        let layer = RateLimitLayer::builder()
            .key(Header::new(HeaderName::from_static("x-user")))
            .store(store)
            .policy(policy)
            .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
            .build()
            .unwrap();
        let held = self.clone();
        let handler = move |headers: HeaderMap| {
            let mut held = held.clone();
            async move {
                held.reached.fetch_add(1, Ordering::SeqCst);
                let _ = held.open.wait_for(|open| *open).await;
                login(None, headers).await
            }
        };
        let app = Router::new()
            .route("/login", post(handler))
            .layer(layer.clone());
        (app, layer)
    }
}

/// Sends `passwords` for `user` at once, spread over `apps`; once every attempt is either
/// held at the password check or answered, opens the check. The statuses, in order.
async fn at_once<St: Store>(
    apps: &[(Router, RateLimitLayer<Header, St>)],
    check: &HeldCheck,
    open: &tokio::sync::watch::Sender<bool>,
    user: &str,
    passwords: &[&str],
) -> Vec<u16> {
    open.send_replace(false);
    let (answered, before) = (Arc::new(AtomicUsize::new(0)), check.reached());
    let sent: Vec<_> = passwords
        .iter()
        .enumerate()
        .map(|(i, password)| {
            let (app, _) = &apps[i % apps.len()];
            let request = Request::post("/login")
                .header("x-user", user)
                .header("x-password", *password)
                .body(axum::body::Body::empty())
                .unwrap();
            let (app, answered) = (app.clone(), Arc::clone(&answered));
            tokio::spawn(async move {
                let response = app.oneshot(request).await.unwrap();
                answered.fetch_add(1, Ordering::SeqCst);
                response.status().as_u16()
            })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while check.reached() - before + answered.load(Ordering::SeqCst) < passwords.len() {
        assert!(tokio::time::Instant::now() < deadline, "attempts stuck");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    open.send_replace(true);
    let statuses = futures::future::join_all(sent).await;
    for (_, layer) in apps {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    statuses.into_iter().map(Result::unwrap).collect()
}

/// 500 wrong passwords for one user sent at once through two instances on Redis, `3/1m`:
/// three reach the password check, every other one is refused before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guesses_in_flight_are_counted_across_instances_on_redis() {
    let server = RedisServer::start();
    let (check, open) = HeldCheck::new();
    let apps = [
        check.app(server.store().await, failures("3/1m")),
        check.app(server.store().await, failures("3/1m")),
    ];
    let statuses = at_once(&apps, &check, &open, "ann", &["bad"; 500]).await;
    let wrong = statuses.iter().filter(|&&s| s == 401).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(check.reached(), 3, "reached the password check");
    assert_eq!((wrong, refused), (3, 497));
    // The three failures count: the key stays refused.
    let next = at_once(&apps, &check, &open, "ann", &["right"]).await;
    assert_eq!(next, [429]);
}

/// A success among failures in flight gives its unit back once its head is in: with `3/1m`,
/// one right and two wrong passwords at once leave room for one more failure.
async fn success_among_failures<St: Store>(store: St) {
    let (check, open) = HeldCheck::new();
    let apps = [check.app(store, failures("3/1m"))];
    let mut first = at_once(&apps, &check, &open, "bob", &["bad", "right", "bad"]).await;
    first.sort();
    assert_eq!(first, [200, 401, 401]);
    let mut after = at_once(&apps, &check, &open, "bob", &["bad", "bad"]).await;
    after.sort();
    assert_eq!(after, [401, 429], "only the two failures counted");
}

#[tokio::test]
async fn a_success_among_concurrent_failures_is_never_counted_on_memory() {
    success_among_failures(MemoryStore::new()).await;
}

#[tokio::test]
async fn a_success_among_concurrent_failures_is_never_counted_on_redis() {
    let server = RedisServer::start();
    success_among_failures(server.store().await).await;
}

/// An answer whose body streams for long: `1/1m`, a 401 with 16 MiB streamed. The failure
/// counts from its admission, so a second attempt sent once the first's head is in is
/// refused; a success gives its unit back as soon as its head is in, not when its body ends.
#[tokio::test]
async fn the_outcome_is_settled_when_the_head_is_in() {
    async fn streamed(headers: HeaderMap) -> (StatusCode, axum::body::Body) {
        let (status, _) = login(None, headers).await;
        let chunks = futures::stream::iter(0..16)
            .map(|_| Ok::<_, std::convert::Infallible>(vec![b'x'; 1 << 20]));
        (status, axum::body::Body::from_stream(chunks))
    }
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .policy(Policy::new("login-failures", ["1/1m".parse().unwrap()]).unwrap())
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(streamed))
        .layer(layer.clone());
    let send = |user: &str, password: &str| {
        let request = Request::post("/login")
            .header("x-user", user)
            .header("x-password", password)
            .body(axum::body::Body::empty())
            .unwrap();
        app.clone().oneshot(request)
    };
    // Heads in, bodies not read.
    let failure = send("ann", "bad").await.unwrap();
    assert_eq!(failure.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(send("ann", "bad").await.unwrap().status(), 429);

    let success = send("bob", "right").await.unwrap();
    assert_eq!(success.status(), StatusCode::OK);
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    let again = send("bob", "bad").await.unwrap();
    assert_eq!(
        again.status(),
        StatusCode::UNAUTHORIZED,
        "the success gave its unit back"
    );
    drop((failure, success, again));
}

/// With leases, four instances spend units they hold without asking Redis: 200 wrong
/// passwords at once at `20/1m`, after rounds of successes that made every instance take a
/// lease (and give units back), still reach the password check at most 20 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guesses_in_flight_stay_within_the_limit_with_leases() {
    use tower_redis_ratelimit::store::Leases;
    use tower_redis_ratelimit::RedisStore;

    let server = RedisServer::start();
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ] {
        let (check, open) = HeldCheck::new();
        let policy = failures("20/1m").with_algorithm(algorithm);
        let mut apps = Vec::new();
        for _ in 0..4 {
            let store = RedisStore::builder(server.url())
                .leases(Leases::new().max_share(0.5))
                .connect()
                .await
                .unwrap();
            apps.push(check.app(store, policy.clone()));
        }
        let user = format!("ann-{algorithm:?}");
        for _ in 0..5 {
            let welcome = at_once(&apps, &check, &open, &user, &["right"; 30]).await;
            assert!(welcome.contains(&200), "{algorithm:?}: {welcome:?}");
        }
        let before = check.reached();
        let statuses = at_once(&apps, &check, &open, &user, &["bad"; 200]).await;
        let reached = check.reached() - before;
        let wrong = statuses.iter().filter(|&&s| s == 401).count();
        assert!(
            reached <= 20,
            "{algorithm:?}: {reached} reached the password check"
        );
        assert_eq!(wrong, reached, "{algorithm:?}");
    }
}

/// A client that goes away once its attempt has reached the password check, before the
/// answer, learns nothing and is counted: its unit stays held. Three such attempts at `3/1m`,
/// then the right password is refused.
#[tokio::test]
async fn an_attempt_abandoned_before_its_answer_keeps_its_unit() {
    let (check, open) = HeldCheck::new();
    let (app, layer) = check.app(MemoryStore::new(), failures("3/1m"));
    for n in 1..=3 {
        let request = Request::post("/login")
            .header("x-user", "mallory")
            .header("x-password", "guess")
            .body(axum::body::Body::empty())
            .unwrap();
        let attempt = tokio::spawn(app.clone().oneshot(request));
        while check.reached() < n {
            tokio::task::yield_now().await;
        }
        attempt.abort();
        assert!(attempt.await.unwrap_err().is_cancelled());
    }
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    let right = at_once(&[(app, layer)], &check, &open, "mallory", &["right"]).await;
    assert_eq!(right, [429]);
}
