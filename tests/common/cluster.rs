//! A Redis Cluster of real `redis-server` processes: primaries on free loopback ports, slots
//! assigned by `redis-cli --cluster create`, stopped (and their files removed) on drop.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::RedisServer;

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
}

static CLUSTERS: AtomicUsize = AtomicUsize::new(0);

impl RedisCluster {
    pub fn start(primaries: usize) -> RedisCluster {
        let n = CLUSTERS.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("rl-cluster-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir_arg = dir.to_str().unwrap().to_owned();
        let nodes: Vec<RedisServer> = (0..primaries)
            .map(|i| {
                let conf = format!("nodes-{i}.conf");
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--dir",
                    &dir_arg,
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli (from redis-tools) is needed to create a cluster");
        assert!(
            created.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        let cluster = RedisCluster { nodes, dir };
        cluster.wait_until_ok();
        cluster
    }

    fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &self.nodes {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &node.port().to_string(), "cluster", "info"])
                    .output()
                    .unwrap();
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster did not become ok");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// fred's URL for a cluster: one node, and the others as `node=` parameters.
    pub fn url(&self) -> String {
        let mut nodes = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port()));
        let first = nodes.next().unwrap();
        let rest: Vec<String> = nodes.map(|n| format!("node={n}")).collect();
        format!("redis-cluster://{first}?{}", rest.join("&"))
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
