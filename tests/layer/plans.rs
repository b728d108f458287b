//! Limits chosen per request: a policy's plans, picked by the layer's plan function from the
//! request's head, decide one state under the policy's name. A customer who changes plans keeps
//! the usage recorded so far; a refusal cached under one plan's limits is not repeated under
//! another's; the store's overrides, for the key, the plan or the whole policy, win over a
//! plan's limits, in that order.

use crate::support::http::{api_key, keyed, LayerBody};
use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use tower::ServiceExt;
use tower_redis_ratelimit::store::{Override, Overrides, Scope};
use tower_redis_ratelimit::{
    Algorithm, BuildError, Key, MemoryStore, Policy, RateLimitLayer, Rule, Store,
};

/// A day's window, so that no fixed window ends while a test runs.
fn daily(count: u64) -> tower_redis_ratelimit::Limit {
    format!("{count}/1d").parse().unwrap()
}

fn api(algorithm: Algorithm) -> Policy {
    Policy::new("api", [daily(5)])
        .unwrap()
        .with_algorithm(algorithm)
}

/// A service behind a layer of `rule`; the plan is read from `x-plan`, standing in for what an
/// authentication middleware would set.
fn with_plans<St: Store>(
    store: St,
    rule: Rule,
) -> impl tower::Service<
    http::Request<LayerBody>,
    Response = http::Response<impl Sized>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .plan(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
        .rule(rule)
        .build()
        .unwrap();
    crate::support::http::served(layer)
}

/// How many of `tries` requests of `key` on `plan` are admitted, and the limit the last
/// response named.
async fn admitted<S, B>(service: &S, key: &str, plan: Option<&str>, tries: usize) -> (usize, u64)
where
    S: tower::Service<http::Request<LayerBody>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let (mut admitted, mut limit) = (0, 0);
    for _ in 0..tries {
        let mut request = keyed(key);
        if let Some(plan) = plan {
            request
                .headers_mut()
                .insert("x-plan", plan.parse().unwrap());
        }
        let response = service.clone().oneshot(request).await.unwrap();
        admitted += usize::from(response.status() == 200);
        let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
        limit = policy
            .split(";q=")
            .nth(1)
            .and_then(|q| q.split(';').next())
            .and_then(|q| q.parse().ok())
            .unwrap();
    }
    (admitted, limit)
}

async fn plans<St: Store>(store: St, overrides: Overrides) {
    for algorithm in ALGORITHMS {
        // `api` is `5/1d`, `8/1d` on plan `pro`.
        let service = with_plans(store.clone(), Rule::new(api(algorithm)).plan("pro", "8/1d"));
        let free = format!("free-{algorithm:?}");
        let what = |step: &str| format!("{algorithm:?}: {step}");
        assert_eq!(
            admitted(&service, &free, None, 6).await,
            (5, 5),
            "{}",
            what("free plan")
        );
        // The upgrade keeps the five used: three more, although the free plan's refusal of
        // the sixth may be in the deny cache.
        assert_eq!(
            admitted(&service, &free, Some("pro"), 4).await,
            (3, 8),
            "{}",
            what("upgraded")
        );
        // A plan the policy does not name is its own limits.
        assert_eq!(
            admitted(&service, &free, Some("gold"), 1).await,
            (0, 5),
            "{}",
            what("unknown plan")
        );
        let pro = format!("pro-{algorithm:?}");
        assert_eq!(
            admitted(&service, &pro, Some("pro"), 9).await,
            (8, 8),
            "{}",
            what("pro from the start")
        );

        // Overrides in the store win over the plan: the key's own, then the policy's.
        let policy = api(algorithm);
        let key = Scope::Key(Key::from(pro.as_str()));
        let ten = Override::Limits(vec![daily(10)]);
        overrides.set(&policy, &key, &ten).await.unwrap();
        assert_eq!(
            admitted(&service, &pro, Some("pro"), 3).await,
            (2, 10),
            "{}",
            what("key override")
        );
        let twelve = Override::Limits(vec![daily(12)]);
        overrides.set(&policy, &Scope::All, &twelve).await.unwrap();
        assert_eq!(
            admitted(&service, &free, Some("pro"), 5).await,
            (4, 12),
            "{}",
            what("policy override")
        );
        overrides.remove(&policy, &Scope::All).await.unwrap();
        overrides.remove(&policy, &key).await.unwrap();
        assert_eq!(
            admitted(&service, &pro, Some("pro"), 1).await,
            (0, 8),
            "{}",
            what("overrides removed")
        );
    }
}

