//! Unique clients per policy in Redis HyperLogLogs: 100 000 distinct keys through a layer,
//! counted back for the last hour and the last day.

use crate::support::scenarios::Reply;
use crate::support::RedisServer;
use fred::prelude::*;
use http::{HeaderName, Request};
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::test_util::{dropped, flush};
use tower_redis_ratelimit::unique::{Clients, Span, UniqueClients};
use tower_redis_ratelimit::{Header, MemoryStore, Policy, RateLimitLayer};

const CLIENTS: usize = 100_000;
/// Clients that send a second request, which `1/1h` refuses.
const REFUSED: usize = 10_000;

fn within(estimate: u64, truth: usize, tolerance: f64) -> bool {
    (estimate as f64 - truth as f64).abs() <= truth as f64 * tolerance
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_clients_counted_within_two_percent() {
    let server = RedisServer::start();
    let store = server.store().await;
    let unique = UniqueClients::new(&store);
    let layer = RateLimitLayer::builder()
        .policy("1/1h".parse::<Policy>().unwrap().named("signup").unwrap())
        .key(Header::new(HeaderName::from_static("x-client")))
        // The limit itself is decided in memory, with room for every client; only the counts
        // go to Redis.
        .store(MemoryStore::builder().max_keys(4 * CLIENTS as u64).build())
        .unique_clients(unique.clone())
        .build()
        .unwrap();
    let mut service = crate::support::scenarios::layered(&layer);
    let mut refused = 0;
    for i in 0..CLIENTS + REFUSED {
        let mut request = Request::new(());
        let client = format!("client-{}", i % CLIENTS);
        request
            .headers_mut()
            .insert("x-client", client.parse().unwrap());
        let reply: Reply = service.ready().await.unwrap().call(request).await.unwrap();
        refused += usize::from(reply.status() == 429);
        if i % 10_000 == 0 {
            // Let the writer keep up, so that the bounded queue drops nothing.
            assert!(flush(&unique).await);
        }
    }
    assert_eq!(refused, REFUSED);
    assert!(flush(&unique).await, "every write succeeded");
    assert_eq!(dropped(&unique), 0);

    let count = |span, clients| {
        let unique = unique.clone();
        async move { unique.count("signup", span, clients).await.unwrap() }
    };
    let hour = count(Span::Hours(1), Clients::All).await;
    let day = count(Span::Days(1), Clients::All).await;
    let denied = count(Span::Hours(24), Clients::Denied).await;
    eprintln!("unique clients: last hour {hour}, last day {day}, denied {denied}");
    assert!(within(hour, CLIENTS, 0.02), "last hour: {hour}");
    assert!(within(day, CLIENTS, 0.02), "last day: {day}");
    assert!(within(denied, REFUSED, 0.02), "denied: {denied}");
    assert_eq!(
        count(Span::Hours(1), Clients::All).await,
        hour,
        "a query changes nothing"
    );

    // Every bucket expires; a dense HyperLogLog stays near 12 KiB however many clients.
    let admin = server.client().await;
    let command = fred::types::CustomCommand::new_static("KEYS", None, false);
    let keys: Vec<String> = admin
        .custom(command, vec!["ratelimit:{uv:signup}:*"])
        .await
        .unwrap();
    // All and denied, per minute, hour and day (a minute more if the run crossed one).
    for which in ["all", "denied"] {
        for unit in ["m", "h", "d"] {
            let prefix = format!("ratelimit:{{uv:signup}}:{which}:{unit}:");
            assert!(keys.iter().any(|k| k.starts_with(&prefix)), "{keys:?}");
        }
    }
    for key in &keys {
        let ttl: i64 = admin.pttl(key).await.unwrap();
        let bytes: u64 = admin.memory_usage(key, Some(0)).await.unwrap();
        eprintln!("{key}: {bytes} bytes, expires in {} s", ttl / 1000);
        assert!(ttl > 0, "{key} has no expiry");
        assert!(bytes < 16 * 1024, "{key}: {bytes} bytes");
    }
}
