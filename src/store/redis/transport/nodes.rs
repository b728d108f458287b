//! The store's own routing in a Redis Cluster: a pool of connections per primary, and a hash slot
//! map read from whichever node answers.
//!
//! fred's cluster client keeps one connection to every primary and, whenever one breaks, connects
//! to all of them again at once: while one listed primary does not answer, every command fails, on
//! every hash slot, and a new client cannot connect at all. A rate limiter must go on deciding for
//! the keys that the healthy primaries hold. So the scripts run through [`Nodes`]: each primary has
//! a pool of its own, which reconnects on its own; a primary that is gone fails only the calls for
//! its hash slots. The hash slot map comes from `CLUSTER SLOTS`, asked of every known node at once
//! (the first answer wins), at connect, on a `MOVED`, and after a call that found a node
//! unreachable (its hash slots may have failed over to a replica).
//!
//! Redirections come back as Redis sends them, so they are followed by their kind: `MOVED`
//! updates the map and goes to the new owner; `ASK` sends `ASKING` and the call to the
//! importing node once, leaving the map as it is (see `ask.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::{Duration, Instant};

use fred::clients::{Client, Pool};
use fred::error::{Error, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::cluster::ClusterRouting;
use fred::types::config::{Options, Server, ServerConfig};
use fred::types::scripts::Script;
use fred::types::{Builder, ClusterHash, CustomCommand, FromValue, Key, Value};
use tokio::task::JoinSet;

use super::ask::{self, Redirection};

/// Hash slots in a Redis Cluster.
const HASH_SLOTS: usize = 16_384;

/// A hash slot that no known node serves.
const NONE: u16 = u16::MAX;

/// Redirections one call follows before it reports the last (the batcher may try again).
const MAX_REDIRECTIONS: usize = 3;

/// The shortest time between two refreshes of the hash slot map that calls ask for.
const REFRESH_PACE: Duration = Duration::from_millis(200);

/// Connections to the primaries of a Redis Cluster, and which one serves each hash slot.
pub(crate) struct Nodes {
    /// How to build a node's pool: the store's settings, its server replaced.
    builder: Builder,
    pool_size: usize,
    /// The nodes of the store's URL, asked for the hash slot map when no known node answers.
    seeds: Vec<Server>,
    table: RwLock<HashSlots>,
    /// How long to wait for a node's `CLUSTER SLOTS`.
    patience: Duration,
    /// Set while a refresh is under way.
    refreshing: AtomicBool,
    origin: Instant,
    /// When the last refresh that a call asked for started, in ms after `origin`.
    refreshed: AtomicU64,
}

/// The hash slot map and a pool per node.
#[derive(Default)]
struct HashSlots {
    /// Index in `nodes` of each hash slot's primary, [`NONE`] where none serves it; empty until
    /// the map is first read.
    owners: Vec<u16>,
    /// The hash slots' primaries, and nodes that an `ASK` named.
    nodes: Vec<(Server, Pool)>,
}

impl HashSlots {
    /// The index of `server`'s pool, built (and connecting) if it has none.
    fn node(&mut self, server: &Server, nodes: &Nodes) -> Result<usize, Error> {
        if let Some(i) = self.nodes.iter().position(|(s, _)| s == server) {
            return Ok(i);
        }
        let pool = nodes.pool(server)?;
        self.nodes.push((server.clone(), pool));
        Ok(self.nodes.len() - 1)
    }
}

impl Nodes {
    /// Routing over the cluster whose nodes `builder`'s configuration lists, with `pool_size`
    /// connections per primary; nothing connects yet (see [`refresh`](Self::refresh)).
    pub(crate) fn new(builder: Builder, pool_size: usize, patience: Duration) -> Arc<Nodes> {
        let seeds = match builder.get_config().map(|config| &config.server) {
            Some(ServerConfig::Clustered { hosts, .. }) => hosts.clone(),
            _ => Vec::new(),
        };
        Arc::new(Nodes {
            builder,
            pool_size,
            seeds,
            table: RwLock::new(HashSlots::default()),
            patience,
            refreshing: AtomicBool::new(false),
            origin: Instant::now(),
            refreshed: AtomicU64::new(0),
        })
    }

    /// A pool for `server`, connecting in the background and reconnecting on its own.
    fn pool(&self, server: &Server) -> Result<Pool, Error> {
        let pool = for_node(&self.builder, server, false).build_pool(self.pool_size)?;
        drop(pool.connect_pool());
        Ok(pool)
    }

    fn read(&self) -> RwLockReadGuard<'_, HashSlots> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashSlots> {
        self.table.write().unwrap_or_else(|e| e.into_inner())
    }

    /// A client of the primary that serves `hash_slot`.
    pub(crate) fn client(&self, hash_slot: u16) -> Result<Client, Error> {
        let table = self.read();
        if table.owners.is_empty() {
            // Worded as Redis words a refusal, so that callers know nothing ran.
            let message = "CLUSTERDOWN the cluster's slot map is not known yet";
            return Err(Error::new(ErrorKind::Cluster, message));
        }
        match table.owners.get(usize::from(hash_slot)).copied() {
            Some(i) if i != NONE => Ok(table.nodes[usize::from(i)].1.next_connected().clone()),
            _ => Err(Error::new(
                ErrorKind::Cluster,
                format!("CLUSTERDOWN no node serves slot {hash_slot}"),
            )),
        }
    }

    /// A client of `server`, whose pool is built if there is none yet.
    fn client_at(&self, server: &Server) -> Result<Client, Error> {
        {
            let table = self.read();
            if let Some((_, pool)) = table.nodes.iter().find(|(s, _)| s == server) {
                return Ok(pool.next_connected().clone());
            }
        }
        let mut table = self.write();
        let i = table.node(server, self)?;
        Ok(table.nodes[i].1.next_connected().clone())
    }

    /// Records that `server` now serves `hash_slot` (a `MOVED`), then refreshes the whole map soon:
    /// a hash slot seldom moves alone.
    fn moved(self: &Arc<Self>, hash_slot: u16, server: &Server) {
        {
            let mut table = self.write();
            if let Ok(i) = table.node(server, self) {
                if let Some(owner) = table.owners.get_mut(usize::from(hash_slot)) {
                    *owner = i as u16;
                }
            }
        }
        self.refresh_soon();
    }

    /// Starts a refresh of the hash slot map unless one is under way or started less than
    /// [`REFRESH_PACE`] ago.
    pub(crate) fn refresh_soon(self: &Arc<Self>) {
        let now = self.origin.elapsed().as_millis() as u64;
        let last = self.refreshed.load(Ordering::Relaxed);
        if now < last.saturating_add(REFRESH_PACE.as_millis() as u64) && last != 0 {
            return;
        }
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        self.refreshed.store(now.max(1), Ordering::Relaxed);
        let nodes = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(error) = nodes.refresh().await {
                tracing::debug!(target: "tower_redis_ratelimit", %error, "cluster slot map not refreshed");
            }
            nodes.refreshing.store(false, Ordering::Release);
        });
    }

    /// Reads the hash slot map from the first node to answer `CLUSTER SLOTS`, asking every known
    /// node and every seed at once, and routes by it from now on: new primaries get a pool,
    /// nodes that no longer serve a hash slot lose theirs. Fails if none answers.
    pub(crate) async fn refresh(&self) -> Result<(), Error> {
        let mut asked: Vec<(Server, Option<Client>)> = {
            let table = self.read();
            let known = table.nodes.iter();
            known
                .map(|(server, pool)| (server.clone(), Some(pool.next_connected().clone())))
                .collect()
        };
        for seed in &self.seeds {
            if !asked.iter().any(|(server, _)| server == seed) {
                asked.push((seed.clone(), None));
            }
        }
        let mut questions = JoinSet::new();
        for (server, client) in asked {
            let builder = self.builder.clone();
            let patience = self.patience;
            questions.spawn(async move {
                let map = tokio::time::timeout(patience, hash_slots_of(&server, client, builder));
                match map.await {
                    Ok(reply) => reply,
                    Err(_) => Err(Error::new(ErrorKind::Timeout, "no reply to CLUSTER SLOTS")),
                }
            });
        }
        let mut last = Error::new(ErrorKind::Config, "no cluster node to ask for its slots");
        while let Some(answer) = questions.join_next().await {
            match answer {
                // A node that knows no hash slot (not yet joined, or reset) is no guide.
                Ok(Ok(routing)) if routing.slots().is_empty() => {
                    last = Error::new(ErrorKind::Cluster, "a node knows no slot owner");
                }
                Ok(Ok(routing)) => {
                    self.route(&routing)?;
                    return Ok(());
                }
                Ok(Err(error)) => last = error,
                Err(_) => {}
            }
        }
        Err(last)
    }

    /// Routes by `routing` from now on.
    fn route(&self, routing: &ClusterRouting) -> Result<(), Error> {
        let mut owners = vec![NONE; HASH_SLOTS];
        let mut table = self.write();
        let mut kept = vec![false; table.nodes.len()];
        for range in routing.slots() {
            let i = table.node(&range.primary, self)?;
            if let Some(k) = kept.get_mut(i) {
                *k = true;
            }
            let (start, end) = (usize::from(range.start), usize::from(range.end));
            if let Some(owned) = owners.get_mut(start..=end.min(HASH_SLOTS - 1)) {
                owned.fill(i as u16);
            }
        }
        // Nodes that serve no hash slot now lose their pool; the others keep theirs, renumbered.
        let mut renumber = vec![NONE; table.nodes.len()];
        let mut nodes = Vec::with_capacity(table.nodes.len());
        for (i, node) in std::mem::take(&mut table.nodes).into_iter().enumerate() {
            if kept.get(i).copied().unwrap_or(true) {
                renumber[i] = nodes.len() as u16;
                nodes.push(node);
            } else {
                shut_down(node.1);
            }
        }
        for owner in owners.iter_mut().filter(|owner| **owner != NONE) {
            *owner = renumber[usize::from(*owner)];
        }
        *table = HashSlots { owners, nodes };
        Ok(())
    }

    /// Refreshes the map until a node answers, waiting `retry` between attempts; ends early
    /// when the store is dropped. For a store that connects in the background.
    pub(crate) async fn refresh_until_known(nodes: Weak<Nodes>, retry: Duration) {
        loop {
            let Some(strong) = nodes.upgrade() else {
                return;
            };
            if strong.refresh().await.is_ok() {
                return;
            }
            drop(strong);
            tokio::time::sleep(retry).await;
        }
    }

    /// Runs `script` over `keys` (all of one hash slot) with `argv` where the hash slot's keys are,
    /// following `MOVED` and `ASK`, waiting for each reply up to `patience` (`None`: the
    /// store's timeout). A call that finds a node unreachable asks for a fresh hash slot map.
    pub(crate) async fn evalsha<R: FromValue>(
        self: &Arc<Self>,
        script: &Script,
        keys: Vec<Key>,
        argv: Vec<Value>,
        patience: Option<Duration>,
    ) -> Result<R, Error> {
        let hash_slot = keys
            .first()
            .map_or(0, |key| fred::util::redis_keyslot(key.as_bytes()));
        let evalsha = evalsha_args(script, keys, argv);
        let options = Options {
            timeout: patience,
            ..Options::default()
        };
        let on_owner = |client: Client| {
            let (options, evalsha) = (&options, evalsha.clone());
            async move { evalsha_on(&client, options, script, evalsha, false).await }
        };
        let reply = self.on_owner(hash_slot, on_owner).await;
        match reply.as_ref().err().and_then(ask::redirection) {
            Some(Redirection::Ask(server)) => {
                let target = self.client_at(&server)?;
                evalsha_on(&target, &options, script, evalsha, true).await
            }
            _ => {
                if reply.as_ref().is_err_and(super::health::is_outage) {
                    self.refresh_soon();
                }
                reply
            }
        }
    }

    /// Runs `command` (one command on one key of `hash_slot`) on the primary that holds the hash
    /// slot, following `MOVED`.
    pub(crate) async fn on_owner<R, F, Fut>(
        self: &Arc<Self>,
        hash_slot: u16,
        command: F,
    ) -> Result<R, Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<R, Error>>,
    {
        let mut redirections = 0;
        loop {
            let reply = command(self.client(hash_slot)?).await;
            match reply.as_ref().err().and_then(ask::redirection) {
                Some(Redirection::Moved(moved, server)) if redirections < MAX_REDIRECTIONS => {
                    self.moved(moved, &server);
                    redirections += 1;
                }
                _ => return reply,
            }
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, pool) in std::mem::take(&mut self.write().nodes) {
            shut_down(pool);
        }
    }
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let table = self.read();
        let nodes: Vec<_> = table.nodes.iter().map(|(server, _)| server).collect();
        f.debug_struct("Nodes").field("nodes", &nodes).finish()
    }
}