/// Overrides per plan: raising `free` leaves `pro` at its own limits, and the order is the
/// key's override, the plan's, the policy-wide one, the plan's own limits, the policy's.
async fn plan_overrides<St: Store>(store: St, overrides: Overrides) {
    for algorithm in ALGORITHMS {
        // `api` is `5/1d`, on plan `free` the same, on plan `pro` `8/1d`.
        let rule = Rule::new(api(algorithm))
            .plan("free", "5/1d")
            .plan("pro", "8/1d");
        let service = with_plans(store.clone(), rule);
        let policy = api(algorithm);
        let key = |name: &str| format!("{name}-{algorithm:?}");
        let try_ = |name: &str, plan: Option<&'static str>, tries: usize| {
            let (service, key) = (service.clone(), key(name));
            async move { admitted(&service, &key, plan, tries).await }
        };
        let what = |step: &str| format!("{algorithm:?}: {step}");
        let (free, all) = (Scope::Plan("free".into()), Scope::All);
        let limits = |n| Override::Limits(vec![daily(n)]);

        overrides.set(&policy, &free, &limits(20)).await.unwrap();
        assert_eq!(
            try_("f1", Some("free"), 21).await,
            (20, 20),
            "{}",
            what("free raised")
        );
        assert_eq!(
            try_("p1", Some("pro"), 9).await,
            (8, 8),
            "{}",
            what("pro kept")
        );
        assert_eq!(
            try_("n1", None, 6).await,
            (5, 5),
            "{}",
            what("no plan kept")
        );

        overrides.set(&policy, &all, &limits(12)).await.unwrap();
        assert_eq!(
            try_("f2", Some("free"), 21).await,
            (20, 20),
            "{}",
            what("plan > all")
        );
        assert_eq!(
            try_("p2", Some("pro"), 13).await,
            (12, 12),
            "{}",
            what("all > pro's own")
        );
        let vip = Scope::Key(Key::from(key("f3")));
        overrides.set(&policy, &vip, &limits(3)).await.unwrap();
        assert_eq!(
            try_("f3", Some("free"), 4).await,
            (3, 3),
            "{}",
            what("key > plan")
        );

        // A plan's block stands where its counts stood: a key's own raise passes it.
        overrides
            .set(&policy, &free, &Override::Block)
            .await
            .unwrap();
        assert_eq!(
            try_("f4", Some("free"), 3).await,
            (0, 0),
            "{}",
            what("free blocked")
        );
        let raised = Scope::Key(Key::from(key("f5")));
        overrides.set(&policy, &raised, &limits(2)).await.unwrap();
        assert_eq!(
            try_("f5", Some("free"), 3).await,
            (2, 2),
            "{}",
            what("key > plan block")
        );
        assert_eq!(
            try_("p3", Some("pro"), 13).await,
            (12, 12),
            "{}",
            what("pro not blocked")
        );
        for scope in [free, all, vip, raised] {
            assert!(overrides.remove(&policy, &scope).await.unwrap());
        }
    }
}

