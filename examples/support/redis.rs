//! Redis for the load examples: a scratch server or cluster of their own, and what Redis did,
//! summed over every primary of a cluster.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fred::prelude::{Client, ClientLike, Config};
use fred::types::InfoKind;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// `redis-server` processes of this run (`$REDIS_SERVER` or `redis-server` from `PATH`) on
/// free loopback ports, killed and their files removed when dropped.
pub struct Scratch {
    children: Vec<Child>,
    ports: Vec<u16>,
    dir: Option<PathBuf>,
}

impl Scratch {
    /// One server, or with `primaries` above 0 a Redis Cluster of that many primaries (slots
    /// assigned by `redis-cli --cluster create`, which `redis-tools` installs).
    pub fn start(primaries: usize) -> Result<Scratch, Error> {
        let mut scratch = Scratch {
            children: Vec::new(),
            ports: Vec::new(),
            dir: None,
        };
        if primaries == 0 {
            scratch.spawn(&[])?;
            return Ok(scratch);
        }
        let dir = std::env::temp_dir().join(format!("rl-load-cluster-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        scratch.dir = Some(dir.clone());
        for i in 0..primaries {
            let conf = format!("nodes-{i}.conf");
            let dir = dir.to_string_lossy();
            scratch.spawn(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &conf,
                "--dir",
                &dir,
            ])?;
        }
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(scratch.ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .map_err(|e| format!("redis-cli (from redis-tools) creates the cluster: {e}"))?;
        if !created.status.success() {
            let out = String::from_utf8_lossy(&created.stdout);
            return Err(format!("redis-cli --cluster create failed: {out}").into());
        }
        scratch.wait_until_ok()?;
        Ok(scratch)
    }

    /// Runs every server at niceness `nice` (`renice`; a negative one needs the right to raise
    /// a priority). Used by `http_load` only, of the examples that share this file.
    #[allow(dead_code)]
    pub fn renice(&self, nice: i32) -> Result<(), Error> {
        for child in &self.children {
            let status = Command::new("renice")
                .args(["-n", &nice.to_string(), "-p", &child.id().to_string()])
                .stdout(Stdio::null())
                .status()
                .map_err(|e| format!("renice: {e}"))?;
            if !status.success() {
                return Err(format!("renice -n {nice} of redis-server failed").into());
            }
        }
        Ok(())
    }

    /// fred's URL: `redis://` for one server, `redis-cluster://` with every node for a cluster.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        match self.dir {
            None => format!("redis://{}", nodes[0]),
            Some(_) => {
                let rest: Vec<String> = nodes[1..].iter().map(|n| format!("node={n}")).collect();
                format!("redis-cluster://{}?{}", nodes[0], rest.join("&"))
            }
        }
    }

    fn spawn(&mut self, extra: &[&str]) -> Result<(), Error> {
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let mut child = Command::new(&binary)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start {binary}: {e}; install redis-server"))?;
            if wait_until_up(&mut child, port) {
                self.children.push(child);
                self.ports.push(port);
                return Ok(());
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        Err("redis-server did not come up on a free port".into())
    }

    /// Waits until every node reports `cluster_state:ok`.
    fn wait_until_ok(&self) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(20);
        for port in &self.ports {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &port.to_string(), "cluster", "info"])
                    .output()?;
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err("the cluster did not become ok within 20 s".into());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }
}

/// Whether the server accepts connections within 10 s (not if it exited, e.g. because the
/// port was taken meanwhile).
fn wait_until_up(child: &mut Child, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A client for the harness's own commands, which in a cluster go to every primary.
pub struct Admin {
    client: Client,
}

impl Admin {
    pub async fn connect(url: &str) -> Result<Admin, Error> {
        let client = Client::new(Config::from_url(url)?, None, None, None);
        client.init().await?;
        Ok(Admin { client })
    }

    /// How many servers answer `info`: the primaries of a cluster, or the one server.
    pub fn servers(&self) -> usize {
        self.client.active_connections().len().max(1)
    }

    /// Deletes every key, on every primary.
    pub async fn flush(&self) -> Result<(), Error> {
        match self.client.is_clustered() {
            true => self.client.flushall_cluster().await?,
            false => self.client.flushall::<()>(false).await?,
        }
        Ok(())
    }

    /// `INFO <kind>` of every primary (of the one server outside a cluster).
    pub async fn info(&self, kind: InfoKind) -> Result<Vec<String>, Error> {
        if !self.client.is_clustered() {
            return Ok(vec![self.client.info(Some(kind)).await?]);
        }
        let mut texts = Vec::new();
        for server in self.client.active_connections() {
            let node = self.client.with_cluster_node(server);
            texts.push(node.info(Some(kind.clone())).await?);
        }
        Ok(texts)
    }
}