/// Closes `pool`'s connections in the background.
fn shut_down(pool: Pool) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move { pool.quit().await });
    }
}

/// `server`'s answer to `CLUSTER SLOTS`, through `client` if it has one, else through a
/// client of its own for this question.
async fn hash_slots_of(
    server: &Server,
    client: Option<Client>,
    builder: Builder,
) -> Result<ClusterRouting, Error> {
    let command = CustomCommand::new_static("CLUSTER", ClusterHash::Random, false);
    let ask = |client: Client| async move {
        let map: Value = client.custom(command, vec!["SLOTS"]).await?;
        ClusterRouting::from_cluster_slots(map, server.host.clone())
    };
    if let Some(client) = client {
        return ask(client).await;
    }
    let client = Dedicated(for_node(&builder, server, true).build()?);
    client.0.init().await?;
    ask(client.0.clone()).await
}

/// The store's settings (`builder`) for a client of `server` alone; `fail_fast`: whether its
/// first connection's failure is returned rather than retried.
fn for_node(builder: &Builder, server: &Server, fail_fast: bool) -> Builder {
    let mut config = builder.get_config().cloned().unwrap_or_default();
    config.server = ServerConfig::Centralized {
        server: server.clone(),
    };
    config.fail_fast = fail_fast;
    let mut builder = builder.clone();
    builder.set_config(config);
    builder
}