/// An override that names some windows only leaves the others at the counts of the policy the
/// request is decided by: a plan's customer keeps the plan's, under the plan's override and
/// under a key's, and a customer on no plan the policy's own.
async fn partial_overrides_on_plans<St: Store>(store: St, overrides: Overrides) {
    for algorithm in ALGORITHMS {
        let hourly =
            |count: u64| -> tower_redis_ratelimit::Limit { format!("{count}/1h").parse().unwrap() };
        let policy = Policy::new("tiers", [hourly(2), daily(5)])
            .unwrap()
            .with_algorithm(algorithm);
        let rule = Rule::new(policy.clone()).plan("pro", "20/1h + 50/1d");
        let service = with_plans(store.clone(), rule);
        let key = |name: &str| format!("{name}-{algorithm:?}");
        let what = |step: &str| format!("{algorithm:?}: {step}");
        let day = |n| Override::Limits(vec![daily(n)]);

        // The day lowered for plan `pro` to 30: its hour stays 20, not the policy's 2.
        let pro = Scope::Plan("pro".into());
        overrides.set(&policy, &pro, &day(30)).await.unwrap();
        let got = admitted(&service, &key("p1"), Some("pro"), 21).await;
        assert_eq!(got, (20, 20), "{}", what("pro's hour kept"));
        // A pro customer's own override of the day: the plan's hour again.
        let vip = Scope::Key(Key::from(key("p2")));
        overrides.set(&policy, &vip, &day(25)).await.unwrap();
        let got = admitted(&service, &key("p2"), Some("pro"), 21).await;
        assert_eq!(got, (20, 20), "{}", what("a pro key's hour kept"));
        // Policy-wide, the hour raised to 4: a customer on no plan keeps the day's 5.
        let all = Scope::All;
        overrides
            .set(&policy, &all, &Override::Limits(vec![hourly(4)]))
            .await
            .unwrap();
        let got = admitted(&service, &key("n1"), None, 6).await;
        assert_eq!(got.0, 4, "{}", what("the hour raised"));
        // Read back as set: the windows named.
        let read = overrides.get(&policy, &pro).await.unwrap();
        assert_eq!(read, Some(day(30)), "{}", what("read back"));
        for scope in [pro, vip, all] {
            assert!(overrides.remove(&policy, &scope).await.unwrap());
        }
    }
}

#[tokio::test]
async fn partial_overrides_keep_the_plans_counts_on_memory() {
    let store = MemoryStore::new();
    partial_overrides_on_plans(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn partial_overrides_keep_the_plans_counts_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    partial_overrides_on_plans(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn overrides_per_plan_on_memory() {
    let store = MemoryStore::new();
    plan_overrides(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn overrides_per_plan_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    plan_overrides(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn plans_share_the_policy_state_on_memory() {
    let store = MemoryStore::new();
    plans(store.clone(), store.overrides()).await;
}

/// With a deny cache (on by default for Redis), so that a refusal cached under the free plan's
/// limits meets the upgrade.
#[tokio::test]
async fn plans_share_the_policy_state_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    plans(store.clone(), store.overrides()).await;
}

#[test]
fn plans_are_checked_when_the_layer_is_built() {
    let build = |rule: Rule| {
        RateLimitLayer::builder()
            .plan(|head| head.uri.query())
            .rule(rule)
            .build()
            .map(drop)
    };
    let api = || Policy::new("api", ["60/1m".parse().unwrap()]).unwrap();
    let other_windows = build(Rule::new(api()).plan("pro", "600/1h")).unwrap_err();
    assert!(
        matches!(&other_windows, BuildError::Plan { plan, .. } if plan == "pro"),
        "{other_windows}"
    );
    assert!(other_windows.to_string().contains("1m"), "{other_windows}");
    let twice = build(Rule::new(api()).plan("pro", "600/1m").plan("pro", "700/1m"));
    assert!(matches!(twice, Err(BuildError::Plan { .. })), "{twice:?}");
    let bad = build(Rule::new(api()).plan("pro", "600/1parsec"));
    assert!(bad.is_err());
    // Plans with nothing to choose them would never apply.
    let unused = RateLimitLayer::builder()
        .rule(Rule::new(api()).plan("pro", "600/1m"))
        .build();
    assert!(
        matches!(&unused, Err(BuildError::Plan { why, .. }) if why.contains("plan function")),
        "{unused:?}"
    );
    // One policy name, two rules that disagree about a plan: one state, two answers.
    let conflict = RateLimitLayer::builder()
        .plan(|head| head.uri.query())
        .rule(Rule::new(api()).path("/a").plan("pro", "600/1m"))
        .rule(Rule::new(api()).path("/b").plan("pro", "700/1m"))
        .build();
    assert_eq!(
        conflict.unwrap_err(),
        BuildError::PolicyConflict("api".into())
    );
    let agree = RateLimitLayer::builder()
        .plan(|head| head.uri.query())
        .rule(Rule::new(api()).path("/a").plan("pro", "600/1m"))
        .rule(Rule::new(api()).path("/b").plan("pro", "600/1m"))
        .build();
    assert!(agree.is_ok());
}
