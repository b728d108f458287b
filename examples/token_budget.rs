//! An LLM-style completion endpoint limited by the tokens it streams: 2 000 tokens per minute
//! per API key (`x-api-key`), counted with the sliding log. Each request reserves one token,
//! streams its answer as server-sent events (one word per token, one every 2 ms), meters each
//! token, and ends with a `usage` event. The layer meters the stream as it goes, 200 tokens a store decision: once the
//! key's tokens are spent, the stream is cut within 200 tokens, ending with an `error` event;
//! the key is charged the tokens streamed, when the stream ends or the client disconnects.
//!
//! ```text
//! cargo run --example token_budget                                   # embedded store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example token_budget  # shared through Redis
//! cargo run --example token_budget -- --self-check                   # serve, call itself, exit
//! curl -N -H 'x-api-key: key-a' 'http://127.0.0.1:3000/v1/complete?tokens=800'
//! python3 examples/token_budget_client.py                            # the same, with httpx
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `REDIS_URL` (absent: the embedded store).
//! `--self-check` serves on a free port, asks for 800 tokens at a time with one API key until
//! a stream is cut, then once with another key, and prints what it got.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{HeaderName, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_redis_ratelimit::usage::{Cut, UsageMeter, UsageReport};
use tower_redis_ratelimit::{Header, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The most tokens one request may ask for.
const MAX_TOKENS: u64 = 4000;
/// The pause before each token, so that the answer streams as a model's would.
const TOKEN_DELAY: Duration = Duration::from_millis(2);
/// The event a stream cut at the quota ends with.
const CUT: &[u8] = b"event: error\ndata: {\"error\":\"token quota exceeded\"}\n\n";
const TEXT: &str = "the limit counts the tokens a request streams and charges them to its \
                    API key when the answer ends or the client goes away";

#[tokio::main]
async fn main() -> Result<(), Error> {
    let self_check = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--self-check") => true,
        Some(other) => {
            return Err(format!("unknown argument {other:?}; use none or --self-check").into())
        }
    };
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::connect(&url).await?;
            run(store, &format!("redis at {url}"), self_check).await
        }
        Err(_) => run(MemoryStore::new(), "memory (this process only)", self_check).await,
    }
}

/// 2 000 tokens per minute; named so that the `RateLimit` fields say what is counted.
fn policy() -> Result<Policy, Error> {
    Ok(Policy::new("tokens", ["2000/1m".parse()?])?)
}

fn app<St: Store>(store: St) -> Result<Router, Error> {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(policy()?)
        // Room for one token before the call, then 200 tokens a decision as the stream goes;
        // cut with an `error` event once the key's tokens are spent.
        .usage(
            UsageReport::new()
                .step(200)
                .on_cut(Cut::Final(Bytes::from_static(CUT))),
        )
        .store(store)
        .build()?;
    Ok(Router::new()
        .route("/v1/complete", get(complete))
        .layer(layer))
}

async fn run<St: Store>(store: St, store_name: &str, self_check: bool) -> Result<(), Error> {
    let bind = if self_check {
        "127.0.0.1:0".to_string()
    } else {
        std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into())
    };
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    println!("http://{addr}/v1/complete: 2000 tokens per minute per API key, store: {store_name}");
    if !self_check {
        axum::serve(listener, app(store)?).await?;
        return Ok(());
    }
    // A Redis store keeps what earlier runs used: start from full budgets.
    for key in ["key-a", "key-b"] {
        store.reset(&Key::from(key), &policy()?).await?;
    }
    let server = axum::serve(listener, app(store)?);
    tokio::spawn(async move { server.await });
    check(&format!("http://{addr}")).await
}

