//! Keys from the request body: `BodyFieldLayer` in front of the rate-limit layer, in an axum
//! app, with the memory store.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::routing::post;
use axum::{Extension, Form, Json, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;
use tower_redis_ratelimit::key::body::{BodyFieldLayer, Normalize};
use tower_redis_ratelimit::{BodyField, MemoryStore, RateLimitLayer};

const FORM: &str = "application/x-www-form-urlencoded";

/// `POST /login` behind `read` (outside) and a `policy` per user (inside), counting the calls
/// that reach the handler, which answers with the user name and password its `Form` got.
fn login_app(read: BodyFieldLayer, policy: &str, calls: Arc<AtomicUsize>) -> Router {
    let limit = RateLimitLayer::builder()
        .policy(policy)
        .key(read.key())
        .store(MemoryStore::new())
        .build()
        .unwrap();
    let login = move |Form(form): Form<HashMap<String, String>>| async move {
        calls.fetch_add(1, Ordering::SeqCst);
        let field = |name: &str| form.get(name).cloned().unwrap_or_default();
        format!("{} {}", field("username"), field("password"))
    };
    Router::new()
        .route("/login", post(login))
        .layer(limit)
        .layer(read)
}

fn form(body: &str) -> Request<Body> {
    Request::post("/login")
        .header("content-type", FORM)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn ann_and_ann_in_capitals_share_one_budget() {
    let calls = Arc::new(AtomicUsize::new(0));
    let read = BodyFieldLayer::builder("username").build().unwrap();
    let app = login_app(read, "2/1m", Arc::clone(&calls));
    let (status, body) = send(&app, form("username=ann&password=a")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ann a"));
    // The handler gets the name as sent; the budget is the folded name's.
    let (status, body) = send(&app, form("username=ANN+&password=b")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ANN  b"));
    let (status, _) = send(&app, form("username=%EF%BC%A1nn&password=c")).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "full-width Ａnn is ann"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Without normalisation, they are three users.
    let exact = BodyFieldLayer::builder("username")
        .normalize(Normalize::Exact)
        .build()
        .unwrap();
    let app = login_app(exact, "2/1m", Arc::new(AtomicUsize::new(0)));
    for body in ["username=ann", "username=ANN+", "username=%EF%BC%A1nn"] {
        assert_eq!(send(&app, form(body)).await.0, StatusCode::OK, "{body}");
    }
}

#[tokio::test]
async fn the_attempt_over_the_limit_is_refused_and_another_user_admitted() {
    let read = BodyFieldLayer::builder("username").build().unwrap();
    let app = login_app(read, "3/1m", Arc::new(AtomicUsize::new(0)));
    for attempt in 1..=3 {
        let (status, _) = send(&app, form("username=ann&password=wrong")).await;
        assert_eq!(status, StatusCode::OK, "attempt {attempt}");
    }
    let response = app
        .clone()
        .oneshot(form("username=ann&password=wrong"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().contains_key("retry-after"));
    let (status, body) = send(&app, form("username=bob&password=right")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "bob right"));
}

#[tokio::test]
async fn the_handler_gets_the_exact_bytes_sent() {
    let read = BodyFieldLayer::builder("username").build().unwrap();
    let echo = |Extension(field): Extension<BodyField>, bytes: Bytes| async move {
        let mut answer = format!("{}={}|", field.name(), field.value()).into_bytes();
        answer.extend_from_slice(&bytes);
        answer
    };
    let app = Router::new()
        .route("/login", post(echo))
        .layer(read.clone());
    let sent = &b"password=%FF%00+x&username=+%C3%89lodie%20&z=\xff"[..];
    let request = Request::post("/login")
        .header(
            "content-type",
            "application/x-www-form-urlencoded; charset=UTF-8",
        )
        .body(Body::from(sent))
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let mut expected = "username=elodie|".as_bytes().to_vec();
    expected.extend_from_slice(sent);
    assert_eq!(&body[..], &expected[..]);
}

#[tokio::test]
async fn a_json_field_is_a_key_and_json_reaches_the_handler() {
    let read = BodyFieldLayer::builder("account").build().unwrap();
    let limit = RateLimitLayer::builder()
        .policy("1/1m")
        .key(read.key())
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/charge",
            post(|Json(body): Json<serde_json::Value>| async move { body["cents"].to_string() }),
        )
        .layer(limit)
        .layer(read);
    let charge = |body: &str| {
        Request::post("/charge")
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let (status, body) = send(&app, charge(r#"{"account": "Acme", "cents": 250}"#)).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "250"));
    let (status, _) = send(&app, charge(r#"{"cents": 1, "account": " ACME"}"#)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // A number is a key too; another account has its own budget.
    let (status, _) = send(&app, charge(r#"{"account": 42, "cents": 1}"#)).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = send(&app, charge(r#"{"cents": 1}"#)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) = send(&app, charge(r#"{"account": "a""#)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test]
async fn a_missing_field_is_a_400_that_reaches_neither_limit_nor_handler() {
    let calls = Arc::new(AtomicUsize::new(0));
    let read = BodyFieldLayer::builder("username").build().unwrap();
    let app = login_app(read, "1/1m", Arc::clone(&calls));
    let answers = [
        ("password=x", "has no field \"username\""),
        ("username=+&password=x", "has no field \"username\""),
        (
            "username=a&username=b",
            "has the field \"username\" more than once",
        ),
    ];
    for (body, answer) in answers {
        let (status, text) = send(&app, form(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        assert!(text.starts_with("Bad Request: the request body"), "{text}");
        assert!(text.contains(answer), "{body}: {text}");
    }
    let text = Request::post("/login")
        .header("content-type", "text/plain")
        .body(Body::from("username=ann"))
        .unwrap();
    assert_eq!(send(&app, text).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(send(&app, form("username=ann")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn without_the_layer_the_request_has_no_key() {
    let read = BodyFieldLayer::builder("username").build().unwrap();
    let limit = RateLimitLayer::builder()
        .policy("1/1m")
        .key(read.key())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(|| async { "in" }))
        .layer(limit);
    let (status, text) = send(&app, form("username=ann")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("no body field \"username\""), "{text}");
}

/// Serves `app` on a free loopback port.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Sends `head` and then `chunks` over a new connection, without ending the body, and reads
/// the answer's status line.
async fn status_line(addr: SocketAddr, head: &str, chunks: &[Vec<u8>]) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    for chunk in chunks {
        stream.write_all(chunk).await.unwrap();
    }
    let mut answer = vec![0; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut answer))
        .await
        .expect("an answer before the body ends")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
    answer.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_413_before_it_ends() {
    let calls = Arc::new(AtomicUsize::new(0));
    let read = BodyFieldLayer::builder("username")
        .limit(2_048)
        .build()
        .unwrap();
    let addr = serve(login_app(read, "5/1m", Arc::clone(&calls))).await;

    // Declared too long: answered without the body.
    let head = format!(
        "POST /login HTTP/1.1\r\nhost: x\r\ncontent-type: {FORM}\r\ncontent-length: 2049\r\n\r\n"
    );
    assert_eq!(
        status_line(addr, &head, &[]).await,
        "HTTP/1.1 413 Payload Too Large"
    );

    // Chunked: three chunks of 1000 bytes, and the body never ends.
    let head = format!(
        "POST /login HTTP/1.1\r\nhost: x\r\ncontent-type: {FORM}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    let chunk = |fill: &str| format!("3e8\r\n{}\r\n", fill.repeat(1_000)).into_bytes();
    let over = [chunk("a"), chunk("b"), chunk("c")];
    assert_eq!(
        status_line(addr, &head, &over).await,
        "HTTP/1.1 413 Payload Too Large"
    );

    // Up to the limit, chunked, the form goes through.
    let mut at_limit = format!("username=ann&p={}", "x".repeat(2_033)).into_bytes();
    assert_eq!(at_limit.len(), 2_048);
    let mut chunks = vec![format!("{:x}\r\n", at_limit.len()).into_bytes()];
    at_limit.extend_from_slice(b"\r\n0\r\n\r\n");
    chunks.push(at_limit);
    assert_eq!(status_line(addr, &head, &chunks).await, "HTTP/1.1 200 OK");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// An LLM gateway keyed on the user, reserving the `max_tokens` a JSON body asks for (read by
/// the same layer as the key, kept as the number it is) and settled to the usage the handler
/// reports: `10000/1m` tokens.
fn gateway() -> Router {
    use tower_redis_ratelimit::key::body::BodyFields;
    use tower_redis_ratelimit::usage::{Usage, UsageReport};
    use tower_redis_ratelimit::{Decisions, Policy};

    let read = crate::support::gateway::body_fields();
    let limit = RateLimitLayer::builder()
        .key(read.key())
        .store(MemoryStore::new())
        .policy(Policy::new("tokens", ["10000/1m".parse().unwrap()]).unwrap())
        .cost(crate::support::gateway::max_tokens)
        .usage(UsageReport::new())
        .build()
        .unwrap();
    // The handler sees its reservation and allowance, and reports 300 tokens used.
    let complete = |Extension(decisions): Extension<Decisions>,
                    Extension(fields): Extension<BodyFields>| async move {
        let d = decisions.get("tokens").unwrap();
        let seen = format!(
            "{:?} {} {} {}",
            fields.number("max_tokens"),
            d.reserved(),
            d.remaining(),
            decisions.allowance("tokens").unwrap()
        );
        (Extension(Usage(300)), seen)
    };
    Router::new()
        .route("/v1/chat", post(complete))
        .layer(limit)
        .layer(read)
}

fn chat(body: &str) -> Request<Body> {
    Request::post("/v1/chat")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

#[tokio::test]
async fn max_tokens_from_the_body_is_reserved_then_settled_to_usage() {
    let app = gateway();
    let first = r#"{"user": "Ann", "max_tokens": 800, "messages": []}"#;
    // 800 reserved of 10 000: 9 200 left, and the handler may use all 10 000.
    assert_eq!(
        send(&app, chat(first)).await,
        (StatusCode::OK, "Some(800) 800 9200 10000".into())
    );
    // Settled to the 300 used when the first response ended: 9 700 left before this one's
    // 4 000, and a body without `max_tokens` reserves the default 100.
    let second = r#"{"max_tokens": 4000, "user": "ann"}"#;
    assert_eq!(
        send(&app, chat(second)).await,
        (StatusCode::OK, "Some(4000) 4000 5700 9700".into())
    );
    assert_eq!(
        send(&app, chat(r#"{"user": "ann"}"#)).await,
        (StatusCode::OK, "None 100 9300 9400".into())
    );
    // A request asking for more than is left is refused before the handler.
    let greedy = r#"{"user": "ann", "max_tokens": 9500}"#;
    assert_eq!(
        send(&app, chat(greedy)).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // `max_tokens` that is no whole number is the layer's 400, naming the field.
    for bad in [r#""800""#, "-1", "1.5"] {
        let body = format!(r#"{{"user": "ann", "max_tokens": {bad}}}"#);
        let (status, text) = send(&app, chat(&body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(text.contains("\"max_tokens\""), "{text}");
    }
}
