//! Real clients: proxies, spoofed headers, hostile input, per-route policies, operator controls.

use std::convert::Infallible;
use std::net::SocketAddr;

use crate::support::http::{get as fetch, serve_axum};
use crate::support::Captured;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::key::ForwardedHeader;
use tower_redis_ratelimit::{ClientIp, Header, KeyExtractor, Policy, RateLimitLayer, Rule, Store};

/// A request from `peer` with `headers` (raw bytes allowed).
fn from(peer: &str, headers: &[(&str, &[u8])]) -> Request<()> {
    let mut request = Request::get("/").body(()).unwrap();
    for (name, value) in headers {
        let value = HeaderValue::from_bytes(value).unwrap();
        let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
        request.headers_mut().append(name, value);
    }
    request
        .extensions_mut()
        .insert(SocketAddr::new(peer.parse().unwrap(), 50000));
    request
}

type Reply = Response<tower_redis_ratelimit::body::ResponseBody<Full<Bytes>>>;

async fn send<K, St>(layer: &RateLimitLayer<K, St>, request: Request<()>) -> Reply
where
    K: KeyExtractor<()>,
    St: Store,
{
    let service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    }));
    service.oneshot(request).await.unwrap()
}

async fn statuses<K, St>(layer: &RateLimitLayer<K, St>, requests: Vec<Request<()>>) -> Vec<u16>
where
    K: KeyExtractor<()>,
    St: Store,
{
    let mut out = Vec::new();
    for request in requests {
        out.push(send(layer, request).await.status().as_u16());
    }
    out
}

