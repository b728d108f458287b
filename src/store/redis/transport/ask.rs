//! Redis Cluster's redirections, read from Redis's own reply, and the client side of `ASK`.
//!
//! A primary answers a command for a hash slot it does not serve with `MOVED <slot> <host:port>`:
//! the hash slot has another owner for good. While a hash slot migrates, its old owner answers a
//! command whose keys it no longer holds with `ASK <slot> <host:port>`: this one command must
//! go to the importing node, after `ASKING`, on one connection with nothing in between; the
//! hash slot's owner stays the same. Sending a call with `ASKING` to a node for a key that the
//! owner still holds would make a second, fresh copy of the key there (a client admitted
//! afresh, and the operator's `MIGRATE` refused with `BUSYKEY`), so the kinds are told apart
//! by the error's text, which the store's per-node clients pass on unchanged (`nodes.rs`).

use fred::clients::{Client, Pipeline, WithOptions};
use fred::error::Error;
use fred::interfaces::ClientLike;
use fred::types::config::Server;
use fred::types::{ClusterHash, CustomCommand, Value};

/// A redirection from a Redis Cluster node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Redirection {
    /// `MOVED`: the hash slot (the number) is served by this node now.
    Moved(u16, Server),
    /// `ASK`: the hash slot is moving to this node, which holds the call's keys.
    Ask(Server),
}

/// The redirection that `error` reports, if it is one.
pub(crate) fn redirection(error: &Error) -> Option<Redirection> {
    let mut words = error.details().split_whitespace();
    let kind = words.next()?;
    let hash_slot: u16 = words.next()?.parse().ok()?;
    let server = server(words.next()?)?;
    match kind {
        "MOVED" => Some(Redirection::Moved(hash_slot, server)),
        "ASK" => Some(Redirection::Ask(server)),
        _ => None,
    }
}

/// Whether `error` is a redirection (which a call follows, or reports when it has followed
/// enough: the hash slot is moving, the call may be sent again).
pub(crate) fn is_redirection(error: &Error) -> bool {
    redirection(error).is_some()
}

/// The node at `host:port` (an IPv6 address holds colons too: the port follows the last).
fn server(address: &str) -> Option<Server> {
    let (host, port) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok().filter(|&port| port != 0)?;
    (!host.is_empty()).then(|| Server::new(host, port))
}

/// Sends `ASKING` then `EVALSHA` (`evalsha`: its arguments) as one pipeline through `node`,
/// a client of the importing node: fred's router writes the commands of a pipeline one after
/// the other, before it takes up any other command, so nothing comes between them on the
/// connection. Returns `EVALSHA`'s reply.
pub(crate) async fn asking(
    node: &WithOptions<Client>,
    evalsha: Vec<Value>,
) -> Result<Value, Error> {
    let command = |name: &'static str| CustomCommand::new_static(name, ClusterHash::Random, false);
    let pipeline = Pipeline::from(node.clone());
    pipeline
        .custom::<(), _>(command("ASKING"), Vec::<Value>::new())
        .await?;
    pipeline
        .custom::<(), _>(command("EVALSHA"), evalsha)
        .await?;
    let mut replies = pipeline.try_all::<Value>().await.into_iter();
    match (replies.next(), replies.next()) {
        (Some(Err(error)), _) => Err(error),
        (Some(Ok(_)), Some(reply)) => reply,
        _ => Err(Error::new(
            fred::error::ErrorKind::Protocol,
            "no reply to EVALSHA",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fred::error::ErrorKind;

    fn error(text: &str) -> Error {
        Error::new(ErrorKind::Cluster, text.to_owned())
    }

    #[test]
    fn tells_moved_from_ask() {
        assert_eq!(
            redirection(&error("MOVED 3999 127.0.0.1:6381")),
            Some(Redirection::Moved(3999, Server::new("127.0.0.1", 6381)))
        );
        assert_eq!(
            redirection(&error("ASK 3999 node-3.example:7000")),
            Some(Redirection::Ask(Server::new("node-3.example", 7000)))
        );
        assert_eq!(
            redirection(&error("ASK 5 ::1:7001")),
            Some(Redirection::Ask(Server::new("::1", 7001)))
        );
    }

    #[test]
    fn other_errors_are_no_redirection() {
        for text in [
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "MOVED",
            "MOVED x 127.0.0.1:1",
            "MOVED 1 127.0.0.1:0",
            "MOVED 1 :7000",
            "ERR unknown command",
        ] {
            assert_eq!(redirection(&error(text)), None, "{text}");
            assert!(!is_redirection(&error(text)));
        }
    }
}
