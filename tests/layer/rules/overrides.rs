//! A rules edit meets the store's overrides: blocks belong to the policy's name and survive a
//! change of its windows or algorithm, on both stores; count overrides set for the old windows
//! decide nothing afterwards, and the layer says so at WARN, naming each one's key.

use std::time::Duration;

use crate::support::http::{admitted, api_key, served};
use crate::support::{Captured, RedisServer};
use tower_redis_ratelimit::store::{Override, Overrides, Scope};
use tower_redis_ratelimit::test_util::loggable;
use tower_redis_ratelimit::{
    Algorithm, Key, Limit, MemoryStore, Policy, RateLimitLayer, Rule, RuleTable, Rules, Store,
};

fn limit(text: &str) -> Limit {
    text.parse().unwrap()
}

/// `api` at 10 an hour, with `extra` limits and `algorithm`.
fn api(extra: &[&str], algorithm: Algorithm) -> Policy {
    let limits = std::iter::once("10/1h")
        .chain(extra.iter().copied())
        .map(limit);
    Policy::new("api", limits)
        .unwrap()
        .with_algorithm(algorithm)
}

fn rules(policy: Policy) -> Rules {
    Rules::new().rule(Rule::new(policy))
}

/// A service keyed by `x-api-key` whose only policy is `api` at 10 an hour, and its table.
fn service<St: Store>(
    store: St,
) -> (
    impl tower::Service<
            http::Request<crate::support::http::LayerBody>,
            Response = http::Response<impl Sized>,
            Error = std::convert::Infallible,
            Future = impl Send,
        > + Clone,
    RuleTable,
) {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .rules(rules(api(&[], Algorithm::SlidingLog)))
        .build()
        .unwrap();
    let table = layer.rule_table();
    (served(layer), table)
}

/// A block on `api`, for one key and then for every key, through two rules edits: a window
/// added, then the algorithm changed. Nothing passes the block at any step; a key without one
/// is decided by the new limits.
async fn blocks_survive<St: Store>(store: St, overrides: Overrides) {
    let (service, table) = service(store);
    let base = api(&[], Algorithm::SlidingLog);
    let blocked = Key::from("blocked");
    overrides
        .set(&base, &Scope::Key(blocked.clone()), &Override::Block)
        .await
        .unwrap();
    let edits = [
        ("as written", api(&[], Algorithm::SlidingLog)),
        ("a window added", api(&["100/1d"], Algorithm::SlidingLog)),
        ("GCRA", api(&["100/1d"], Algorithm::Gcra)),
    ];
    for (i, (edit, policy)) in edits.iter().enumerate() {
        table.replace(rules(policy.clone())).unwrap();
        assert_eq!(admitted(&service, "blocked", 10).await, 0, "key: {edit}");
        let free = format!("free-{i}");
        assert_eq!(admitted(&service, &free, 3).await, 3, "another key: {edit}");
        let got = overrides.get(policy, &Scope::Key(blocked.clone())).await;
        assert_eq!(got.unwrap(), Some(Override::Block), "{edit}");
    }

    table.replace(rules(base.clone())).unwrap();
    overrides
        .set(&base, &Scope::All, &Override::Block)
        .await
        .unwrap();
    for (i, (edit, policy)) in edits.iter().enumerate() {
        table.replace(rules(policy.clone())).unwrap();
        let anyone = format!("anyone-{i}");
        assert_eq!(
            admitted(&service, &anyone, 10).await,
            0,
            "policy-wide: {edit}"
        );
    }
}

#[tokio::test]
async fn blocks_survive_a_change_of_windows_or_algorithm_on_memory() {
    let store = MemoryStore::new();
    blocks_survive(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn blocks_survive_a_change_of_windows_or_algorithm_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    blocks_survive(store.clone(), store.overrides()).await;
}

/// Waits up to two seconds for `captured` to hold every one of `parts` on one line; that line.
async fn logged(captured: &Captured, parts: &[&str]) -> Option<String> {
    for _ in 0..200 {
        let text = captured.text();
        let line = text
            .lines()
            .find(|line| parts.iter().all(|p| line.contains(p)));
        if let Some(line) = line {
            return Some(line.to_owned());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Count overrides of `api` for a key, a plan and every key; a window added in the rules:
/// each is reported at WARN with its scope, decides nothing (the key is decided by the new
/// limits), and `unfit` lists them; a block beside them is not reported. A layer built on the
/// same store with the new rules (a deploy) reports them too.
async fn unfit_counts_are_reported<St: Store>(store: St, overrides: Overrides) {
    let captured = Captured::default();
    let _logs = tracing::subscriber::set_default(captured.subscriber());
    let (service, table) = service(store.clone());
    let base = api(&[], Algorithm::SlidingLog);
    let twenty = Override::Limits(vec![limit("20/1h")]);
    let scopes = [
        Scope::Key(Key::from("vip")),
        Scope::Plan("free".into()),
        Scope::All,
    ];
    for scope in &scopes {
        overrides.set(&base, scope, &twenty).await.unwrap();
    }
    overrides
        .set(&base, &Scope::Key(Key::from("banned")), &Override::Block)
        .await
        .unwrap();
    assert!(captured.text().is_empty(), "{}", captured.text());

    let wider = api(&["100/1d"], Algorithm::SlidingLog);
    table.replace(rules(wider.clone())).unwrap();
    for scope in &scopes {
        // A key's scope is logged as logs name keys: hashed, never the key itself.
        let scope_field = match scope {
            Scope::Key(key) => format!("scope=key:{}", loggable(key)),
            other => format!("scope={other}"),
        };
        let line = logged(&captured, &[" WARN ", "no longer fits", &scope_field]).await;
        let line = line.unwrap_or_else(|| panic!("{scope}: {}", captured.text()));
        assert!(
            line.contains("api:log:1h") && line.contains("api:log:1h+1d"),
            "{line}"
        );
    }
    assert!(!captured.text().contains("key:vip"), "{}", captured.text());
    assert!(
        !captured.text().contains("key:banned"),
        "{}",
        captured.text()
    );
    assert_eq!(
        admitted(&service, "vip", 12).await,
        10,
        "the new limits decide"
    );
    let unfit = overrides.unfit(&wider).await.unwrap();
    let listed: Vec<&Scope> = unfit.iter().map(|(scope, _)| scope).collect();
    assert_eq!(listed, [&scopes[2], &scopes[1], &scopes[0]]);
    assert!(unfit.iter().all(|(_, set_for)| set_for == "api:log:1h"));

    let deployed = Captured::default();
    let deployed_logs = tracing::subscriber::set_default(deployed.subscriber());
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .rules(rules(wider))
        .build()
        .unwrap();
    let vip = format!("scope=key:{}", loggable(&Key::from("vip")));
    let line = logged(&deployed, &["no longer fits", &vip]).await;
    assert!(line.is_some(), "{}", deployed.text());
    assert!(!deployed.text().contains("key:vip"), "{}", deployed.text());
    drop((layer, deployed_logs));
}

#[tokio::test]
async fn unfit_count_overrides_are_reported_on_memory() {
    let store = MemoryStore::new();
    unfit_counts_are_reported(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn unfit_count_overrides_are_reported_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    unfit_counts_are_reported(store.clone(), store.overrides()).await;
}