#[tokio::test]
async fn forged_forwarding_headers_share_the_peers_limit() {
    let layer = RateLimitLayer::builder()
        .policy("2/1m")
        .key(ClientIp::new())
        .build()
        .unwrap();
    let forged = vec![
        from("203.0.113.5", &[("x-forwarded-for", b"1.1.1.1")]),
        from("203.0.113.5", &[("forwarded", b"for=2.2.2.2")]),
        from(
            "203.0.113.5",
            &[("x-real-ip", b"3.3.3.3"), ("x-forwarded-for", b"4.4.4.4")],
        ),
    ];
    assert_eq!(statuses(&layer, forged).await, [200, 200, 429]);
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_real_client_is_limited() {
    let client_ip = ClientIp::builder()
        .trust("10.0.0.0/8")
        .unwrap()
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .policy("2/1m")
        .key(client_ip)
        .build()
        .unwrap();
    // The client rotates a forged left-most entry; the proxy appends its real address.
    let rotating = (0..3)
        .map(|i| {
            let xff = format!("6.6.6.{i}, 198.51.100.7");
            from("10.0.0.1", &[("x-forwarded-for", xff.as_bytes())])
        })
        .collect();
    assert_eq!(statuses(&layer, rotating).await, [200, 200, 429]);
    // Another client behind the same proxy has its own budget.
    let other = from("10.0.0.1", &[("x-forwarded-for", b"198.51.100.8")]);
    assert_eq!(send(&layer, other).await.status(), 200);
}

#[tokio::test]
async fn ipv6_addresses_of_one_64_share_a_limit() {
    let layer = RateLimitLayer::builder()
        .policy("2/1m")
        .key(ClientIp::new())
        .build()
        .unwrap();
    let one_subnet = vec![
        from("2001:db8:1:2::1", &[]),
        from("2001:db8:1:2:ffff:ffff:ffff:ffff", &[]),
        from("2001:db8:1:2::abcd", &[]),
    ];
    assert_eq!(statuses(&layer, one_subnet).await, [200, 200, 429]);
    assert_eq!(
        send(&layer, from("2001:db8:1:3::1", &[])).await.status(),
        200
    );
}

/// Every hostile input gets the documented answer, and nothing panics.
#[tokio::test]
async fn hostile_input_gets_documented_answers() {
    let trusted = ClientIp::builder()
        .trust("10.0.0.0/8")
        .unwrap()
        .build()
        .unwrap();
    let by_ip = RateLimitLayer::builder()
        .policy("100/1m")
        .key(trusted)
        .build()
        .unwrap();
    let by_api_key = RateLimitLayer::builder()
        .policy("100/1m")
        .key(Header::new(http::HeaderName::from_static("x-api-key")))
        .build()
        .unwrap();

    // Non-UTF-8 forwarding header from the proxy: the walk stops at the proxy (200, counted
    // under 10.0.0.1).
    let binary = from("10.0.0.1", &[("x-forwarded-for", b"\xff\xfe\xfd")]);
    assert_eq!(send(&by_ip, binary).await.status(), 200);
    // 1 000 hops, all trusted: the walk stops after 64 at the last trusted hop.
    let hops = "10.0.0.9, ".repeat(999) + "10.0.0.8";
    let long = from("10.0.0.1", &[("x-forwarded-for", hops.as_bytes())]);
    assert_eq!(send(&by_ip, long).await.status(), 200);
    // Malformed Forwarded, read by an extractor configured for it: stops at the proxy.
    let forwarded = ClientIp::builder()
        .trust("10.0.0.0/8")
        .unwrap()
        .header(ForwardedHeader::Forwarded)
        .build()
        .unwrap();
    let by_forwarded = RateLimitLayer::builder()
        .policy("100/1m")
        .key(forwarded)
        .build()
        .unwrap();
    let malformed: [&[u8]; 5] = [
        b"for=",
        b"for=\"[2001:db8::1",
        b";;;,,,",
        b"for=_hidden, by=x",
        b"for=a;for=b",
    ];
    for bad in malformed {
        let reply = send(&by_forwarded, from("10.0.0.1", &[("forwarded", bad)])).await;
        assert_eq!(reply.status(), 200);
    }
    // 8 KiB and binary API keys are hashed to a fixed-length key and limited as usual.
    let huge = vec![b'k'; 8192];
    assert_eq!(
        send(&by_api_key, from("192.0.2.1", &[("x-api-key", &huge)]))
            .await
            .status(),
        200
    );
    let bin = from("192.0.2.1", &[("x-api-key", b"\x80\x81")]);
    assert_eq!(send(&by_api_key, bin).await.status(), 200);
    // An empty key is the client's fault: 400 with a reason.
    let empty = send(&by_api_key, from("192.0.2.1", &[("x-api-key", b"   ")])).await;
    assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
    // A closure that finds no key, or an empty one: 400.
    let closure = RateLimitLayer::builder()
        .policy("1/1m")
        .key(|_: &Request<()>| Some(""))
        .build()
        .unwrap();
    assert_eq!(send(&closure, from("192.0.2.1", &[])).await.status(), 400);
}

#[tokio::test]
async fn rule_table_limits_each_route_on_its_own() {
    let search = Policy::new("search", ["2/1m".parse().unwrap()]).unwrap();
    let login = Policy::new("login", ["1/1m".parse().unwrap()]).unwrap();
    let layer = RateLimitLayer::builder()
        .rule(Rule::new(login).method(Method::POST).path("/login"))
        .rule(Rule::new(search).path("/search/{*rest}"))
        .policy("3/1m")
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(|| async { "welcome" }))
        .route("/search/{*q}", get(|| async { "results" }))
        .route("/", get(|| async { "home" }))
        .layer(layer);
    let service = app.into_service::<axum::body::Body>();
    let call = |method: Method, path: &'static str| {
        let service = service.clone();
        async move {
            let mut request = Request::builder()
                .method(method)
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap();
            request
                .extensions_mut()
                .insert(SocketAddr::from(([192, 0, 2, 1], 1)));
            let response = service.oneshot(request).await.unwrap();
            let policy = response.headers()["ratelimit-policy"]
                .to_str()
                .unwrap()
                .to_owned();
            (response.status().as_u16(), policy)
        }
    };
    assert_eq!(
        call(Method::POST, "/login").await,
        (200, "\"login\";q=1;w=60".into())
    );
    assert_eq!(call(Method::POST, "/login").await.0, 429);
    for expected in [200, 200, 429] {
        let (status, policy) = call(Method::GET, "/search/rust").await;
        assert_eq!((status, policy.as_str()), (expected, "\"search\";q=2;w=60"));
    }
    for expected in [200, 200, 200, 429] {
        let (status, policy) = call(Method::GET, "/").await;
        assert_eq!(
            (status, policy.as_str()),
            (expected, "\"default\";q=3;w=60")
        );
    }
}

