//! The example admin endpoint (`examples/admin_overrides.rs`): nothing without the bearer token
//! reaches the overrides, and what the operator sends is checked before anything is written.

#[allow(dead_code)]
#[path = "../../examples/admin_overrides.rs"]
mod admin_overrides;

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_redis_ratelimit::store::Scope;
use tower_redis_ratelimit::{Key, MemoryStore, Policy};

async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: &str,
) -> (StatusCode, String) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("x-api-key", "customer-42");
    if let Some(auth) = auth {
        request = request.header("authorization", auth);
    }
    let request = request.body(Body::from(body.to_owned())).unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn only_the_bearer_token_changes_overrides() {
    let store = MemoryStore::new();
    let app = admin_overrides::app(store.clone(), store.overrides(), "s3cret").unwrap();
    let api = Policy::new("api", ["5/1h".parse().unwrap()]).unwrap();
    let key = Scope::Key(Key::from("customer-42"));
    let refused = [
        None,
        Some("Bearer guess"),
        Some("Bearer s3cret2"),
        Some("Bearer s3cre"),
        Some("bearer  s3cret"),
        Some("Basic czNjcmV0"),
        Some("s3cret"),
    ];
    for auth in refused {
        for (method, path) in [
            ("PUT", "/admin/overrides/api/customer-42"),
            ("PUT", "/admin/overrides/api"),
            ("DELETE", "/admin/overrides/api/customer-42"),
            ("GET", "/admin/overrides/api"),
        ] {
            let (status, _) = send(&app, method, path, auth, "50/1h").await;
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} with {auth:?}"
            );
        }
    }
    let overrides = store.overrides();
    assert!(
        overrides.get(&api, &key).await.unwrap().is_none(),
        "nothing written"
    );

    let auth = Some("Bearer s3cret");
    let path = "/admin/overrides/api/customer-42";
    for bad in ["fifty", "50/1d", "0/1h", "50/-1h", "50/1h + 60/1h"] {
        let (status, body) = send(&app, "PUT", path, auth, bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    assert_eq!(
        send(&app, "PUT", "/admin/overrides/nope/x", auth, "5/1h")
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert!(
        overrides.get(&api, &key).await.unwrap().is_none(),
        "nothing written"
    );

    assert_eq!(
        send(&app, "PUT", path, auth, "7/1h").await.0,
        StatusCode::OK
    );
    let statuses =
        futures::future::join_all((0..8).map(|_| send(&app, "GET", "/", None, ""))).await;
    let admitted = statuses
        .iter()
        .filter(|(s, _)| *s == StatusCode::OK)
        .count();
    assert_eq!(admitted, 7, "the customer's override");
    let (status, listed) = send(&app, "GET", "/admin/overrides/api", auth, "").await;
    assert_eq!(
        (status, listed.as_str()),
        (StatusCode::OK, "key:customer-42\t7/1h\n")
    );
}

/// The listing names each scope so that no key is taken for the policy-wide override or a
/// plan's: a key named `*`, `all` or `plan:free` is listed as a key.
#[tokio::test]
async fn the_listing_tells_scopes_apart() {
    let store = MemoryStore::new();
    let app = admin_overrides::app(store.clone(), store.overrides(), "s3cret").unwrap();
    let auth = Some("Bearer s3cret");
    let puts = [
        ("/admin/overrides/api", "20/1h"),
        ("/admin/overrides/api/plans/free", "10/1h"),
        ("/admin/overrides/api/*", "block"),
        ("/admin/overrides/api/all", "30/1h"),
        ("/admin/overrides/api/plan:free", "40/1h"),
    ];
    for (path, body) in puts {
        assert_eq!(
            send(&app, "PUT", path, auth, body).await.0,
            StatusCode::OK,
            "{path}"
        );
    }
    let (status, listed) = send(&app, "GET", "/admin/overrides/api", auth, "").await;
    assert_eq!(status, StatusCode::OK);
    let expected =
        "all\t20/1h\nplan:free\t10/1h\nkey:*\tblock\nkey:all\t30/1h\nkey:plan:free\t40/1h\n";
    assert_eq!(listed, expected);
    let removed = send(&app, "DELETE", "/admin/overrides/api/plans/free", auth, "").await;
    assert_eq!(removed.0, StatusCode::OK);
    let (_, listed) = send(&app, "GET", "/admin/overrides/api", auth, "").await;
    assert!(!listed.contains("\nplan:free\t"), "{listed}");
}
