//! Test harness: real `redis-server` processes on free loopback ports, stopped on drop.
#![allow(dead_code)]

pub mod cluster;
pub mod conformance;
pub mod delay;
pub mod gateway;
pub mod http;
pub mod load;
pub mod log;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod monitor;
pub mod outage;
pub mod proxy;
pub mod scenarios;
pub mod seeded;
pub mod sentinel;
pub mod time;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fred::prelude::*;
use tower_redis_ratelimit::{Algorithm, RedisStore};

/// Every algorithm, for scenarios that run on each.
pub const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::SlidingLog,
    Algorithm::SlidingWindow,
    Algorithm::FixedWindow,
    Algorithm::Gcra,
];

/// A `redis-server` child process, killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    args: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port (the binary is `$REDIS_SERVER` or `redis-server`).
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts a server with extra command-line arguments, e.g. `["--requirepass", "s3cret"]`;
    /// `{port}` in an argument stands for the server's port.
    pub fn start_with(args: &[&str]) -> RedisServer {
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                args: args.iter().map(|a| a.to_string()).collect(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server did not come up on a free port");
    }

    fn spawn(&mut self) -> bool {
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&binary)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(
                self.args
                    .iter()
                    .map(|a| a.replace("{port}", &self.port.to_string())),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}; install redis-server"));
        self.child = Some(child);
        self.wait_until_up()
    }

    /// Kills the server (as a crash would: no shutdown).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(Instant::now() < deadline, "redis-server did not restart");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends `signal` to the server's process, e.g. `-STOP` to pause it and `-CONT` to let it
    /// go on.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("a running server").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    fn wait_until_up(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let exited = self.child.as_mut().map(|c| c.try_wait());
            if let Some(Ok(Some(_))) = exited {
                return false; // exited, e.g. the port was taken meanwhile
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                // The server listening is this one, not another test's that took the port
                // first (this one then fails to bind and exits). A server that does not say
                // its process id (another test's, going away) is taken for this one only if
                // this one is still running a moment later: one that lost the port has
                // exited by then.
                if !self.answers_as_itself() {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(20));
                let exited = self.child.as_mut().map(|c| c.try_wait());
                return !matches!(exited, Some(Ok(Some(_))));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Whether the server on this port is this child: false only when it answers with
    /// another process id (a server that wants a password or TLS does not say, and is
    /// taken to be this one).
    fn answers_as_itself(&self) -> bool {
        let Some(child) = &self.child else {
            return false;
        };
        let port = self.port.to_string();
        let info = Command::new("redis-cli")
            .args(["-p", &port, "info", "server"])
            .output();
        let Ok(info) = info else {
            return true;
        };
        let text = String::from_utf8_lossy(&info.stdout);
        let reported = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("process_id:"));
        reported.is_none_or(|pid| pid == child.id().to_string())
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A store connected to this server.
    pub async fn store(&self) -> RedisStore {
        RedisStore::connect(&self.url())
            .await
            .expect("connect store")
    }

    /// A store connected to this server that runs the full scripts alone
    /// (`RedisStoreBuilder::plain_scripts(false)`).
    pub async fn full_scripts_store(&self) -> RedisStore {
        RedisStore::builder(self.url())
            .plain_scripts(false)
            .connect()
            .await
            .expect("connect store")
    }

    /// A plain fred client, to inspect what the store wrote.
    pub async fn client(&self) -> Client {
        client(&self.url()).await
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A store at `url` whose decisions fail past `budget`, with a short breaker interval (200 ms),
/// so that it tries Redis again soon after an outage.
pub async fn store_within(url: String, budget: Duration) -> RedisStore {
    RedisStore::builder(url)
        .timeout(budget)
        .retry_interval(Duration::from_millis(200))
        .connect()
        .await
        .expect("connect store")
}

/// A plain fred client for `url`.
pub async fn client(url: &str) -> Client {
    let client = Client::new(Config::from_url(url).unwrap(), None, None, None);
    client.init().await.expect("connect client");
    client
}

/// How many `EVALSHA` commands the server behind `client` has run (`INFO commandstats`).
pub async fn evalsha_calls(client: &Client) -> u64 {
    command_calls(client, "evalsha").await
}

/// How many times the server behind `client` has run `command` (lower case), scripts' calls
/// included (`INFO commandstats`).
pub async fn command_calls(client: &Client, command: &str) -> u64 {
    let info: String = client
        .info(Some(fred::types::InfoKind::CommandStats))
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Collects what `tracing` events print, to check what an operator would see in the logs.
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    /// A subscriber that writes into this capture.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        keep_call_sites_open();
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// While one dispatcher is registered in the process, `tracing` decides whether a call site is
/// wanted from the default subscriber of the thread that reaches it first, and caches that: a
/// test with no subscriber reaching a call site first, on another thread, while one test
/// captures, turns the call site off for the capture. A second dispatcher, kept for the whole
/// process, makes `tracing` ask every registered one instead.
fn keep_call_sites_open() {
    static KEPT: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    KEPT.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Whether a test holding [`one_at_a_time`]'s guard runs now.
static RUNNING_ALONE: Mutex<bool> = Mutex::new(false);
static DONE_ALONE: Condvar = Condvar::new();

/// Waits until no other test holding this guard runs, then runs the caller alone among them
/// until the guard is dropped. For the tests of a binary that read what the whole process logs
/// or records; each of them takes it first.
pub fn one_at_a_time() -> Alone {
    let mut running = RUNNING_ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    while *running {
        running = DONE_ALONE
            .wait(running)
            .unwrap_or_else(PoisonError::into_inner);
    }
    *running = true;
    Alone(())
}

/// The guard of [`one_at_a_time`].
pub struct Alone(());

impl Drop for Alone {
    fn drop(&mut self) {
        *RUNNING_ALONE.lock().unwrap_or_else(PoisonError::into_inner) = false;
        DONE_ALONE.notify_one();
    }
}
