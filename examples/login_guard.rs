//! A login form guarded per user name, the classic recipe: after 3 failed logins in a minute
//! the form asks for a captcha, after 10 in an hour the user is locked out for at least 15
//! minutes and until the hour's limit lets her in again, and a successful login never counts.
//!
//! ```text
//! cargo run --example login_guard
//! ```
//!
//! It starts its own `redis-server` on a free loopback port (`$REDIS_SERVER` or `redis-server`
//! from `PATH`), serves the form on another, and plays a client against it, printing each
//! answer. Two layers count the same failures, by outcome (`count_when`: a `401`):
//! - `login-captcha`, `3/1m`, soft: from the fourth failure on, the handler finds the request
//!   marked over in its `Decisions` and asks for the captcha instead of checking the password
//!   (`403`, which is not a failure and does not count);
//! - `login-block`, `10/1h` with a penalty box of 15 minutes: the tenth failure fills it, and
//!   every request of that user is refused for at least 15 minutes, the right password
//!   included; here the ten failures came within a minute, so the hour's limit is what frees
//!   her (`429`, `Retry-After: 3600`; ten failures spread over the hour would get 900).
//!
//! The user name comes from the form's body (`username=ann`): a `BodyFieldLayer` outside both
//! layers reads that field (at most 4 KiB of body) and hands the body on intact, and both
//! layers key on it with its `BodyKey`. It is normalised, so the client's even attempts, sent
//! as ` ANN `, spend Ann's budget too. The password and the captcha travel in headers, to keep
//! the handler short.

#[allow(dead_code)]
#[path = "support/redis.rs"]
mod scratch;

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use tower_redis_ratelimit::{BodyFieldLayer, Decisions, Policy, RateLimitLayer, RedisStore, Rule};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The form: `x-password: hunter2` is right; `x-captcha: solved` stands for a solved captcha.
async fn login(decisions: Extension<Decisions>, headers: HeaderMap) -> (StatusCode, &'static str) {
    let field = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if decisions.is_over() && field("x-captcha") != Some("solved") {
        return (StatusCode::FORBIDDEN, "solve the captcha first");
    }
    match field("x-password") {
        Some("hunter2") => (StatusCode::OK, "welcome"),
        _ => (StatusCode::UNAUTHORIZED, "wrong user name or password"),
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let redis = scratch::Scratch::start(0)?;
    let store = RedisStore::connect(&redis.url()).await?;
    let username = BodyFieldLayer::builder("username")
        .limit(4 * 1024)
        .build()?;
    let user = || username.key();
    let failed = |response: &tower_redis_ratelimit::ResponseHead<'_>| {
        response.status == StatusCode::UNAUTHORIZED
    };
    let captcha = RateLimitLayer::builder()
        .key(user())
        .store(store.clone())
        .rule(Rule::new(Policy::new("login-captcha", ["3/1m".parse()?])?).soft())
        .count_when(failed)
        .build()?;
    let block = RateLimitLayer::builder()
        .key(user())
        .store(store.clone())
        .policy(
            Policy::new("login-block", ["10/1h".parse()?])?
                .block_for(Duration::from_secs(15 * 60))?,
        )
        .count_when(failed)
        .build()?;
    let app = Router::new()
        .route("/login", post(login))
        .layer(captcha.clone())
        .layer(block.clone())
        .layer(username.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!(
        "the login form on http://{addr}/login, state in Redis at {}",
        redis.url()
    );

    let client = Client::new(addr);
    // Waits for the counts a request caused, so that the next one sees them; a real client
    // is not that patient, and how far that lets concurrent attempts go is in the docs.
    let settled = || async {
        captcha.settled(Duration::from_secs(5)).await + block.settled(Duration::from_secs(5)).await
    };
    // Ann: three failures, then the captcha; seven more failures with it solved, the tenth
    // failure in all locks her out, the right password included.
    let attempts = [
        (3, "wrong", None),
        (1, "wrong", None),
        (7, "wrong", Some("solved")),
        (1, "hunter2", Some("solved")),
    ];
    let mut n = 0;
    for (times, password, captcha) in attempts {
        for _ in 0..times {
            n += 1;
            let user = if n % 2 == 0 { " ANN " } else { "ann" };
            let answer = client.login(user, password, captcha).await?;
            assert_eq!(settled().await, 0);
            let captcha = captcha.unwrap_or("-");
            println!("ann #{n:<2} password {password:<7} captcha {captcha:<6} -> {answer}");
        }
    }
    for _ in 0..3 {
        let answer = client.login("bob", "hunter2", None).await?;
        println!("bob     password hunter2 captcha -      -> {answer}");
    }
    Ok(())
}

/// Just enough of an HTTP client to post to the form and show the answer.
struct Client {
    addr: SocketAddr,
    hyper: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
}

impl Client {
    fn new(addr: SocketAddr) -> Self {
        let hyper =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        Client { addr, hyper }
    }

    /// `status body`, with the rate-limit fields that came along.
    async fn login(
        &self,
        user: &str,
        password: &str,
        captcha: Option<&str>,
    ) -> Result<String, Error> {
        use http_body_util::BodyExt;
        let mut request = http::Request::post(format!("http://{}/login", self.addr))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("x-password", password);
        if let Some(captcha) = captcha {
            request = request.header("x-captcha", captcha);
        }
        let form = form_urlencoded::Serializer::new(String::new())
            .append_pair("username", user)
            .finish();
        let response = self.hyper.request(request.body(form.into())?).await?;
        let status = response.status().as_u16();
        let fields: Vec<String> = ["retry-after", "ratelimit"]
            .into_iter()
            .filter_map(|name| {
                let value = response.headers().get(name)?.to_str().ok()?;
                Some(format!("{name}: {value}"))
            })
            .collect();
        let body = response.into_body().collect().await?.to_bytes();
        let body = String::from_utf8_lossy(&body).trim().to_owned();
        Ok(format!("{status} {body:<28} {}", fields.join("  ")))
    }
}
