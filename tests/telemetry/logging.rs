//! What the logs say about a refusal. Alone while it runs: `tracing` caches per call site
//! whether anyone listens, and tests on other threads that refuse requests with no subscriber
//! would race with this one's.

use crate::support::scenarios::{layered, Reply};
use crate::support::Captured;
use http::{HeaderName, HeaderValue, Request};
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::test_util::loggable;
use tower_redis_ratelimit::{Header, Key, Policy, RateLimitLayer};

/// A refusal is logged with the policy and a fingerprint of the key, never an API key itself.
#[tokio::test]
async fn denials_are_logged_with_a_key_safe_to_log() {
    let _alone = crate::support::one_at_a_time();
    let captured = Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let layer = RateLimitLayer::builder()
        .policy("1/1m".parse::<Policy>().unwrap().named("api").unwrap())
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .build()
        .unwrap();
    let mut service = layered(&layer);
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert("x-api-key", HeaderValue::from_static("sk_live_secret"));
        let reply: Reply = service.ready().await.unwrap().call(request).await.unwrap();
        statuses.push(reply.status().as_u16());
    }
    assert_eq!(statuses, [200, 429]);
    let log = captured.text();
    assert_eq!(
        log.matches("rate limit exceeded; refused").count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("policy=\"api\"") || log.contains("policy=api"),
        "{log}"
    );
    let fingerprint = loggable(&Key::from("sk_live_secret"));
    assert!(log.contains(&fingerprint), "{log}");
    assert!(!log.contains("sk_live_secret"), "{log}");
}
