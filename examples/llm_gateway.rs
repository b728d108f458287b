//! An LLM gateway's three limits per user, as model APIs state them: 60 requests a minute,
//! 10 000 tokens a minute, and 2 streams in flight. The client posts JSON,
//! `{"user": "ann", "max_tokens": 3000, ...}`; one body stage reads the user (the key) and
//! `max_tokens` (the cost, kept as the number it is) for both layers:
//!
//! - `requests`: `60/1m` and a concurrency limit of 2. A request takes a slot when it is
//!   admitted and gives it back when its stream ends or the client goes away. A third stream
//!   waits up to 200 ms for a slot (`max_wait`), then is refused with `429`,
//!   `RateLimit: "requests-concurrency";r=0;t=1`.
//! - `tokens`: `10000/1m`. A request reserves its `max_tokens` when it is admitted (the
//!   handler sees its allowance in `Decisions`); its answer is metered as it streams, 500
//!   tokens a store decision once the reservation is used up, and the key is charged the
//!   tokens it streamed, the rest refunded. A stream that outruns the quota is cut within a
//!   step, ending with an `error` event.
//!
//! ```text
//! cargo run --example llm_gateway                                   # embedded store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_gateway  # a fleet through Redis
//! cargo run --example llm_gateway -- --self-check                   # serve, call itself, exit
//! curl -N -H 'content-type: application/json' -d '{"user":"ann","max_tokens":500}' \
//!     http://127.0.0.1:3000/v1/chat
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `REDIS_URL` (absent: the embedded store).

use std::convert::Infallible;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_redis_ratelimit::key::body::{BodyFieldLayer, BodyFields};
use tower_redis_ratelimit::usage::{Cut, UsageMeter, UsageReport};
use tower_redis_ratelimit::{
    Decisions, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Store,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The most tokens one request may ask for, and what it reserves when it does not say.
const MAX_TOKENS: u64 = 4000;
const DEFAULT_TOKENS: u64 = 100;
/// The model's answers are 2500 tokens at most: a request asking for more uses less.
const ANSWER_TOKENS: u64 = 2500;
/// Tokens per server-sent event, and the pause before each, so that the answer streams.
const TOKENS_PER_EVENT: u64 = 50;
const EVENT_DELAY: Duration = Duration::from_millis(10);
/// How long a request refused for a stream slot waits for one before the 429.
const MAX_WAIT: Duration = Duration::from_millis(200);
/// The event a stream cut at the quota ends with.
const CUT: &[u8] = b"event: error\ndata: {\"error\":\"token quota exceeded\"}\n\n";

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

/// The tokens a request asks for: its body's `max_tokens`, or the default.
fn max_tokens(fields: Option<&BodyFields>) -> u64 {
    let asked = fields.and_then(|fields| fields.number("max_tokens"));
    asked.unwrap_or(DEFAULT_TOKENS)
}

fn app<St: Store>(store: St) -> Result<Router, Error> {
    // The user is the key of both layers; `max_tokens` is read in the same pass.
    let read = BodyFieldLayer::builder("user")
        .number("max_tokens")
        .build()?;
    let requests = RateLimitLayer::builder()
        .key(read.key())
        .policy(requests()?)
        // A stream that ends within 200 ms leaves its slot to a request waiting for one.
        .max_wait(MAX_WAIT)
        .store(store.clone())
        .build()?;
    let tokens = RateLimitLayer::builder()
        .key(read.key())
        .policy(tokens()?)
        // Reserve what the request asks for (the handler refuses more than 4000) ...
        .cost(|head| max_tokens(BodyFields::of(head)).min(MAX_TOKENS) as u32)
        // ... then meter the answer as it streams, 500 tokens a decision past the
        // reservation, cut with an `error` event at the quota; charged what it streamed.
        .usage(
            UsageReport::new()
                .step(500)
                .on_cut(Cut::Final(Bytes::from_static(CUT))),
        )
        .store(store)
        .build()?;
    // Requests (and their slots) outside, tokens inside: a request refused for its tokens
    // gives its slot back at once, and a refused stream costs no tokens.
    Ok(Router::new()
        .route("/v1/chat", post(chat))
        .layer(tokens)
        .layer(requests)
        .layer(read))
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
        "http://{addr}/v1/chat: per user 60 requests/min, 10000 tokens/min, 2 streams in \
         flight; store: {store_name}"
    );
    if !self_check {
        axum::serve(listener, app(store)?).await?;
        return Ok(());
    }
    // A Redis store keeps what earlier runs used: start from full budgets.
    for user in ["ann", "bob"] {
        store.reset(&Key::from(user), &requests()?).await?;
        store.reset(&Key::from(user), &tokens()?).await?;
    }
    let server = axum::serve(listener, app(store)?);
    tokio::spawn(async move { server.await });
    check(&format!("http://{addr}")).await
}