/// A client of its own for one question, shut down when dropped, also when the question is
/// (another node answered first).
struct Dedicated(Client);

impl Drop for Dedicated {
    fn drop(&mut self) {
        let client = self.0.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { client.quit().await });
        }
    }
}

/// Sends `EVALSHA` (`evalsha`: its arguments) through `client` with `options`, after
/// `ASKING` if `asking`; loads the script and sends it again if the node lacks it.
pub(crate) async fn evalsha_on<R: FromValue>(
    client: &Client,
    options: &Options,
    script: &Script,
    evalsha: Vec<Value>,
    asking: bool,
) -> Result<R, Error> {
    let node = client.with_options(options);
    let reply = match asking {
        true => ask::asking(&node, evalsha.clone()).await,
        false => node.custom::<Value, _>(command(), evalsha.clone()).await,
    };
    let reply = match reply {
        Err(error) if error.details().starts_with("NOSCRIPT") => {
            script.load(client).await?;
            match asking {
                true => ask::asking(&node, evalsha).await,
                false => node.custom::<Value, _>(command(), evalsha).await,
            }
        }
        reply => reply,
    };
    reply?.convert()
}

/// The arguments of `EVALSHA` for `script` over `keys` with `argv`, for a call sent as a
/// command of its own.
pub(crate) fn evalsha_args(script: &Script, keys: Vec<Key>, argv: Vec<Value>) -> Vec<Value> {
    let mut evalsha = Vec::with_capacity(2 + keys.len() + argv.len());
    evalsha.push(Value::from(script.sha1().clone()));
    evalsha.push(Value::from(keys.len() as i64));
    evalsha.extend(keys.into_iter().map(Value::from));
    evalsha.extend(argv);
    evalsha
}

fn command() -> CustomCommand {
    CustomCommand::new_static("EVALSHA", ClusterHash::Random, false)
}
