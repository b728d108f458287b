//! Honest users at once, under counting by outcome (`count_when`) with a penalty box: a
//! double-clicked login form, a mobile app's retries. The attempts in flight hold their units
//! (so that no more guesses than the count reach the handler at once), and a refusal they alone
//! cause is *busy*: it starts no box, a soft layer does not mark it over, and its `Retry-After`
//! is a second. Failures still count, and box the user as before. Every algorithm, on the
//! memory store and on Redis.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderMap, HeaderName, Request, StatusCode};
use tokio::sync::watch;
use tower::ServiceExt;
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::{
    Algorithm, Decisions, MemoryStore, Policy, RateLimitLayer, Rule, Store,
};

use crate::support::ALGORITHMS;

/// The handler's side: how many attempts are inside, and whether they may answer.
#[derive(Clone)]
struct Gate {
    inside: Arc<AtomicUsize>,
    /// Soft layers: how many attempts came in marked over, and marked busy.
    over: Arc<AtomicUsize>,
    busy: Arc<AtomicUsize>,
    open: watch::Receiver<bool>,
}

/// `x-password: right` logs in, anything else fails (401); each attempt waits at the gate.
async fn login(
    Extension(gate): Extension<Gate>,
    decisions: Option<Extension<Decisions>>,
    headers: HeaderMap,
) -> StatusCode {
    if let Some(Extension(decisions)) = decisions {
        if decisions.is_over() {
            gate.over.fetch_add(1, Ordering::SeqCst);
        }
        if decisions.is_busy() {
            gate.busy.fetch_add(1, Ordering::SeqCst);
        }
    }
    if headers.contains_key("x-hold") {
        gate.inside.fetch_add(1, Ordering::SeqCst);
        let mut open = gate.open.clone();
        open.wait_for(|open| *open).await.unwrap();
    }
    match headers.get("x-password").map(|v| v.as_bytes()) {
        Some(b"right") => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

fn policy(text: &str, algorithm: Algorithm) -> Policy {
    let name = format!("login-{algorithm:?}").to_lowercase();
    Policy::new(name, [text.parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
        .block_for(Duration::from_secs(900))
        .unwrap()
}

struct Form<St> {
    app: Router,
    layer: RateLimitLayer<Header, St>,
    gate: Gate,
    open: watch::Sender<bool>,
}

fn form<St: Store>(store: St, rule: Rule) -> Form<St> {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .store(store)
        .rule(rule)
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let (open, opened) = watch::channel(false);
    let gate = Gate {
        inside: Arc::default(),
        over: Arc::default(),
        busy: Arc::default(),
        open: opened,
    };
    let app = Router::new()
        .route("/login", post(login))
        .layer(Extension(gate.clone()))
        .layer(layer.clone());
    Form {
        app,
        layer,
        gate,
        open,
    }
}

/// Status and `Retry-After` of one attempt.
type Answer = (u16, Option<u64>);

async fn send(app: Router, user: String, password: &'static str) -> Answer {
    send_as(app, user, password, true).await
}

/// One attempt; `hold`: it waits in the handler until the gate opens.
async fn send_as(app: Router, user: String, password: &'static str, hold: bool) -> Answer {
    let mut request = Request::post("/login")
        .header("x-user", user)
        .header("x-password", password);
    if hold {
        request = request.header("x-hold", "1");
    }
    let request = request.body(axum::body::Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    let retry = response.headers().get("retry-after");
    let retry = retry.map(|v| v.to_str().unwrap().parse().unwrap());
    (response.status().as_u16(), retry)
}

impl<St: Store> Form<St> {
    /// `n` attempts of `user` at once: every one is decided while those admitted wait in the
    /// handler, then the handler answers them all. Their answers, in no set order, once every
    /// settle they caused has landed.
    async fn at_once(&self, user: &str, password: &'static str, n: usize) -> Vec<Answer> {
        self.open.send_replace(false);
        self.gate.inside.store(0, Ordering::SeqCst);
        let attempts: Vec<_> = (0..n)
            .map(|_| tokio::spawn(send(self.app.clone(), user.to_owned(), password)))
            .collect();
        // Every attempt is decided: inside the handler, or answered.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let answered = attempts.iter().filter(|a| a.is_finished()).count();
            if answered + self.gate.inside.load(Ordering::SeqCst) == n {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "attempts undecided");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.open.send_replace(true);
        let mut answers = Vec::new();
        for attempt in attempts {
            answers.push(attempt.await.unwrap());
        }
        assert_eq!(self.layer.settled(Duration::from_secs(5)).await, 0);
        answers
    }

    async fn one(&self, user: &str, password: &'static str) -> Answer {
        self.at_once(user, password, 1).await[0]
    }

    /// An attempt that stays in the handler until [`release`](Self::release): a slow login.
    async fn hold(&self, user: &str, password: &'static str) -> tokio::task::JoinHandle<Answer> {
        self.open.send_replace(false);
        let before = self.gate.inside.load(Ordering::SeqCst);
        let held = tokio::spawn(send(self.app.clone(), user.to_owned(), password));
        while self.gate.inside.load(Ordering::SeqCst) == before {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        held
    }

    async fn release(&self, held: tokio::task::JoinHandle<Answer>) -> Answer {
        self.open.send_replace(true);
        let answer = held.await.unwrap();
        assert_eq!(self.layer.settled(Duration::from_secs(5)).await, 0);
        answer
    }

    /// An attempt that does not wait in the handler, once its settles have landed.
    async fn quick(&self, user: &str, password: &'static str) -> Answer {
        let answer = send_as(self.app.clone(), user.to_owned(), password, false).await;
        assert_eq!(self.layer.settled(Duration::from_secs(5)).await, 0);
        answer
    }
}

fn count(answers: &[Answer], answer: Answer) -> usize {
    answers.iter().filter(|&&a| a == answer).count()
}

/// 11 right passwords at once at `10/1h` + a 15-minute box, and 2 at `1/1h`: the attempts
/// past the count are refused busy (`Retry-After: 1`), and the next right password is let in.
async fn right_passwords_at_once<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let what = format!("{algorithm:?}");
        for (limit, n) in [("10/1h", 11), ("1/1h", 2)] {
            let form = form(store.clone(), Rule::new(policy(limit, algorithm)));
            let user = format!("ann-{what}-{limit}");
            let answers = form.at_once(&user, "right", n).await;
            assert_eq!(
                count(&answers, (200, None)),
                n - 1,
                "{what} {limit}: {answers:?}"
            );
            assert_eq!(
                count(&answers, (429, Some(1))),
                1,
                "{what} {limit}: {answers:?}"
            );
            assert_eq!(
                form.one(&user, "right").await,
                (200, None),
                "{what} {limit}: no failure was counted, so the user is not boxed"
            );
        }
    }
}

/// Failures still count and box: 11 wrong passwords at once at `10/1h` let 10 guesses in
/// (the attempts in flight hold the count), the eleventh is refused busy; once the ten have
/// failed, the next attempt starts the 15-minute box.
async fn guesses_at_once<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let what = format!("{algorithm:?}");
        let form = form(store.clone(), Rule::new(policy("10/1h", algorithm)));
        let user = format!("eve-{what}");
        let answers = form.at_once(&user, "guess", 11).await;
        assert_eq!(count(&answers, (401, None)), 10, "{what}: {answers:?}");
        assert_eq!(count(&answers, (429, Some(1))), 1, "{what}: {answers:?}");
        // Boxed: refused for the box's 15 minutes at least (the window's hour on the log and
        // the counters, whose failures stay that long).
        for _ in 0..2 {
            let (status, retry) = form.one(&user, "right").await;
            assert_eq!(status, 429, "{what}");
            assert!(retry >= Some(900), "{what}: {retry:?}");
        }
    }
}

/// A soft login limit (`3/1m`, a captcha past it): 4 right passwords at once reach the handler,
/// none marked over, one marked busy; 4 failures, one by one, mark the fourth over.
async fn no_captcha_for_attempts_at_once<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let what = format!("{algorithm:?}");
        let soft = Policy::new(
            format!("captcha-{what}").to_lowercase(),
            ["3/1m".parse().unwrap()],
        )
        .unwrap()
        .with_algorithm(algorithm);
        let form = form(store.clone(), Rule::new(soft).soft());
        let answers = form.at_once(&format!("ann-{what}"), "right", 4).await;
        assert_eq!(count(&answers, (200, None)), 4, "{what}: {answers:?}");
        let (over, busy) = (&form.gate.over, &form.gate.busy);
        assert_eq!(over.load(Ordering::SeqCst), 0, "{what}: no captcha");
        assert_eq!(busy.load(Ordering::SeqCst), 1, "{what}");
        for _ in 0..4 {
            form.one(&format!("eve-{what}"), "guess").await;
        }
        assert_eq!(
            over.load(Ordering::SeqCst),
            1,
            "{what}: the fourth failure, over"
        );
    }
}