#[tokio::test]
async fn route_layer_gives_each_route_its_own_limit() {
    let limit = |name: &str, text: &str| {
        let policy = Policy::new(name, [text.parse().unwrap()]).unwrap();
        RateLimitLayer::builder().policy(policy).build().unwrap()
    };
    let app = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(limit("a", "1/1m")))
        .route("/b", get(|| async { "b" }).route_layer(limit("b", "2/1m")))
        .route("/c", get(|| async { "c" }).route_layer(limit("c", "3/1m")));
    let addr = serve_axum(app, true).await;
    for (path, allowed) in [("/a", 1), ("/b", 2), ("/c", 3)] {
        for _ in 0..allowed {
            assert_eq!(fetch(addr, path).await.status, 200, "{path}");
        }
        assert_eq!(fetch(addr, path).await.status, 429, "{path}");
    }
}

#[tokio::test]
async fn allow_list_bypasses_by_key_and_network() {
    let layer = RateLimitLayer::builder()
        .policy("1/1m")
        .key(ClientIp::new())
        .allow_network("192.0.2.0/24")
        .allow_key("198.51.100.1")
        .build()
        .unwrap();
    for peer in ["192.0.2.77", "198.51.100.1"] {
        let replies = statuses(&layer, (0..3).map(|_| from(peer, &[])).collect()).await;
        assert_eq!(replies, [200, 200, 200], "{peer}");
    }
    let others = statuses(&layer, (0..2).map(|_| from("198.51.100.2", &[])).collect()).await;
    assert_eq!(others, [200, 429]);
}

#[tokio::test]
async fn cost_comes_from_the_request() {
    let layer = RateLimitLayer::builder()
        .policy("20/1m")
        .cost(|head| if head.uri.path() == "/bulk" { 10 } else { 1 })
        .build()
        .unwrap();
    let at = |path: &str| {
        let mut r = from("192.0.2.1", &[]);
        *r.uri_mut() = path.parse().unwrap();
        r
    };
    let replies = statuses(
        &layer,
        vec![at("/bulk"), at("/bulk"), at("/one"), at("/bulk")],
    )
    .await;
    assert_eq!(replies, [200, 200, 429, 429]);
    let fresh = statuses(&layer, vec![at("/bulk"), at("/one")]).await;
    assert_eq!(fresh, [429, 429], "the key's budget is spent");
}

#[tokio::test]
async fn shadow_mode_counts_and_reports_but_never_rejects() {
    let captured = Captured::default();
    let subscriber = captured.subscriber();
    let _guard = tracing::subscriber::set_default(subscriber);

    let layer = RateLimitLayer::builder()
        .policy("2/1m")
        .shadow(true)
        .build()
        .unwrap();
    let mut remaining = Vec::new();
    for _ in 0..4 {
        let reply = send(&layer, from("192.0.2.1", &[])).await;
        assert_eq!(reply.status(), 200);
        remaining.push(reply.headers()["ratelimit"].to_str().unwrap().to_owned());
    }
    assert_eq!(remaining[1], "\"default\";r=0;t=60");
    assert!(remaining[3].starts_with("\"default\";r=0;"));
    let log = captured.text();
    assert_eq!(log.matches("rate limit exceeded").count(), 2, "{log}");
    assert!(
        log.contains("policy=\"default\"") || log.contains("policy=default"),
        "{log}"
    );
    assert!(log.contains("192.0.2.1"), "{log}");
}

#[tokio::test]
async fn requests_no_rule_matches_pass_when_there_is_no_default() {
    let layer = RateLimitLayer::builder()
        .rule(Rule::new("1/1m").path("/limited"))
        .build()
        .unwrap();
    let mut service = layer.layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
    }));
    for _ in 0..3 {
        let mut r = from("192.0.2.1", &[]);
        *r.uri_mut() = "/free".parse().unwrap();
        let reply = service.ready().await.unwrap().call(r).await.unwrap();
        assert_eq!(reply.status(), 200);
        assert!(!reply.headers().contains_key("ratelimit"));
    }
}
