//! A Redis Cluster of real `redis-server` processes: primaries (and, if asked, replicas) on
//! free loopback ports, slots assigned by `redis-cli --cluster create`, stopped (and their
//! files removed) on drop.
//!
//! Besides starting one, the helpers here change a running cluster the way an operator or a
//! crash would: kill a primary and wait for its replica's promotion, or move a slot to another
//! primary step by step. Every wait polls what the nodes report (`CLUSTER INFO`,
//! `CLUSTER NODES`, `INFO replication`) until a deadline. They are blocking calls: from async
//! code under load, run them in `tokio::task::spawn_blocking`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::RedisServer;

pub struct RedisCluster {
    /// Every node, primaries first (as `redis-cli --cluster create` was given them), then
    /// replicas. A killed node stays in the list, stopped.
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
    /// Indices into `nodes` of the nodes killed by [`kill`](Self::kill).
    dead: Vec<usize>,
}

static CLUSTERS: AtomicUsize = AtomicUsize::new(0);

/// How long the cluster helpers wait for a state before failing the test.
const DEADLINE: Duration = Duration::from_secs(30);

/// A 1 s node timeout, then a cluster that serves the slots it has left.
const FAST_FAILURE: [&str; 4] = [
    "--cluster-node-timeout",
    "1000",
    "--cluster-require-full-coverage",
    "no",
];

/// One line of `CLUSTER NODES`: what a node reports about itself or a peer.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub flags: Vec<String>,
    /// The primary's id for a replica.
    pub primary: Option<String>,
    /// The slots it owns, as inclusive ranges (migration markers left out).
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    pub fn is_primary(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    pub fn is_failed(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?")
    }

    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
    }
}

impl RedisCluster {
    /// `primaries` primaries, no replica, the default node timeout.
    pub fn start(primaries: usize) -> RedisCluster {
        RedisCluster::create(primaries, 0, &[])
    }

    /// `primaries` primaries with `replicas` replicas each, and a 1 s node timeout, so that a
    /// killed primary is marked failed and its replica promoted within a few seconds. Returns
    /// once the cluster is `ok` and every replica is in sync with its primary.
    pub fn start_with_replicas(primaries: usize, replicas: usize) -> RedisCluster {
        let cluster = RedisCluster::create(primaries, replicas, &FAST_FAILURE[..2]);
        cluster.wait_for_replicas();
        cluster
    }

    /// `primaries` primaries with `replicas` replicas each (none: no wait for them), a 1 s
    /// node timeout, and `cluster-require-full-coverage no`: while a killed primary's slots
    /// have no owner, the other primaries go on serving theirs.
    pub fn start_serving_partial(primaries: usize, replicas: usize) -> RedisCluster {
        let cluster = RedisCluster::create(primaries, replicas, &FAST_FAILURE);
        cluster.wait_for_replicas();
        cluster
    }

    /// Starts the nodes and joins them into a cluster. A node's cluster bus listens on its
    /// port plus 10 000, which nothing reserves for it while other tests start servers too:
    /// when `redis-cli --cluster create` fails, the attempt is printed and made again on
    /// fresh nodes.
    fn create(primaries: usize, replicas: usize, extra: &[&str]) -> RedisCluster {
        for attempt in 1..=3 {
            match RedisCluster::try_create(primaries, replicas, extra) {
                Ok(cluster) => return cluster,
                Err(why) => eprintln!("cluster creation, attempt {attempt}: {why}"),
            }
        }
        panic!("redis-cli --cluster create failed three times");
    }