/// A slow attempt hides no failure: under a soft `3/1h` (no box), 2 failures, then one slow
/// attempt in flight: the next guess is busy (the 2 failures leave room), and it fails; from
/// then on the failures fill the count, and every guess is marked over, the slow attempt in
/// flight or not.
async fn a_slow_attempt_hides_no_failure<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let what = format!("{algorithm:?}");
        let soft = Policy::new(
            format!("slow-{what}").to_lowercase(),
            ["3/1h".parse().unwrap()],
        )
        .unwrap()
        .with_algorithm(algorithm);
        let form = form(store.clone(), Rule::new(soft).soft());
        let user = format!("eve-{what}");
        for _ in 0..2 {
            assert_eq!(form.quick(&user, "guess").await, (401, None), "{what}");
        }
        let held = form.hold(&user, "right").await;
        for _ in 0..5 {
            assert_eq!(form.quick(&user, "guess").await, (401, None), "{what}");
        }
        let (over, busy) = (&form.gate.over, &form.gate.busy);
        assert_eq!(
            busy.load(Ordering::SeqCst),
            1,
            "{what}: the first guess alone is busy"
        );
        assert_eq!(
            over.load(Ordering::SeqCst),
            4,
            "{what}: the failures fill the count"
        );
        assert_eq!(form.release(held).await, (200, None), "{what}");
    }
}

