//! Redis Sentinel of real processes: one primary, one replica (`--replicaof`) and three
//! sentinels that monitor the primary as `mymaster`, each on a free loopback port. Every
//! sentinel writes its own config file in a temporary folder; all processes are killed and
//! the folder removed on drop.
//!
//! Waits poll what the processes report (`INFO replication`, `SENTINEL CKQUORUM`,
//! `SENTINEL get-master-addr-by-name`, `ROLE`) until a deadline. They are blocking calls: from
//! async code under load, run them in `tokio::task::spawn_blocking`.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::cluster::cli;
use super::{free_port, RedisServer};

/// The name the sentinels monitor the primary under.
pub const SERVICE: &str = "mymaster";

/// How long the helpers wait for a state before failing the test.
const DEADLINE: Duration = Duration::from_secs(30);

static GROUPS: AtomicUsize = AtomicUsize::new(0);

/// One `redis-server --sentinel` process, killed when dropped.
pub struct Sentinel {
    child: Option<Child>,
    port: u16,
}

impl Sentinel {
    /// Starts a sentinel on a free port that monitors the primary on `primary` with a quorum
    /// of 2, a 1 s down-after and a 5 s failover timeout; its config file lives in `dir`.
    fn start(dir: &std::path::Path, index: usize, primary: u16) -> Sentinel {
        for _ in 0..5 {
            let port = free_port();
            let conf = dir.join(format!("sentinel-{index}.conf"));
            let text = format!(
                "port {port}\n\
                 bind 127.0.0.1\n\
                 protected-mode no\n\
                 daemonize no\n\
                 dir {dir}\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {SERVICE} 1000\n\
                 sentinel failover-timeout {SERVICE} 5000\n\
                 sentinel parallel-syncs {SERVICE} 1\n",
                dir = dir.display()
            );
            std::fs::write(&conf, text).unwrap();
            let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
            let child = Command::new(&binary)
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {binary} --sentinel: {e}"));
            let mut sentinel = Sentinel {
                child: Some(child),
                port,
            };
            if sentinel.wait_until_up() {
                return sentinel;
            }
            sentinel.kill();
        }
        panic!("redis-sentinel did not come up on a free port");
    }

    fn wait_until_up(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                return false; // exited, e.g. the port was taken meanwhile
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A primary, its replica and three sentinels.
pub struct SentinelGroup {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<Sentinel>,
    dir: PathBuf,
}

impl SentinelGroup {
    /// Starts the group and returns once the replica is in sync and the sentinels know each
    /// other and the replica, and agree they could fail the primary over.
    pub fn start() -> SentinelGroup {
        SentinelGroup::start_with(&[])
    }

    /// [`start`](Self::start), the primary started with extra arguments, e.g.
    /// `["--min-replicas-to-write", "1"]`.
    pub fn start_with(primary_args: &[&str]) -> SentinelGroup {
        let n = GROUPS.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("rl-sentinel-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // The replica writes the RDB of its initial sync in `--dir`: the temporary folder.
        let dir_arg = dir.to_str().unwrap().to_owned();
        let mut args = vec!["--dir", dir_arg.as_str()];
        args.extend_from_slice(primary_args);
        let primary = RedisServer::start_with(&args);
        let port = primary.port().to_string();
        let replica =
            RedisServer::start_with(&["--dir", &dir_arg, "--replicaof", "127.0.0.1", &port]);
        let sentinels = (0..3)
            .map(|i| Sentinel::start(&dir, i, primary.port()))
            .collect();
        let group = SentinelGroup {
            primary,
            replica,
            sentinels,
            dir,
        };
        group.wait_until_ready();
        group
    }

    fn wait_until_ready(&self) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let info = cli(self.replica.port(), &["info", "replication"]);
            if info.contains("master_link_status:up") && info.contains("master_sync_in_progress:0")
            {
                break;
            }
            assert!(Instant::now() < deadline, "replica did not sync: {info}");
            std::thread::sleep(Duration::from_millis(50));
        }
        for sentinel in &self.sentinels {
            loop {
                let port = sentinel.port();
                let quorum = cli(port, &["sentinel", "ckquorum", SERVICE]);
                let peers = cli(port, &["sentinel", "sentinels", SERVICE]);
                let replicas = cli(port, &["sentinel", "replicas", SERVICE]);
                // Two other sentinels, and the replica listed (by its port) and not down.
                let peers_known = peers.lines().filter(|l| *l == "name").count() == 2;
                let replica_known = replicas
                    .lines()
                    .any(|l| l == self.replica.port().to_string())
                    && !replicas.contains("s_down");
                if quorum.starts_with("OK") && peers_known && replica_known {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "sentinel {port} not ready: {quorum} / {} peers / replicas {replicas}",
                    peers.lines().filter(|l| *l == "name").count()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// fred's URL: the sentinels, and the service to ask them about.
    pub fn url(&self) -> String {
        let mut nodes = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()));
        let first = nodes.next().unwrap();
        let rest: Vec<String> = nodes.map(|n| format!("&node={n}")).collect();
        format!(
            "redis-sentinel://{first}?sentinelServiceName={SERVICE}{}",
            rest.concat()
        )
    }

    /// The primary's port as sentinel `index` reports it.
    pub fn primary_port_seen_by(&self, index: usize) -> Option<u16> {
        let reply = cli(
            self.sentinels[index].port(),
            &["sentinel", "get-master-addr-by-name", SERVICE],
        );
        reply.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }

    /// Kills the primary with SIGKILL, as a crash would.
    pub fn kill_primary(&mut self) {
        self.primary.kill();
    }

    /// After [`kill_primary`](Self::kill_primary): waits until every sentinel names the
    /// replica as the primary and the replica says it is one.
    pub fn wait_for_promotion(&self) {
        let deadline = Instant::now() + DEADLINE;
        let replica = self.replica.port();
        loop {
            let seen: Vec<Option<u16>> = (0..self.sentinels.len())
                .map(|i| self.primary_port_seen_by(i))
                .collect();
            if seen.iter().all(|p| *p == Some(replica))
                && cli(replica, &["role"]).starts_with("master")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replica was not promoted: sentinels name {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for SentinelGroup {
    fn drop(&mut self) {
        for sentinel in &mut self.sentinels {
            sentinel.kill();
        }
        self.replica.kill();
        self.primary.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