/// `POST /v1/chat`: the answer (up to `max_tokens`, at most 2500) in events of 50 tokens,
/// after a `quota` event with the request's allowance, then the usage.
async fn chat(
    Extension(meter): Extension<UsageMeter>,
    Extension(decisions): Extension<Decisions>,
    fields: Option<Extension<BodyFields>>,
) -> Response {
    let asked = max_tokens(fields.as_ref().map(|Extension(fields)| fields));
    if !(1..=MAX_TOKENS).contains(&asked) {
        // Nothing was generated: the reservation is refunded.
        meter.set(0);
        let message = format!("max_tokens must be a number from 1 to {MAX_TOKENS}\n");
        return (StatusCode::BAD_REQUEST, message).into_response();
    }
    // What this request may use (its reservation and what remains), and the requests left.
    let quota = format!(
        "{{\"requests_left\":{},\"token_allowance\":{}}}",
        decisions.get("requests").map_or(0, |d| d.remaining()),
        decisions.allowance("tokens").unwrap_or(0)
    );
    let first =
        futures::stream::once(async move { Ok(Event::default().event("quota").data(quota)) });
    Sse::new(first.chain(stream(meter, asked.min(ANSWER_TOKENS)))).into_response()
}

/// One event per 50 tokens, metered before it is sent, then a `usage` event.
fn stream(meter: UsageMeter, tokens: u64) -> impl Stream<Item = Result<Event, Infallible>> {
    let total = meter.clone();
    let events = tokens.div_ceil(TOKENS_PER_EVENT);
    futures::stream::iter(0..events)
        .then(move |i| {
            let meter = meter.clone();
            async move {
                tokio::time::sleep(EVENT_DELAY).await;
                let n = TOKENS_PER_EVENT.min(tokens - i * TOKENS_PER_EVENT);
                meter.add(n);
                Ok(Event::default().data(format!("{n} tokens")))
            }
        })
        .chain(futures::stream::once(async move {
            let used = total.get().unwrap_or(0);
            let usage = format!("{{\"total_tokens\":{used}}}");
            Ok(Event::default().event("usage").data(usage))
        }))
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Shows each limit refusing in turn: two streams of `ann` run (500 ms each) and a third,
/// after waiting 200 ms, is refused for a slot; `bob` is served meanwhile; once they end, a
/// third gets in; each reserved 3000 tokens and was charged the 2500 it streamed, so 7500 are
/// used and 4000 more are refused. Fails if any of that does not happen.
async fn check(base: &str) -> Result<(), Error> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let url = format!("{base}/v1/chat");
    // Two long streams, held open while the third asks.
    let mut open = Vec::new();
    for _ in 0..2 {
        let response = send(&client, &url, "ann", 3000).await?;
        expect(&response, StatusCode::OK, "ann, stream")?;
        open.push(response);
    }
    let third = send(&client, &url, "ann", 100).await?;
    expect(&third, StatusCode::TOO_MANY_REQUESTS, "ann, a third stream")?;
    let ratelimit = field(&third, "ratelimit");
    if !ratelimit.contains("\"requests-concurrency\";r=0") {
        return Err(format!("the third stream's refusal says {ratelimit}").into());
    }
    let other = send(&client, &url, "bob", 100).await?;
    expect(&other, StatusCode::OK, "bob, meanwhile")?;
    read(other, "bob").await?;
    for response in open {
        read(response, "ann").await?;
    }
    // The streams have ended: their slots are free, and 5000 tokens are used.
    let next = send(&client, &url, "ann", 3000).await?;
    expect(&next, StatusCode::OK, "ann, after the streams ended")?;
    read(next, "ann").await?;
    // 7500 used: no room for 4000 more, whatever the slots say.
    let over = send(&client, &url, "ann", 4000).await?;
    expect(
        &over,
        StatusCode::TOO_MANY_REQUESTS,
        "ann, 4000 more tokens",
    )?;
    if !field(&over, "ratelimit").contains("\"tokens\";r=") {
        return Err("the tokens refusal does not name the tokens limit".into());
    }
    Ok(())
}

/// Posts a chat request of `user` asking for `max_tokens`; prints its status and fields.
async fn send(
    client: &HttpClient,
    url: &str,
    user: &str,
    max_tokens: u64,
) -> Result<http::Response<hyper::body::Incoming>, Error> {
    let body = format!("{{\"user\":\"{user}\",\"max_tokens\":{max_tokens}}}");
    let request = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = client.request(request).await?;
    println!(
        "{user}: {} max_tokens={max_tokens}, retry-after: {}, ratelimit: {}",
        response.status(),
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
async fn read(response: http::Response<hyper::body::Incoming>, user: &str) -> Result<(), Error> {
    let body = response.into_body().collect().await?.to_bytes();
    let text = String::from_utf8(body.to_vec())?;
    let data = |event: &str| {
        text.split("\n\n")
            .find_map(|e| e.strip_prefix(&format!("event: {event}\ndata: ")))
            .unwrap_or("-")
            .to_string()
    };
    println!(
        "{user}: stream ended: quota {}, usage {}",
        data("quota"),
        data("usage")
    );
    Ok(())
}
