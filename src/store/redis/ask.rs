//! The client side of an `ASK` redirection, for script calls on a slot that is moving between
//! two primaries of a Redis Cluster.
//!
//! While a slot migrates, its old owner answers a command whose keys it no longer holds with
//! `ASK <slot> <host:port>`: the client must then send `ASKING` and the command to that node,
//! on one connection with nothing in between. fred 10.1 does not (it sends `ASKING` to the new
//! node, then the command to the old one again), and past two redirections its connection task
//! stops for good; with `max_redirections` at 0 it answers `Too many redirections.` instead,
//! without the node the `ASK` named. [`call_asking`] finds that node and sends the call there.

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

/// Runs `script` with `keys` and `args` on the primary that imports `slot`, after `ASKING`:
/// what a client does on `ASK`. Asks the slot's owner, as the client's routing table has it,
/// which node it migrates the slot to (`CLUSTER NODES`); fails with [`NO_MIGRATION`] when it
/// migrates it nowhere (the move has ended, or the table is out of date: send the call again
/// as usual). The script is loaded on that node if it is missing there.
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
    let Some(target) = migration_target(&nodes, slot) else {
        let message = format!("{NO_MIGRATION} (slot {slot})");
        return Err(Error::new(ErrorKind::Routing, message));
    };
    let mut evalsha = Vec::with_capacity(3 + keys.len());
    evalsha.push(Value::from(script.sha1().clone()));
    evalsha.push(Value::from(keys.len() as i64));
    evalsha.extend(keys.into_iter().map(Value::from));
    evalsha.push(Value::Bytes(args));
    // A connection of the client's own to that node when it has one (the node holds slots);
    // otherwise one of its own, for this call only.
    let known = client
        .active_connections()
        .into_iter()
        .find(|server| target.is(server));
    match known {
        Some(server) => on_node(client, Some(server), script, evalsha).await,
        None => {
            let mut config = client.client_config();
            config.server = ServerConfig::Centralized {
                server: target.server(),
            };
            let dedicated = Dedicated(fred::types::Builder::from_config(config).build()?);
            dedicated.0.init().await?;
            on_node(&dedicated.0, None, script, evalsha).await
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

/// Sends `ASKING` then `EVALSHA` (`evalsha`: its arguments) as one pipeline to `server` (to
/// the only node of a client connected to one node: `None`), loading the script there first
/// and sending both again if the node lacks it.
///
/// fred's router writes the commands of a pipeline one after the other, before it takes up any
/// other command, so nothing comes between them on the connection. A redirection of the
/// `EVALSHA` is not followed (it would not go to this node again): it comes back as an error.
async fn on_node(
    client: &Client,
    server: Option<Server>,
    script: &Script,
    evalsha: Vec<Value>,
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
        pipeline
            .custom::<(), _>(command("ASKING"), Vec::<Value>::new())
            .await?;
        pipeline
            .custom::<(), _>(command("EVALSHA"), evalsha.clone())
            .await?;
        let mut replies = pipeline.try_all::<Value>().await.into_iter();
        let asking = replies.next();
        let reply = replies.next();
        match (asking, reply) {
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
                let message = "no reply to ASKING and EVALSHA";
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
/// migrations), the node it migrates `slot` to (`[<slot>->-<id>]`) and that node's address.
/// `None` without such a migration, or if the text is not as expected.
fn migration_target(nodes: &str, slot: u16) -> Option<Target> {
    let marker = format!("[{slot}->-");
    let target_id = nodes.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let flags = fields.nth(2)?;
        if !flags.split(',').any(|flag| flag == "myself") {
            return None;
        }
        fields.find_map(|field| {
            field
                .strip_prefix(marker.as_str())?
                .strip_suffix(']')
                .map(str::to_owned)
        })
    })?;
    nodes.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        if fields.next()? != target_id {
            return None;
        }
        // ip:port@cport[,hostname]; an IPv6 address holds colons too, the port follows the last.
        let field = fields.next()?;
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

    #[test]
    fn finds_the_node_a_slot_migrates_to() {
        assert_eq!(
            migration_target(MIGRATING, 77),
            Some(Target {
                ip: "127.0.0.1".into(),
                port: 30002,
                hostname: None,
            })
        );
        let target = migration_target(MIGRATING, 93).unwrap();
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
        assert_eq!(migration_target(MIGRATING, 1002), None);
        assert_eq!(migration_target(MIGRATING, 100), None);
        assert_eq!(migration_target(MIGRATING, 9), None);
        // Another node's line: only the owner's own line counts.
        let seen_elsewhere = MIGRATING.replace("myself,master", "master");
        assert_eq!(migration_target(&seen_elsewhere, 77), None);
        // The target is missing from the list, or its address is unreadable.
        let unknown = MIGRATING.replace("[77->-67ed", "[77->-ffff");
        assert_eq!(migration_target(&unknown, 77), None);
        let no_port = MIGRATING.replace("127.0.0.1:30002@31002", ":0@0");
        assert_eq!(migration_target(&no_port, 77), None);
        assert_eq!(migration_target("", 77), None);
        assert_eq!(migration_target("garbage\n\n", 77), None);
    }

    #[test]
    fn reads_ipv6_addresses() {
        let nodes = "\
a ::1:7000@17000 myself,master - 0 0 1 connected 0-100 [5->-b]
b [::1]:7001@17001 master - 0 0 2 connected 101-200
";
        let target = migration_target(nodes, 5).unwrap();
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