/// `GET /v1/complete?tokens=N`: `N` tokens (default 100), then the usage.
async fn complete(
    Extension(meter): Extension<UsageMeter>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    let tokens = match params.get("tokens").map(|n| n.parse::<u64>()) {
        None => 100,
        Some(Ok(n)) if (1..=MAX_TOKENS).contains(&n) => n,
        Some(_) => {
            // Nothing was generated: the reservation is refunded.
            meter.set(0);
            let message = format!("tokens must be a number from 1 to {MAX_TOKENS}\n");
            return (StatusCode::BAD_REQUEST, message).into_response();
        }
    };
    Sse::new(stream(meter, tokens)).into_response()
}

/// One `data` event per token, metered as it is produced, then a `usage` event.
fn stream(meter: UsageMeter, tokens: u64) -> impl Stream<Item = Result<Event, Infallible>> {
    let total = meter.clone();
    let words = TEXT.split(' ').cycle().take(tokens as usize);
    futures::stream::iter(words)
        .then(move |word| {
            let meter = meter.clone();
            async move {
                tokio::time::sleep(TOKEN_DELAY).await;
                meter.add(1);
                Ok(Event::default().data(word))
            }
        })
        .chain(futures::stream::once(async move {
            let used = total.get().unwrap_or(0);
            let usage = format!("{{\"total_tokens\":{used}}}");
            Ok(Event::default().event("usage").data(usage))
        }))
}

/// How a request ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Refused before its stream started.
    Refused,
    /// Streamed whole: this many tokens.
    Streamed(u64),
    /// Cut at the quota after this many tokens.
    Cut(u64),
}

/// Asks for 800 tokens with `key-a` until a stream is cut, then with `key-b`; fails unless
/// `key-a`'s third stream is cut within a step (200 tokens) of the quota's 2000 and `key-b`
/// then streams its 800.
async fn check(base: &str) -> Result<(), Error> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let url = format!("{base}/v1/complete?tokens=800");
    let mut streamed = 0;
    for _ in 0..5 {
        match complete_as(&client, &url, "key-a").await? {
            Outcome::Streamed(tokens) => streamed += tokens,
            Outcome::Cut(tokens) if streamed + tokens + 200 > 2000 => {
                let key_b = complete_as(&client, &url, "key-b").await?;
                return match key_b {
                    Outcome::Streamed(800) => Ok(()),
                    other => Err(format!("key-b got {other:?}").into()),
                };
            }
            other => return Err(format!("key-a got {other:?} after {streamed} tokens").into()),
        }
    }
    Err("key-a was never cut".into())
}

/// One request, streamed to its end; prints its status, the tokens received and the limit's
/// fields.
async fn complete_as(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
    key: &str,
) -> Result<Outcome, Error> {
    let request = Request::get(url)
        .header("x-api-key", key)
        .body(Empty::new())?;
    let response = client.request(request).await?;
    let status = response.status();
    let field = |name: &str| {
        let value = response.headers().get(name).and_then(|v| v.to_str().ok());
        value.unwrap_or("-").to_string()
    };
    let (retry_after, ratelimit) = (field("retry-after"), field("ratelimit"));
    let body = response.into_body().collect().await?.to_bytes();
    if status != StatusCode::OK {
        println!("{key}: {status}, retry-after: {retry_after}, ratelimit: {ratelimit}");
        return Ok(Outcome::Refused);
    }
    let text = String::from_utf8(body.to_vec())?;
    let (mut tokens, mut usage, mut cut) = (0, "-", false);
    for event in text.split("\n\n").filter(|event| !event.is_empty()) {
        if let Some(data) = event.strip_prefix("event: usage\ndata: ") {
            usage = data;
        } else if event.starts_with("event: error") {
            cut = true;
        } else {
            tokens += 1;
        }
    }
    let end = if cut { "cut at the quota" } else { "ended" };
    println!(
        "{key}: {status}, {tokens} tokens streamed, {end}, usage {usage}, ratelimit: {ratelimit}"
    );
    Ok(if cut {
        Outcome::Cut(tokens)
    } else {
        Outcome::Streamed(tokens)
    })
}
