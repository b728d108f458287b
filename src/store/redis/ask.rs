//! The client side of an `ASK` redirection, for script calls on a slot that is moving between
//! two primaries of a Redis Cluster.
//!
//! While a slot migrates, its old owner answers a command whose keys it no longer holds with
//! `ASK <slot> <host:port>`: the client must then send `ASKING` and the command to that node,
//! on one connection with nothing in between. fred 10.1 does not (it sends `ASKING` to the new
//! node, then the command to the old one again), and past two redirections its connection task
//! stops for good; with `max_redirections` at 0 it answers `Too many redirections.` instead,
//! without the node the `ASK` named. [`call_asking`] finds that node and sends the call there.
//!
//! fred answers a `MOVED` the same way (after refreshing its view of the cluster), so that
//! error alone does not say whether the key has left its owner. A slot moved while this
//! instance was idle (`MOVED` from the old owner), and now moving on to a third node, would
//! otherwise have its call sent with `ASKING` to the third node while the key is still on the
//! owner: the script would make a second, fresh copy of the key there (a client admitted
//! afresh, and the operator's `MIGRATE` refused with `BUSYKEY`). So the call first goes to
//! the owner itself, the node whose `CLUSTER NODES` says it migrates the slot: it runs there
//! while the owner holds the keys, and only the owner's own redirection sends it on.

use bytes::Bytes;
use fred::clients::{Client, Pipeline};
use fred::error::{Error, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::config::{Options, Server, ServerConfig};
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, Key, Value};

/// The message of the error [`call_asking`] returns when the slot's owner migrates it nowhere.
pub(super) const NO_MIGRATION: &str = "no migration of the slot under way";

/// Whether `error` is fred's answer to a redirection it did not follow (see the module's
/// documentation): an `ASK`, or a `MOVED` after which fred has already refreshed its view of
/// the cluster.
pub(super) fn is_unfollowed_redirection(error: &Error) -> bool {
    *error.kind() == ErrorKind::Routing && error.details() == "Too many redirections."
}

/// Runs `script` with `keys` and `args` where the slot's keys are while `slot` moves: on the
/// owner while it holds them, else on the primary that imports the slot, after `ASKING`
/// (what a client does on `ASK`). Asks the slot's owner, as the client's routing table has it
/// (fred refreshes it on `MOVED`), which node it migrates the slot to (`CLUSTER NODES`);
/// fails with [`NO_MIGRATION`] when it migrates it nowhere (the move has ended, or the table
/// is out of date: send the call again as usual). The call then goes to that owner, directly:
/// only if the owner redirects it too (its keys are gone) does it go to the importing node.
/// The script is loaded on a node that lacks it.
pub(super) async fn call_asking(
    client: &Client,
    slot: u16,
    script: &Script,
    keys: Vec<Key>,
    args: Bytes,
) -> Result<Bytes, Error> {
    let nodes: String = client
        .custom(
            CustomCommand::new_static("CLUSTER", ClusterHash::Custom(slot), false),
            vec!["NODES"],
        )
        .await?;
    let Some((owner, target)) = migration(&nodes, slot) else {
        let message = format!("{NO_MIGRATION} (slot {slot})");
        return Err(Error::new(ErrorKind::Routing, message));
    };
    let evalsha = super::batch::evalsha_args(script, keys, args);
    match run_on(client, &owner, script, evalsha.clone(), false).await {
        Err(error) if is_unfollowed_redirection(&error) => {
            run_on(client, &target, script, evalsha, true).await
        }
        reply => reply,
    }
}

/// Sends `EVALSHA` (`evalsha`: its arguments) to `node`, after `ASKING` if `asking`, over a
/// connection of the client's own to it when it has one (the node holds slots), otherwise one
/// of its own, for this call only.
async fn run_on(
    client: &Client,
    node: &Target,
    script: &Script,
    evalsha: Vec<Value>,
    asking: bool,
) -> Result<Bytes, Error> {
    let known = client
        .active_connections()
        .into_iter()
        .find(|server| node.is(server));
    match known {
        Some(server) => on_node(client, Some(server), script, evalsha, asking).await,
        None => {
            let mut config = client.client_config();
            config.server = ServerConfig::Centralized {
                server: node.server(),
            };
            let dedicated = Dedicated(fred::types::Builder::from_config(config).build()?);
            dedicated.0.init().await?;
            on_node(&dedicated.0, None, script, evalsha, asking).await
        }
    }
}

