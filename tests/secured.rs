//! A Redis that requires credentials: a password, and an ACL user, both from the URL.

mod common;

use common::RedisServer;
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

    let admin = common::client(&admin_url).await;
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

    let without = RedisStore::connect(&server.url())
        .await
        .unwrap_err()
        .to_string();
    assert!(without.contains("NOAUTH"), "{without}");
    let wrong = format!("redis://limiter:wrong@127.0.0.1:{port}");
    let wrong = RedisStore::connect(&wrong).await.unwrap_err().to_string();
    assert!(wrong.contains("WRONGPASS"), "{wrong}");
}