#[tokio::test]
async fn a_slow_attempt_hides_no_failure_on_memory() {
    a_slow_attempt_hides_no_failure(MemoryStore::new()).await;
}

/// Attempts in flight pin their key: a flood of other keys does not let more guesses than the
/// count in at once (`max_keys`).
#[tokio::test]
async fn attempts_in_flight_outlive_a_flood_on_memory() {
    let store = MemoryStore::builder().max_keys(16).build();
    let form = form(store, Rule::new(policy("3/1h", Algorithm::SlidingLog)));
    let answers = form.at_once("eve", "guess", 4).await;
    assert_eq!(count(&answers, (401, None)), 3, "{answers:?}");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(form.hold("mallory", "guess").await);
    }
    for n in 0..64 {
        form.quick(&format!("flood-{n}"), "right").await;
    }
    assert_eq!(
        form.quick("mallory", "guess").await,
        (429, Some(1)),
        "3 guesses in flight"
    );
    form.open.send_replace(true);
    for held in held {
        assert_eq!(held.await.unwrap(), (401, None));
    }
}

/// Successes held together give their units back whole: 10 right passwords at once at
/// `10/20s` (+ a 15-minute box), held 2.5 s, then a typo, then the right password: let in. On
/// GCRA a refund frees what has not drained since the attempt's units started draining,
/// after those ahead of them in the bucket; from the admission, the burst would leave about
/// 9 units behind, and the typo would fill the bucket and start the box.
async fn successes_held_together_leave_nothing<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let what = format!("{algorithm:?}");
        let form = form(store.clone(), Rule::new(policy("10/20s", algorithm)));
        let user = format!("ann-{what}");
        let mut held = Vec::new();
        for _ in 0..10 {
            held.push(form.hold(&user, "right").await);
        }
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        form.open.send_replace(true);
        for held in held {
            assert_eq!(held.await.unwrap(), (200, None), "{what}");
        }
        assert_eq!(form.layer.settled(Duration::from_secs(5)).await, 0);
        assert_eq!(form.quick(&user, "typo").await, (401, None), "{what}");
        assert_eq!(
            form.quick(&user, "right").await,
            (200, None),
            "{what}: one failure"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn successes_held_together_leave_nothing_on_memory() {
    successes_held_together_leave_nothing(MemoryStore::new()).await;
}

#[tokio::test]
async fn right_passwords_at_once_never_box_a_user_on_memory() {
    right_passwords_at_once(MemoryStore::new()).await;
}

#[tokio::test]
async fn guesses_at_once_stay_within_the_count_and_box_on_memory() {
    guesses_at_once(MemoryStore::new()).await;
}

#[tokio::test]
async fn attempts_at_once_ask_for_no_captcha_on_memory() {
    no_captcha_for_attempts_at_once(MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
mod redis {
    use crate::support::RedisServer;

    #[tokio::test]
    async fn right_passwords_at_once_never_box_a_user_on_redis() {
        let server = RedisServer::start();
        super::right_passwords_at_once(server.store().await).await;
    }

    #[tokio::test]
    async fn guesses_at_once_stay_within_the_count_and_box_on_redis() {
        let server = RedisServer::start();
        super::guesses_at_once(server.store().await).await;
    }

    #[tokio::test]
    async fn a_slow_attempt_hides_no_failure_on_redis() {
        let server = RedisServer::start();
        super::a_slow_attempt_hides_no_failure(server.store().await).await;
    }

    #[tokio::test]
    async fn successes_held_together_leave_nothing_on_redis() {
        let server = RedisServer::start();
        super::successes_held_together_leave_nothing(server.store().await).await;
    }

    #[tokio::test]
    async fn attempts_at_once_ask_for_no_captcha_on_redis() {
        let server = RedisServer::start();
        super::no_captcha_for_attempts_at_once(server.store().await).await;
    }
}
