//! An LLM gateway's three limits per API key (`x-api-key`), as model APIs state them: 60
//! requests a minute, 10 000 tokens a minute, and 2 streams in flight. Two stacked layers:
//!
//! - `requests`: `60/1m` and a concurrency limit of 2. A request takes a slot when it is
//!   admitted, in the same store call as its count, and gives it back when its stream ends or
//!   the client goes away; the slots of an instance that dies come back within 10 s. A third
//!   stream waits up to 200 ms for a slot (`max_wait`), then is refused with `429`,
//!   `RateLimit: "requests-concurrency";r=0;t=1` and a `Retry-After` of the median time a
//!   stream runs (at least 1 s), not a rate window.
//! - `tokens`: `10000/1m`, usage settled when the stream ends: a request reserves the tokens
//!   it asks for (`max_tokens`), and is charged what it streamed.
//!
//! Both layers' fields stack on the response (`RateLimit: "tokens";r=...;t=..,
//! "requests";r=...;t=...`), and the handler reads both decisions from `Decisions`.
//!
//! ```text
//! cargo run --example llm_gateway                                   # embedded store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_gateway  # a fleet through Redis
//! cargo run --example llm_gateway -- --self-check                   # serve, call itself, exit
//! curl -N -H 'x-api-key: key-a' 'http://127.0.0.1:3000/v1/chat?max_tokens=500'
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `REDIS_URL` (absent: the embedded store).

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
use tower_redis_ratelimit::usage::{UsageMeter, UsageReport};
use tower_redis_ratelimit::{
    Decisions, Header, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Store,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The most tokens one request may ask for.
const MAX_TOKENS: u32 = 4000;
/// Tokens per server-sent event, and the pause before each, so that the answer streams.
const TOKENS_PER_EVENT: u32 = 50;
const EVENT_DELAY: Duration = Duration::from_millis(10);
/// How long a request refused for a stream slot waits for one before the 429.
const MAX_WAIT: Duration = Duration::from_millis(200);

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

/// 60 requests a minute, 2 in flight.
fn requests() -> Result<Policy, Error> {
    Ok(Policy::new("requests", ["60/1m".parse()?])?.concurrency(2)?)
}

/// 10 000 tokens a minute.
fn tokens() -> Result<Policy, Error> {
    Ok(Policy::new("tokens", ["10000/1m".parse()?])?)
}

/// The tokens a request asks for, `max_tokens` in its query (default 100).
fn max_tokens(query: Option<&str>) -> Option<u32> {
    let Some(query) = query else { return Some(100) };
    let value = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("max_tokens="));
    match value {
        None => Some(100),
        Some(n) => n.parse().ok().filter(|n| (1..=MAX_TOKENS).contains(n)),
    }
}

fn app<St: Store>(store: St) -> Result<Router, Error> {
    let api_key = || Header::new(HeaderName::from_static("x-api-key"));
    let requests = RateLimitLayer::builder()
        .key(api_key())
        .policy(requests()?)
        // A stream that ends within 200 ms leaves its slot to a request waiting for one.
        .max_wait(MAX_WAIT)
        .store(store.clone())
        .build()?;
    let tokens = RateLimitLayer::builder()
        .key(api_key())
        .policy(tokens()?)
        // Reserve what the request asks for; charge what it streamed when the stream ends.
        .usage(UsageReport::new())
        .cost(|head| max_tokens(head.uri.query()).unwrap_or(1))
        .store(store)
        .build()?;
    // Requests (and their slots) outside, tokens inside: a request refused for its tokens
    // gives its slot back at once, and a refused stream costs no tokens.
    Ok(Router::new()
        .route("/v1/chat", get(chat))
        .layer(tokens)
        .layer(requests))
}

async fn run<St: Store>(store: St, store_name: &str, self_check: bool) -> Result<(), Error> {
    let bind = if self_check {
        "127.0.0.1:0".to_string()
    } else {
        std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into())
    };
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    println!(
        "http://{addr}/v1/chat: per API key 60 requests/min, 10000 tokens/min, 2 streams in \
         flight; store: {store_name}"
    );
    if !self_check {
        axum::serve(listener, app(store)?).await?;
        return Ok(());
    }
    // A Redis store keeps what earlier runs used: start from full budgets.
    for key in ["key-a", "key-b"] {
        store.reset(&Key::from(key), &requests()?).await?;
        store.reset(&Key::from(key), &tokens()?).await?;
    }
    let server = axum::serve(listener, app(store)?);
    tokio::spawn(async move { server.await });
    check(&format!("http://{addr}")).await
}

