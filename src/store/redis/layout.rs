//! The key layout the instances sharing a Redis Cluster agree on: their `cluster_tags`.
//!
//! Instances with different numbers of tags keep a client's state under different keys, so
//! together they admit up to each one's limit (3 and 4 tags on a 4-primary cluster split 773
//! of 1 000 clients). The first instance to connect records its number in the cluster; the
//! others compare theirs with it.

use std::sync::Weak;
use std::time::Duration;

use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::SetOptions;

use super::transport::nodes::Nodes;
use crate::StoreError;

/// Where the instances using `prefix` record their number of tags (a hash slot of its own).
fn key(prefix: &str) -> String {
    format!("{prefix}:{{layout}}:cluster_tags")
}

/// Records `tags` for `prefix` unless a number is recorded already, then fails with
/// [`StoreError::Config`] if that number is another.
pub(super) async fn verify(nodes: &Nodes, prefix: &str, tags: usize) -> Result<(), StoreError> {
    let key = key(prefix);
    let client = nodes.client(fred::util::redis_keyslot(key.as_bytes()))?;
    client.wait_for_connect().await?;
    let recorded: Option<String> = client
        .set(&key, tags.to_string(), None, Some(SetOptions::NX), true)
        .await?;
    match recorded {
        Some(other) if other != tags.to_string() => Err(StoreError::Config(format!(
            "cluster_tags is {tags} here but {other} for the instances already using the key \
             prefix {prefix:?}: they would keep each client's state under other keys and admit \
             each client twice; use {other}, or delete {key} once every instance uses {tags}"
        ))),
        _ => Ok(()),
    }
}

/// [`verify`] in the background, tried again every second while the cluster does not answer
/// (up to a minute), logging a mismatch as an ERROR: for a store that connects in the
/// background, or whose layout key's primary was gone at connect.
pub(super) fn verify_later(nodes: Weak<Nodes>, prefix: &str, tags: usize) {
    let prefix = prefix.to_owned();
    tokio::spawn(async move {
        for _ in 0..60 {
            let Some(strong) = nodes.upgrade() else {
                return;
            };
            let verified =
                tokio::time::timeout(Duration::from_secs(1), verify(&strong, &prefix, tags));
            match verified.await {
                Ok(Ok(())) => return,
                Ok(Err(error @ StoreError::Config(_))) => {
                    tracing::error!(target: "tower_redis_ratelimit", %error, "rate-limit store misconfigured");
                    return;
                }
                _ => {}
            }
            drop(strong);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}