    fn try_create(
        primaries: usize,
        replicas: usize,
        extra: &[&str],
    ) -> Result<RedisCluster, String> {
        let n = CLUSTERS.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("rl-cluster-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir_arg = dir.to_str().unwrap().to_owned();
        let nodes: Vec<RedisServer> = (0..primaries * (1 + replicas))
            .map(|i| {
                let conf = format!("nodes-{i}.conf");
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--dir",
                    &dir_arg,
                ];
                args.extend_from_slice(extra);
                RedisServer::start_with(&args)
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli (from redis-tools) is needed to create a cluster");
        if !created.status.success() {
            // Dropping the half-made cluster stops its nodes and removes its files.
            drop(RedisCluster {
                nodes,
                dir,
                dead: Vec::new(),
            });
            return Err(format!(
                "{}; {}",
                String::from_utf8_lossy(&created.stdout).trim(),
                String::from_utf8_lossy(&created.stderr).trim()
            ));
        }
        let cluster = RedisCluster {
            nodes,
            dir,
            dead: Vec::new(),
        };
        cluster.wait_until_ok();
        Ok(cluster)
    }

    /// Waits until every live node reports `cluster_state:ok` and sees every other live node
    /// as healthy (so that all of them agree on the slots).
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + DEADLINE;
        let live: Vec<usize> = self.live().collect();
        for &i in &live {
            loop {
                let info = self.cli(i, &["cluster", "info"]);
                let known = info
                    .lines()
                    .find_map(|l| l.strip_prefix("cluster_known_nodes:"))
                    .and_then(|n| n.trim().parse::<usize>().ok());
                let healthy = info.contains("cluster_state:ok")
                    && known.is_some_and(|n| n >= live.len())
                    && self
                        .nodes_seen_by(i)
                        .iter()
                        .filter(|n| !self.is_dead_port(n.port))
                        .all(|n| !n.is_failed());
                if healthy {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster did not become ok on node {}: {info}",
                    self.nodes[i].port()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Waits until every replica's link to its primary is up and the initial sync is done.
    pub fn wait_for_replicas(&self) {
        let deadline = Instant::now() + DEADLINE;
        for i in self.live() {
            loop {
                let info = self.cli(i, &["info", "replication"]);
                if info.contains("role:master")
                    || (info.contains("master_link_status:up")
                        && info.contains("master_sync_in_progress:0"))
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "replica {} did not sync: {info}",
                    self.nodes[i].port()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Indices of the nodes not killed.
    pub fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|i| !self.dead.contains(i))
    }

    fn is_dead_port(&self, port: u16) -> bool {
        self.dead.iter().any(|&i| self.nodes[i].port() == port)
    }

    /// The index in `nodes` of the node listening on `port`.
    pub fn index_of_port(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no node on port {port}"))
    }

    /// `redis-cli -p <node> args...`, its output (panics if redis-cli fails to run).
    pub fn cli(&self, node: usize, args: &[&str]) -> String {
        cli(self.nodes[node].port(), args)
    }

    /// `CLUSTER NODES` as node `node` sees the cluster.
    pub fn nodes_seen_by(&self, node: usize) -> Vec<NodeInfo> {
        parse_nodes(&self.cli(node, &["cluster", "nodes"]))
    }

    /// The node's cluster id.
    pub fn id(&self, node: usize) -> String {
        self.cli(node, &["cluster", "myid"]).trim().to_owned()
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn keyslot(&self, key: &str) -> u16 {
        let node = self.live().next().expect("a live node");
        let reply = self.cli(node, &["cluster", "keyslot", key]);
        reply
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("CLUSTER KEYSLOT {key}: {reply}"))
    }

    /// The index of the primary that owns `slot`, as the first live node reports it.
    pub fn owner_of_slot(&self, slot: u16) -> usize {
        let node = self.live().next().expect("a live node");
        let owner = self
            .nodes_seen_by(node)
            .into_iter()
            .find(|n| n.is_primary() && n.owns(slot))
            .unwrap_or_else(|| panic!("no primary owns slot {slot}"));
        self.index_of_port(owner.port)
    }

    /// The index of the primary that holds `key`.
    pub fn owner_of_key(&self, key: &str) -> usize {
        self.owner_of_slot(self.keyslot(key))
    }

    /// Indices of the live primaries.
    pub fn primaries(&self) -> Vec<usize> {
        let node = self.live().next().expect("a live node");
        let mut primaries: Vec<usize> = self
            .nodes_seen_by(node)
            .into_iter()
            .filter(|n| n.is_primary() && !n.is_failed() && !self.is_dead_port(n.port))
            .map(|n| self.index_of_port(n.port))
            .collect();
        primaries.sort_unstable();
        primaries
    }

    /// Sends `signal` to node `node`'s process, e.g. `-STOP` to pause it and `-CONT` to let
    /// it go on.
    pub fn signal(&self, node: usize, signal: &str) {
        self.nodes[node].signal(signal);
    }

    /// Kills node `node` with SIGKILL, as a crash would: no shutdown, no failover handshake.
    pub fn kill(&mut self, node: usize) {
        self.nodes[node].kill();
        self.dead.push(node);
    }

    /// After [`kill`](Self::kill)ing `node`: waits until every live node marks it failed.
    pub fn wait_until_failed(&self, node: usize) {
        let deadline = Instant::now() + DEADLINE;
        let port = self.nodes[node].port();
        loop {
            let failed = self.live().all(|i| {
                self.nodes_seen_by(i)
                    .iter()
                    .any(|n| n.port == port && n.flags.iter().any(|f| f == "fail"))
            });
            if failed {
                return;
            }
            assert!(Instant::now() < deadline, "node {node} never marked failed");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// After [`kill`](Self::kill)ing the primary of `slot`: waits until a live node owns the
    /// slot as a primary, every live node sees it so, and the cluster is `ok` again. Returns
    /// the new owner's index.
    pub fn wait_for_promotion(&self, slot: u16) -> usize {
        let deadline = Instant::now() + DEADLINE;
        let owner = 'found: loop {
            let views: Vec<Option<u16>> = self
                .live()
                .map(|i| {
                    self.nodes_seen_by(i)
                        .into_iter()
                        .find(|n| n.is_primary() && !n.is_failed() && n.owns(slot))
                        .map(|n| n.port)
                        .filter(|&p| !self.is_dead_port(p))
                })
                .collect();
            if let Some(Some(port)) = views.first() {
                if views.iter().all(|v| *v == Some(*port)) {
                    let owner = self.index_of_port(*port);
                    if self.cli(owner, &["role"]).starts_with("master") {
                        break 'found owner;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no replica took over slot {slot}: {views:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        self.wait_until_ok();
        owner
    }

    /// The keys of `slot` on node `node` (`CLUSTER GETKEYSINSLOT`), at most `count`.
    pub fn keys_in_slot(&self, node: usize, slot: u16, count: usize) -> Vec<String> {
        let reply = self.cli(
            node,
            &[
                "cluster",
                "getkeysinslot",
                &slot.to_string(),
                &count.to_string(),
            ],
        );
        reply
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// Starts moving `slot` from primary `from` to primary `to`: `to` imports it, `from`
    /// migrates it. From now on, a command for a key of the slot that `from` no longer holds
    /// is redirected with `ASK`; one over several keys that are split between the two
    /// nodes is refused with `TRYAGAIN`.
    pub fn begin_migration(&self, slot: u16, from: usize, to: usize) {
        let slot = slot.to_string();
        let (from_id, to_id) = (self.id(from), self.id(to));
        let imported = self.cli(to, &["cluster", "setslot", &slot, "importing", &from_id]);
        assert_eq!(imported.trim(), "OK", "SETSLOT IMPORTING: {imported}");
        let migrating = self.cli(from, &["cluster", "setslot", &slot, "migrating", &to_id]);
        assert_eq!(migrating.trim(), "OK", "SETSLOT MIGRATING: {migrating}");
    }

    /// Moves up to `count` keys of `slot` from `from` to `to` with one `MIGRATE ... KEYS`;
    /// returns how many it moved (0 once `from` holds none).
    pub fn migrate_keys(&self, slot: u16, from: usize, to: usize, count: usize) -> usize {
        let keys = self.keys_in_slot(from, slot, count);
        if keys.is_empty() {
            return 0;
        }
        let port = self.nodes[to].port().to_string();
        let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().map(String::as_str));
        let reply = self.cli(from, &args);
        assert_eq!(reply.trim(), "OK", "MIGRATE {keys:?}: {reply}");
        keys.len()
    }

    /// Ends a move of `slot` to `to`: assigns the slot to `to` on `to`, on the node that
    /// gave it up, then on every other primary, and waits until all live nodes agree.
    pub fn finish_migration(&self, slot: u16, from: usize, to: usize) {
        let to_id = self.id(to);
        let slot_arg = slot.to_string();
        let mut order = vec![to, from];
        order.extend(
            self.primaries()
                .into_iter()
                .filter(|p| *p != to && *p != from),
        );
        for node in order {
            let reply = self.cli(node, &["cluster", "setslot", &slot_arg, "node", &to_id]);
            assert_eq!(reply.trim(), "OK", "SETSLOT NODE on {node}: {reply}");
        }
        let deadline = Instant::now() + DEADLINE;
        while !self.live().all(|i| {
            self.nodes_seen_by(i)
                .iter()
                .any(|n| n.id == to_id && n.owns(slot))
        }) {
            assert!(
                Instant::now() < deadline,
                "nodes do not agree that {to_id} owns slot {slot}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Moves the keys of `slot`, migrating from `from` to `to` ([`begin_migration`]), one at a
    /// time, and awaits `between(moved)` after each, `moved` the keys moved so far, so that the
    /// keys stay split between the two nodes while requests run; returns how many moved. Needs
    /// tokio's multi-threaded runtime (each `MIGRATE` blocks in place).
    ///
    /// [`begin_migration`]: Self::begin_migration
    pub async fn migrate_one_at_a_time<F: std::future::Future<Output = ()>>(
        &self,
        slot: u16,
        from: usize,
        to: usize,
        mut between: impl FnMut(usize) -> F,
    ) -> usize {
        let mut moved = 0;
        loop {
            let n = tokio::task::block_in_place(|| self.migrate_keys(slot, from, to, 1));
            if n == 0 {
                return moved;
            }
            moved += n;
            between(moved).await;
        }
    }

    /// Moves `slot` from `from` to `to`, keys in batches of `batch`.
    pub fn move_slot(&self, slot: u16, from: usize, to: usize, batch: usize) {
        self.begin_migration(slot, from, to);
        while self.migrate_keys(slot, from, to, batch) > 0 {}
        self.finish_migration(slot, from, to);
    }

    /// fred's URL for a cluster: one live node, and the others as `node=` parameters.
    pub fn url(&self) -> String {
        let mut nodes = self
            .live()
            .map(|i| format!("127.0.0.1:{}", self.nodes[i].port()));
        let first = nodes.next().unwrap();
        let rest: Vec<String> = nodes.map(|n| format!("node={n}")).collect();
        format!("redis-cluster://{first}?{}", rest.join("&"))
    }
}

/// `redis-cli -p <port> args...`, its output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli (from redis-tools) is needed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Parses `CLUSTER NODES`.
pub fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let address = fields[1].split('@').next()?;
            let port = address.rsplit(':').next()?.parse().ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|a| (a, a)),
                })
                .collect();
            Some(NodeInfo {
                id: fields[0].to_owned(),
                port,
                flags: fields[2].split(',').map(str::to_owned).collect(),
                primary: (fields[3] != "-").then(|| fields[3].to_owned()),
                slots,
            })
        })
        .collect()
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