/// `GET /v1/chat?max_tokens=N`: `N` tokens in events of 50, then the usage.
async fn chat(
    Extension(meter): Extension<UsageMeter>,
    Extension(decisions): Extension<Decisions>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    let query = params.get("max_tokens").map(|n| format!("max_tokens={n}"));
    let Some(tokens) = max_tokens(query.as_deref()) else {
        // Nothing was generated: the reservation is refunded.
        meter.set(0);
        let message = format!("max_tokens must be a number from 1 to {MAX_TOKENS}\n");
        return (StatusCode::BAD_REQUEST, message).into_response();
    };
    // What the layers decided, for the client: requests and tokens left this minute.
    let left = |policy| decisions.get(policy).map_or(0, |d| d.remaining());
    let quota = format!(
        "{{\"requests_left\":{},\"tokens_left\":{}}}",
        left("requests"),
        left("tokens")
    );
    let first =
        futures::stream::once(async move { Ok(Event::default().event("quota").data(quota)) });
    Sse::new(first.chain(stream(meter, tokens))).into_response()
}

/// One event per 50 tokens, metered as they are produced, then a `usage` event.
fn stream(meter: UsageMeter, tokens: u32) -> impl Stream<Item = Result<Event, Infallible>> {
    let total = meter.clone();
    let events = tokens.div_ceil(TOKENS_PER_EVENT);
    futures::stream::iter(0..events)
        .then(move |i| {
            let meter = meter.clone();
            async move {
                tokio::time::sleep(EVENT_DELAY).await;
                let n = TOKENS_PER_EVENT.min(tokens - i * TOKENS_PER_EVENT);
                meter.add(u64::from(n));
                Ok(Event::default().data(format!("{n} tokens")))
            }
        })
        .chain(futures::stream::once(async move {
            let used = total.get().unwrap_or(0);
            let usage = format!("{{\"total_tokens\":{used}}}");
            Ok(Event::default().event("usage").data(usage))
        }))
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// Shows each limit refusing in turn: two streams of `key-a` run (600 ms each) and a third,
/// after waiting 200 ms, is refused for a slot; once they end, a third gets in; the tokens they used leave no room for 4000 more;
/// `key-b` is served meanwhile. Fails if any of that does not happen.
async fn check(base: &str) -> Result<(), Error> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let url = |tokens: u32| format!("{base}/v1/chat?max_tokens={tokens}");
    // Two long streams, held open while the third asks.
    let mut open = Vec::new();
    for _ in 0..2 {
        let response = send(&client, &url(3000), "key-a").await?;
        expect(&response, StatusCode::OK, "key-a, stream")?;
        open.push(response);
    }
    let third = send(&client, &url(100), "key-a").await?;
    expect(
        &third,
        StatusCode::TOO_MANY_REQUESTS,
        "key-a, a third stream",
    )?;
    let ratelimit = field(&third, "ratelimit");
    if !ratelimit.contains("\"requests-concurrency\";r=0") {
        return Err(format!("the third stream's refusal says {ratelimit}").into());
    }
    let other = send(&client, &url(100), "key-b").await?;
    expect(&other, StatusCode::OK, "key-b, meanwhile")?;
    read(other, "key-b").await?;
    for response in open {
        read(response, "key-a").await?;
    }
    // The streams have ended: their slots are free, and 6000 tokens are used.
    let next = send(&client, &url(3000), "key-a").await?;
    expect(&next, StatusCode::OK, "key-a, after the streams ended")?;
    read(next, "key-a").await?;
    // 9000 used: no room for 4000 more, whatever the slots say.
    let over = send(&client, &url(4000), "key-a").await?;
    expect(
        &over,
        StatusCode::TOO_MANY_REQUESTS,
        "key-a, 4000 more tokens",
    )?;
    if !field(&over, "ratelimit").contains("\"tokens\";r=") {
        return Err("the tokens refusal does not name the tokens limit".into());
    }
    Ok(())
}

/// Sends one request as `key`; prints its status and fields.
async fn send(
    client: &HttpClient,
    url: &str,
    key: &str,
) -> Result<http::Response<hyper::body::Incoming>, Error> {
    let request = Request::get(url)
        .header("x-api-key", key)
        .body(Empty::new())?;
    let response = client.request(request).await?;
    println!(
        "{key}: {} {}, retry-after: {}, ratelimit: {}",
        response.status(),
        url.rsplit('?').next().unwrap_or_default(),
        field(&response, "retry-after"),
        field(&response, "ratelimit"),
    );
    Ok(response)
}

fn field<B>(response: &http::Response<B>, name: &str) -> String {
    let value = response.headers().get(name).and_then(|v| v.to_str().ok());
    value.unwrap_or("-").to_string()
}

fn expect<B>(response: &http::Response<B>, status: StatusCode, what: &str) -> Result<(), Error> {
    match response.status() == status {
        true => Ok(()),
        false => Err(format!("{what}: {} instead of {status}", response.status()).into()),
    }
}

/// Reads a stream to its end; prints the quota it started with and the usage it ended with.
async fn read(response: http::Response<hyper::body::Incoming>, key: &str) -> Result<(), Error> {
    let body = response.into_body().collect().await?.to_bytes();
    let text = String::from_utf8(body.to_vec())?;
    let data = |event: &str| {
        text.split("\n\n")
            .find_map(|e| e.strip_prefix(&format!("event: {event}\ndata: ")))
            .unwrap_or("-")
            .to_string()
    };
    println!(
        "{key}: stream ended: quota {}, usage {}",
        data("quota"),
        data("usage")
    );
    Ok(())
}
