//! Serving apps on loopback and sending them requests.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// What a client sees of a response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

/// Serves `app` on a free loopback port, with axum's `ConnectInfo<SocketAddr>` when
/// `connect_info` is set. The server runs until the test's runtime stops.
pub async fn serve_axum(app: axum::Router, connect_info: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        if connect_info {
            let make = app.into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(listener, make).await.unwrap();
        } else {
            axum::serve(listener, app).await.unwrap();
        }
    });
    addr
}

/// `GET http://{addr}{path}`.
pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let request = Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    let response = client.request(request).await.expect("request");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}
