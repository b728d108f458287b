//! Equal policies on several layers: one behaviour whatever the store. Two routes that each
//! parse `"3/1m"` keep a budget each with the default store (a store per builder); on one
//! store passed to both, the second layer fails to build rather than share the first one's
//! budget without a word. Named policies keep a budget per name on every store; one layer
//! cloned onto both routes shares one.

use std::net::SocketAddr;

use crate::support::http::{get as fetch, serve_axum};
use crate::support::RedisServer;
use axum::routing::get;
use axum::Router;
use tower_redis_ratelimit::{
    Algorithm, BuildError, MemoryStore, PeerIp, Policy, RateLimitLayer, RedisStore, Rule, Rules,
    Store,
};

/// Serves `/a` limited by `a` and `/b` by `b`, each with a `route_layer` of its own.
async fn two_routes<S: Store>(
    a: RateLimitLayer<PeerIp, S>,
    b: RateLimitLayer<PeerIp, S>,
) -> SocketAddr {
    let app = Router::new()
        .route("/a", get(|| async { "a" }).route_layer(a))
        .route("/b", get(|| async { "b" }).route_layer(b));
    serve_axum(app, true).await
}

/// The statuses of `n` requests to `path`, one after the other.
async fn statuses(addr: SocketAddr, path: &str, n: usize) -> Vec<u16> {
    let mut seen = Vec::new();
    for _ in 0..n {
        seen.push(fetch(addr, path).await.status.as_u16());
    }
    seen
}

/// `/a` three times, `/b` three times, then each once more: a budget of 3 per route.
async fn assert_a_budget_per_route(addr: SocketAddr) {
    assert_eq!(statuses(addr, "/a", 3).await, [200, 200, 200], "/a");
    assert_eq!(statuses(addr, "/b", 3).await, [200, 200, 200], "/b");
    assert_eq!(statuses(addr, "/a", 1).await, [429], "/a past its budget");
    assert_eq!(statuses(addr, "/b", 1).await, [429], "/b past its budget");
}

fn named(name: &str) -> Policy {
    Policy::new(name, ["3/1m".parse().unwrap()]).unwrap()
}

/// A layer of `policy` on `store`.
fn on<S: Store>(policy: Policy, store: &S) -> RateLimitLayer<PeerIp, S> {
    RateLimitLayer::builder()
        .policy(policy)
        .store(store.clone())
        .build()
        .unwrap()
}

fn assert_in_use(built: Result<impl std::fmt::Debug, BuildError>) {
    let err = built.unwrap_err();
    assert_eq!(err, BuildError::PolicyInUse("3/1m".into()));
    let text = err.to_string();
    assert!(
        text.contains("Policy::new") && text.contains("clone"),
        "{text}"
    );
}

#[tokio::test]
async fn equal_unnamed_policies_keep_a_budget_per_route_with_the_default_store() {
    let a = RateLimitLayer::builder().policy("3/1m").build().unwrap();
    let b = RateLimitLayer::builder().policy("3/1m").build().unwrap();
    assert_a_budget_per_route(two_routes(a, b).await).await;
}

#[tokio::test]
async fn equal_unnamed_policies_on_one_memory_store_fail_to_build() {
    let store = MemoryStore::new();
    let layer = |store: &MemoryStore| {
        RateLimitLayer::builder()
            .policy("3/1m")
            .store(store.clone())
            .build()
    };
    let a = layer(&store).unwrap();
    assert_in_use(layer(&store));
    // Another unnamed policy, another algorithm, or the same limits named: no conflict.
    let b = RateLimitLayer::builder()
        .policy("4/1m")
        .store(store.clone())
        .build()
        .unwrap();
    let gcra = RateLimitLayer::builder()
        .policy(
            "3/1m"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::Gcra),
        )
        .store(store.clone())
        .build()
        .unwrap();
    drop((a, b, gcra));
}

