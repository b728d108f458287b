//! TLS to Redis: a `redis-server` that only speaks TLS, with a private CA made for the test.
#![cfg(feature = "tls")]

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use crate::support::RedisServer;
use fred::types::config::TlsConnector;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl is needed to make test certificates");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a server certificate for 127.0.0.1 signed by it.
fn certificates(dir: &Path) {
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=rate-limit test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ],
    );
}

#[tokio::test]
async fn rediss_with_a_private_ca() {
    let dir = std::env::temp_dir().join(format!("rl-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let file = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let server = RedisServer::start_with(&[
        "--port",
        "0",
        "--tls-port",
        "{port}",
        "--tls-cert-file",
        &file("server.crt"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.crt"),
        "--tls-auth-clients",
        "no",
    ]);
    let url = format!("rediss://127.0.0.1:{}", server.port());

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let store = RedisStore::builder(&url)
        .tls(TlsConnector::from(config))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "1/1m".parse().unwrap();
    assert!(store
        .check(&Key::from("k"), &policy, 1)
        .await
        .unwrap()
        .is_allowed());
    assert!(!store
        .check(&Key::from("k"), &policy, 1)
        .await
        .unwrap()
        .is_allowed());

    // Plain TCP to a TLS-only port gets no decision.
    let plain = RedisStore::builder(format!("redis://127.0.0.1:{}", server.port()))
        .connect()
        .await;
    assert!(plain.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