/// A client of its own for one call, shut down when dropped, even if the call is.
struct Dedicated(Client);

impl Drop for Dedicated {
    fn drop(&mut self) {
        let client = self.0.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { client.quit().await });
        }
    }
}

/// Sends `ASKING` (if `asking`) then `EVALSHA` (`evalsha`: its arguments) as one pipeline to
/// `server` (to the only node of a client connected to one node: `None`), loading the script
/// there first and sending the pipeline again if the node lacks it.
///
/// fred's router writes the commands of a pipeline one after the other, before it takes up any
/// other command, so nothing comes between them on the connection. A redirection of the
/// `EVALSHA` is not followed (it would not go to this node again): it comes back as an error.
async fn on_node(
    client: &Client,
    server: Option<Server>,
    script: &Script,
    evalsha: Vec<Value>,
    asking: bool,
) -> Result<Bytes, Error> {
    let options = Options {
        cluster_node: server,
        max_redirections: Some(0),
        ..Options::default()
    };
    let node = client.with_options(&options);
    let command = |name: &'static str| CustomCommand::new_static(name, ClusterHash::Random, false);
    let mut loaded = false;
    loop {
        let pipeline = Pipeline::from(node.clone());
        if asking {
            pipeline
                .custom::<(), _>(command("ASKING"), Vec::<Value>::new())
                .await?;
        }
        pipeline
            .custom::<(), _>(command("EVALSHA"), evalsha.clone())
            .await?;
        let mut replies = pipeline.try_all::<Value>().await.into_iter();
        // Without ASKING, the EVALSHA's reply stands in for it.
        let first = match asking {
            true => replies.next(),
            false => Some(Ok(Value::Null)),
        };
        let reply = replies.next();
        match (first, reply) {
            (Some(Err(error)), _) => return Err(error),
            (Some(Ok(_)), Some(Err(error)))
                if !loaded && error.details().starts_with("NOSCRIPT") =>
            {
                let Some(lua) = script.lua() else {
                    return Err(error);
                };
                node.custom::<Value, _>(
                    command("SCRIPT"),
                    vec![Value::from("LOAD"), Value::from(lua.clone())],
                )
                .await?;
                loaded = true;
            }
            (Some(Ok(_)), Some(reply)) => return reply?.convert(),
            _ => {
                let message = "no reply to EVALSHA";
                return Err(Error::new(ErrorKind::Protocol, message));
            }
        }
    }
}

/// The node a slot migrates to, from its owner's `CLUSTER NODES`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    ip: String,
    port: u16,
    hostname: Option<String>,
}

impl Target {
    /// Whether fred's `server` is this node, by IP address or by host name.
    fn is(&self, server: &Server) -> bool {
        server.port == self.port
            && (*server.host == *self.ip || self.hostname.as_deref() == Some(&*server.host))
    }

    /// Where to connect to it: its host name if it announces one, else its IP address.
    fn server(&self) -> Server {
        let host = self.hostname.as_deref().unwrap_or(&self.ip);
        Server::new(host, self.port)
    }
}

/// Reads, in `CLUSTER NODES` of the node that owns `slot` (only a node's own line shows its
/// migrations), that node's address and the node it migrates `slot` to (`[<slot>->-<id>]`).
/// `None` without such a migration, or if the text is not as expected.
fn migration(nodes: &str, slot: u16) -> Option<(Target, Target)> {
    let marker = format!("[{slot}->-");
    let (owner, target_id) = nodes.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let _id = fields.next()?;
        let address = fields.next()?;
        let flags = fields.next()?;
        if !flags.split(',').any(|flag| flag == "myself") {
            return None;
        }
        let target_id = fields.find_map(|field| {
            field
                .strip_prefix(marker.as_str())?
                .strip_suffix(']')
                .map(str::to_owned)
        })?;
        Some((address, target_id))
    })?;
    let target = nodes.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        if fields.next()? != target_id {
            return None;
        }
        address(fields.next()?)
    })?;
    Some((address(owner)?, target))
}

