//! A Redis that requires credentials: a password, and an ACL user, both from the URL.

use crate::support::RedisServer;
use fred::prelude::*;
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

#[tokio::test]
async fn credentials_come_from_the_url() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let port = server.port();
    let policy: Policy = "2/1m".parse().unwrap();
    let key = Key::from("k");

    let admin_url = format!("redis://:s3cret@127.0.0.1:{port}");
    let store = RedisStore::connect(&admin_url).await.unwrap();
    assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());

    let admin = crate::support::client(&admin_url).await;
    let _: () = admin
        .custom(
            fred::cmd!("ACL"),
            vec![
                "SETUSER",
                "limiter",
                "on",
                ">hunter2",
                "~ratelimit:*",
                "+@all",
            ],
        )
        .await
        .unwrap();
    let user_url = format!("redis://limiter:hunter2@127.0.0.1:{port}");
    let store = RedisStore::connect(&user_url).await.unwrap();
    assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
    assert!(!store.check(&key, &policy, 1).await.unwrap().is_allowed());

    let without = chain(&RedisStore::connect(&server.url()).await.unwrap_err());
    assert!(without.contains("NOAUTH"), "{without}");
    let wrong = format!("redis://limiter:wrong@127.0.0.1:{port}");
    let wrong = chain(&RedisStore::connect(&wrong).await.unwrap_err());
    assert!(wrong.contains("WRONGPASS"), "{wrong}");
}

/// Redis ACLs decide who can change the overrides (`docs/operations.md`): the application's
/// user writes its state but only reads the overrides, and an operator's user writes them.
/// The application follows the operator's change, and its own attempt to write one is refused
/// with nothing written.
#[tokio::test]
async fn acls_let_the_operator_change_overrides_and_the_application_only_read_them() {
    use tower_redis_ratelimit::store::{Override, Scope};

    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let port = server.port();
    let admin = crate::support::client(&format!("redis://:s3cret@127.0.0.1:{port}")).await;
    let users: [&[&str]; 2] = [
        // State keys are `ratelimit:{<policy>:<client>}:...`; the overrides' are
        // `ratelimit:overrides` (with `:stamps`) and the limits version
        // `ratelimit:{overrides}:limits`.
        &[
            "SETUSER",
            "app",
            "on",
            ">app-pass",
            "~ratelimit:{*:*}*",
            "%R~ratelimit:overrides",
            "%R~ratelimit:{overrides}:limits",
            "+@all",
        ],
        &[
            "SETUSER",
            "operator",
            "on",
            ">op-pass",
            "~ratelimit:overrides*",
            "~ratelimit:{overrides}:limits",
            "+@all",
        ],
    ];
    for user in users {
        let _: () = admin
            .custom(fred::cmd!("ACL"), user.to_vec())
            .await
            .unwrap();
    }
    let url = |user: &str, pass: &str| format!("redis://{user}:{pass}@127.0.0.1:{port}");
    let app = RedisStore::connect(&url("app", "app-pass")).await.unwrap();
    let operator = RedisStore::connect(&url("operator", "op-pass"))
        .await
        .unwrap();
    let api = Policy::new("api", ["5/1m".parse().unwrap()]).unwrap();
    let (abuser, other) = (Key::from("abuser"), Key::from("other"));
    assert!(app.check(&abuser, &api, 1).await.unwrap().is_allowed());

    let block = Scope::Key(abuser.clone());
    operator
        .overrides()
        .set(&api, &block, &Override::Block)
        .await
        .unwrap();
    operator
        .overrides()
        .set(
            &api,
            &Scope::All,
            &Override::Limits(vec!["2/1m".parse().unwrap()]),
        )
        .await
        .unwrap();
    // Another instance's overrides are followed within 250 ms (`docs/promises.md`).
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    let blocked = app.check(&abuser, &api, 1).await.unwrap();
    assert!(!blocked.is_allowed() && blocked.limit() == 0, "{blocked:?}");
    let decided = app.check(&other, &api, 1).await.unwrap();
    assert_eq!(decided.limit(), 2, "the operator's policy override");

    for scope in [block.clone(), Scope::All] {
        let refused = app.overrides().remove(&api, &scope).await.unwrap_err();
        assert!(chain(&refused).contains("NOPERM"), "{refused:?}");
    }
    let raise = Override::Limits(vec!["500/1m".parse().unwrap()]);
    let refused = app.overrides().set(&api, &block, &raise).await.unwrap_err();
    assert!(chain(&refused).contains("NOPERM"), "{refused:?}");
    assert_eq!(
        operator.overrides().get(&api, &block).await.unwrap(),
        Some(Override::Block),
        "nothing written"
    );
}

/// An error and its causes, as a user prints them (each cause is the `source` of the one
/// before, not part of its message).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(error) = cause {
        text = format!("{text}: {error}");
        cause = error.source();
    }
    text
}
