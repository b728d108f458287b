//! Rate-limit rules kept in a TOML file and reloaded while the server runs: on change (the
//! file is read every second) and on `SIGHUP`.
//!
//! ```text
//! cargo run --features config --example reload_rules             # a demonstration
//! cargo run --features config --example reload_rules -- rules.toml  # serve on BIND
//! ```
//!
//! With no argument it writes a rules file into a temporary folder, serves an app limited by
//! it on a free loopback port, and edits the file while sending requests: a raise, a broken
//! file (refused, the rules in force stay) and a fix, printing what each request got. With a
//! file it serves `BIND` (default `127.0.0.1:3000`) until stopped; edit the file, or send
//! `kill -HUP <pid>`, and the log says what was applied or why the file was refused. A change
//! is applied once the file has stayed the same for a second; to replace it in one step,
//! write the new rules beside it and rename them over it (`mv rules.toml.tmp rules.toml`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use tower_redis_ratelimit::{RateLimitLayer, RuleTable, Rules};

type Error = Box<dyn std::error::Error + Send + Sync>;

const RULES: &str = r#"# Rate-limit rules; see the `config` module of tower-redis-ratelimit.
[default]
name = "api"
limits = "3/1m"

[[rule]]
name = "login"
limits = "2/1m"
method = "POST"
path = "/login"
"#;

#[tokio::main]
async fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_target(false)
        .with_max_level(tracing::Level::INFO)
        .init();
    let (path, demo) = match std::env::args_os().nth(1) {
        Some(path) => (PathBuf::from(path), false),
        None => {
            let dir = std::env::temp_dir().join(format!("reload-rules-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let path = dir.join("rules.toml");
            std::fs::write(&path, RULES)?;
            (path, true)
        }
    };
    let rules = Rules::from_toml(&std::fs::read_to_string(&path)?)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let layer = RateLimitLayer::builder().rules(rules).build()?;
    let table = layer.rule_table();
    let every = if demo {
        Duration::from_millis(100)
    } else {
        Duration::from_secs(1)
    };
    table.watch_file(path.clone(), every);
    reload_on_sighup(table.clone(), path.clone());

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/login", axum::routing::post(|| async { "welcome\n" }))
        .layer(layer.clone());
    let bind = if demo {
        "127.0.0.1:0".to_owned()
    } else {
        std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into())
    };
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    println!("serving http://{addr} with the rules in {}", path.display());
    let server = tokio::spawn(async move {
        let make = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, make).await
    });
    if !demo {
        server.await??;
        return Ok(());
    }
    demonstrate(addr, &path, &layer).await?;
    std::fs::remove_dir_all(path.parent().unwrap_or(&path))?;
    Ok(())
}

/// Reloads the file on `SIGHUP`, printing the outcome.
fn reload_on_sighup(table: RuleTable, path: PathBuf) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hangups) = signal(SignalKind::hangup()) else {
            return;
        };
        while hangups.recv().await.is_some() {
            match table.load_file(&path) {
                Ok(()) => {
                    let policies: Vec<String> = table
                        .policies()
                        .iter()
                        .map(|p| {
                            let limits: Vec<String> =
                                p.limits().iter().map(ToString::to_string).collect();
                            format!("{} {}", p.name(), limits.join(" + "))
                        })
                        .collect();
                    println!("SIGHUP: applied {}", policies.join(", "));
                }
                Err(error) => println!("SIGHUP: refused, the rules in force stay: {error}"),
            }
        }
    });
    #[cfg(not(unix))]
    let _ = (table, path);
}

/// Sends `n` requests to `/` and prints their statuses.
async fn burst(addr: SocketAddr, n: usize, when: &str) -> Result<Vec<u16>, Error> {
    let client = reqwest_like::Client::new(addr);
    let mut statuses = Vec::new();
    for _ in 0..n {
        statuses.push(client.get("/").await?);
    }
    println!("{when}: {n} requests to / got {statuses:?}");
    Ok(statuses)
}

/// Waits until the layer's default policy (the last of the policies in force) has `count`,
/// as the watcher applies the file.
async fn applied(layer: &RateLimitLayer, count: u64) {
    for _ in 0..100 {
        let policies = layer.rule_table().policies();
        if policies
            .last()
            .is_some_and(|p| p.limits()[0].count() == count)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the rules file was not applied within 5 s");
}

/// Writes `text` beside `path`, then renames it over `path`: a rename within one file system
/// is atomic, so the watcher reads the old rules or the new ones, never part of them.
fn replace_file(path: &Path, text: &str) -> std::io::Result<()> {
    let temporary = path.with_extension("toml.tmp");
    std::fs::write(&temporary, text)?;
    std::fs::rename(&temporary, path)
}

async fn demonstrate(addr: SocketAddr, path: &Path, layer: &RateLimitLayer) -> Result<(), Error> {
    let first = burst(addr, 4, "3/1m").await?;
    assert_eq!(first, [200, 200, 200, 429]);

    replace_file(path, &RULES.replace("3/1m", "5/1m"))?;
    applied(layer, 5).await;
    let raised = burst(addr, 3, "raised to 5/1m (the 3 used still count)").await?;
    assert_eq!(raised, [200, 200, 429]);

    replace_file(path, &RULES.replace("3/1m", "50/1fortnight"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kept = burst(addr, 1, "a broken file: the rules in force stay").await?;
    assert_eq!(kept, [429]);

    replace_file(path, &RULES.replace("3/1m", "6/1m"))?;
    applied(layer, 6).await;
    let fixed = burst(addr, 2, "fixed, 6/1m").await?;
    assert_eq!(fixed, [200, 429]);
    Ok(())
}

/// Just enough of an HTTP client for the demonstration.
mod reqwest_like {
    use std::net::SocketAddr;

    use bytes::Bytes;
    use http_body_util::Empty;
    use hyper_util::client::legacy::{connect::HttpConnector, Client as Hyper};
    use hyper_util::rt::TokioExecutor;

    pub struct Client {
        addr: SocketAddr,
        hyper: Hyper<HttpConnector, Empty<Bytes>>,
    }

    impl Client {
        pub fn new(addr: SocketAddr) -> Self {
            let hyper = Hyper::builder(TokioExecutor::new()).build_http();
            Client { addr, hyper }
        }

        pub async fn get(&self, path: &str) -> Result<u16, super::Error> {
            let uri = format!("http://{}{path}", self.addr).parse()?;
            Ok(self.hyper.get(uri).await?.status().as_u16())
        }
    }
}