#[tokio::test]
async fn equal_unnamed_policies_on_one_redis_store_fail_to_build() {
    let server = RedisServer::start();
    let store = server.store().await;
    let layer = |store: &RedisStore| {
        RateLimitLayer::builder()
            .policy("3/1m")
            .store(store.clone())
            .build()
    };
    let a = layer(&store).unwrap();
    assert_in_use(layer(&store));
    // A rule of another layer with the same unnamed policy is refused too.
    let by_rule = RateLimitLayer::builder()
        .rule(Rule::new("3/1m").path("/x"))
        .store(store.clone())
        .build();
    assert_in_use(by_rule);
    // A second store on the same Redis is another instance of a fleet: no conflict.
    let instance = server.store().await;
    let b = layer(&instance).unwrap();
    drop((a, b));
}

#[tokio::test]
async fn named_policies_keep_a_budget_per_route_on_every_store() {
    // The default store of each builder.
    let a = RateLimitLayer::builder()
        .policy(named("a"))
        .build()
        .unwrap();
    let b = RateLimitLayer::builder()
        .policy(named("b"))
        .build()
        .unwrap();
    assert_a_budget_per_route(two_routes(a, b).await).await;
    // One memory store.
    let memory = MemoryStore::new();
    let (a, b) = (on(named("a"), &memory), on(named("b"), &memory));
    assert_a_budget_per_route(two_routes(a, b).await).await;
    // One Redis store.
    let server = RedisServer::start();
    let redis = server.store().await;
    let (a, b) = (on(named("a"), &redis), on(named("b"), &redis));
    assert_a_budget_per_route(two_routes(a, b).await).await;
}

#[tokio::test]
async fn one_layer_cloned_onto_two_routes_shares_its_budget() {
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .policy("3/1m")
        .store(store.clone())
        .build()
        .unwrap();
    let addr = two_routes(layer.clone(), layer.clone()).await;
    // The clones hold the claim while the layer itself is gone.
    drop(layer);
    assert_in_use(
        RateLimitLayer::builder()
            .policy("3/1m")
            .store(store.clone())
            .build(),
    );
    assert_eq!(statuses(addr, "/a", 2).await, [200, 200]);
    assert_eq!(statuses(addr, "/b", 2).await, [200, 429]);
}

#[tokio::test]
async fn a_layer_dropped_frees_its_unnamed_policy_on_both_stores() {
    let server = RedisServer::start();
    let redis = server.store().await;
    let memory = MemoryStore::new();
    for round in 0..2 {
        let layer = RateLimitLayer::builder()
            .policy("3/1m")
            .store(memory.clone())
            .build()
            .unwrap_or_else(|e| panic!("memory, round {round}: {e}"));
        // In a router and dropped with it: the services held the claim too.
        let app: Router = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer);
        drop(app);
        let layer = RateLimitLayer::builder()
            .policy("3/1m")
            .store(redis.clone())
            .build()
            .unwrap_or_else(|e| panic!("redis, round {round}: {e}"));
        drop(layer);
    }
}

#[tokio::test]
async fn a_table_replaced_with_a_policy_another_layer_uses_is_refused() {
    let store = MemoryStore::new();
    let a = RateLimitLayer::builder()
        .policy("3/1m")
        .store(store.clone())
        .build()
        .unwrap();
    let b = RateLimitLayer::builder()
        .policy("4/1m")
        .store(store.clone())
        .build()
        .unwrap();
    let table = b.rule_table();
    assert_eq!(
        table.replace(Rules::new().policy("3/1m")),
        Err(BuildError::PolicyInUse("3/1m".into()))
    );
    assert_eq!(table.policies()[0].to_string(), "4/1m");
    // Replaced, `b` gives up `4/1m`; its own policy it may keep.
    table.replace(Rules::new().policy("5/1m")).unwrap();
    table.replace(Rules::new().policy("5/1m")).unwrap();
    let c = RateLimitLayer::builder()
        .policy("4/1m")
        .store(store.clone())
        .build()
        .unwrap();
    drop((a, c));
}