/// The node at `field` of a `CLUSTER NODES` line: `ip:port@cport[,hostname]`.
fn address(field: &str) -> Option<Target> {
    // An IPv6 address holds colons too, the port follows the last.
    let (address, hostname) = match field.split_once(',') {
        Some((address, hostname)) => (address, Some(hostname)),
        None => (field, None),
    };
    let address = address.split('@').next()?;
    let (ip, port) = address.rsplit_once(':')?;
    let ip = ip.trim_start_matches('[').trim_end_matches(']');
    if ip.is_empty() {
        return None;
    }
    Some(Target {
        ip: ip.to_owned(),
        port: port.parse().ok().filter(|&port| port != 0)?,
        hostname: hostname.filter(|h| !h.is_empty()).map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIGRATING: &str = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003,node-3.example master - 0 1426238318243 3 connected 10923-16383
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 [93->-292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f] [77->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1] [1002-<-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1]
";

    fn target_of(nodes: &str, slot: u16) -> Option<Target> {
        migration(nodes, slot).map(|(_, target)| target)
    }

    #[test]
    fn finds_the_owner_of_a_migrating_slot() {
        let (owner, _) = migration(MIGRATING, 77).unwrap();
        assert_eq!(
            owner,
            Target {
                ip: "127.0.0.1".into(),
                port: 30001,
                hostname: None,
            }
        );
        assert_eq!(migration(MIGRATING, 1002), None);
    }

    #[test]
    fn finds_the_node_a_slot_migrates_to() {
        assert_eq!(
            target_of(MIGRATING, 77),
            Some(Target {
                ip: "127.0.0.1".into(),
                port: 30002,
                hostname: None,
            })
        );
        let target = target_of(MIGRATING, 93).unwrap();
        assert_eq!(
            target,
            Target {
                ip: "127.0.0.1".into(),
                port: 30003,
                hostname: Some("node-3.example".into()),
            }
        );
        assert!(target.is(&Server::new("127.0.0.1", 30003)));
        assert!(target.is(&Server::new("node-3.example", 30003)));
        assert!(!target.is(&Server::new("127.0.0.1", 30002)));
        assert_eq!(target.server(), Server::new("node-3.example", 30003));
    }

    #[test]
    fn no_target_without_a_migrating_marker_on_its_own_line() {
        // Importing, not migrating; a slot in a range; a prefix of a marked slot.
        assert_eq!(target_of(MIGRATING, 1002), None);
        assert_eq!(target_of(MIGRATING, 100), None);
        assert_eq!(target_of(MIGRATING, 9), None);
        // Another node's line: only the owner's own line counts.
        let seen_elsewhere = MIGRATING.replace("myself,master", "master");
        assert_eq!(target_of(&seen_elsewhere, 77), None);
        // The target is missing from the list, or its address is unreadable.
        let unknown = MIGRATING.replace("[77->-67ed", "[77->-ffff");
        assert_eq!(target_of(&unknown, 77), None);
        let no_port = MIGRATING.replace("127.0.0.1:30002@31002", ":0@0");
        assert_eq!(target_of(&no_port, 77), None);
        assert_eq!(target_of("", 77), None);
        assert_eq!(target_of("garbage\n\n", 77), None);
    }

    #[test]
    fn reads_ipv6_addresses() {
        let nodes = "\
a ::1:7000@17000 myself,master - 0 0 1 connected 0-100 [5->-b]
b [::1]:7001@17001 master - 0 0 2 connected 101-200
";
        let target = target_of(nodes, 5).unwrap();
        assert_eq!((target.ip.as_str(), target.port), ("::1", 7001));
    }

    #[test]
    fn recognises_fred_s_error_for_an_unfollowed_redirection() {
        let error = Error::new(ErrorKind::Routing, "Too many redirections.");
        assert!(is_unfollowed_redirection(&error));
        let other = Error::new(ErrorKind::Routing, "Max attempts reached.");
        assert!(!is_unfollowed_redirection(&other));
    }
}
