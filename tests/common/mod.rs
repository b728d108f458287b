//! Test harness: real `redis-server` processes on free loopback ports, stopped on drop.
#![allow(dead_code)]

pub mod conformance;
pub mod http;
pub mod scenarios;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fred::prelude::*;
use tower_redis_ratelimit::RedisStore;

/// A `redis-server` child process, killed when dropped.
pub struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    /// Starts a server on a free port (the binary is `$REDIS_SERVER` or `redis-server`).
    pub fn start() -> RedisServer {
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        for _ in 0..5 {
            let port = free_port();
            let child = Command::new(&binary)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {binary}: {e}; install redis-server"));
            let mut server = RedisServer { child, port };
            if server.wait_until_up() {
                return server;
            }
        }
        panic!("redis-server did not come up on a free port");
    }

    fn wait_until_up(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false; // exited, e.g. the port was taken meanwhile
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
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

    /// A plain fred client, to inspect what the store wrote.
    pub async fn client(&self) -> Client {
        let client = Client::new(Config::from_url(&self.url()).unwrap(), None, None, None);
        client.init().await.expect("connect client");
        client
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}
