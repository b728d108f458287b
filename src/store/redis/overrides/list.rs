//! Listing a policy's overrides, a page at a time, off the request path.
//!
//! An admin list must never slow or fail the decisions. Redis runs one command at a time, so a
//! single `HGETALL` of a hash with 100 000 fields stalls every decision behind it; a page is one
//! `HSCAN` of [`PAGE`] fields, and a decision waits for one page at most. A page has its own
//! budget ([`PAGE_BUDGET`]) and never touches the decisions' breaker: a slow list fails
//! itself, not the requests (the breaker would have them fail or pass unchecked).
//!
//! `HSCAN` returns every field present for the whole scan at least once, and may return one
//! twice (while Redis rehashes the hash); a plan's and a policy-wide override are in every
//! lane's hash. A set of the scopes listed so far keeps each once, in linear time.

use std::collections::HashSet;
use std::time::Duration;

use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};

use super::super::RedisStore;
use super::value::decode;
use crate::store::overrides::{BoxFuture, Pages, Scope, Stored};
use crate::{Policy, StoreError};

/// Fields asked of Redis per page (`HSCAN ... COUNT`, a hint Redis follows closely for a hash
/// this large): about 1 ms of Redis time, so a page delays a decision by about that much,
/// while 100 000 overrides take 100 round trips.
pub(crate) const PAGE: u32 = 1000;

/// How long one page may take. Its own, not the decisions' budget: that one is sized for a
/// decision on the request path (250 ms by default) and trips the breaker when exceeded.
pub(crate) const PAGE_BUDGET: Duration = Duration::from_secs(1);

/// One page of the overrides stored under a policy's name (governing it or not).
pub(crate) type Page = Vec<(Scope, Stored)>;

/// Where a listing of one policy's overrides stands: the lane whose hash is being scanned and
/// the cursor in it.
pub(crate) struct RedisPages {
    store: RedisStore,
    /// The owner the overrides are stored under (`store/owner.rs`).
    owner: String,
    lane: usize,
    cursor: String,
    listed: HashSet<Scope>,
}

impl Pages for RedisPages {
    fn next(&mut self) -> BoxFuture<'_, Option<Result<Page, StoreError>>> {
        Box::pin(self.next_page())
    }
}

impl RedisPages {
    /// A listing of `policy`'s overrides in `store`, from the start; nothing is read yet.
    pub(crate) fn new(store: RedisStore, policy: &Policy) -> RedisPages {
        RedisPages {
            store,
            owner: policy.owner().name().to_owned(),
            lane: 0,
            cursor: "0".to_owned(),
            listed: HashSet::new(),
        }
    }

    /// The next overrides not listed yet, `None` at the end. Scans on until a page holds one of
    /// the policy's, so that a page is never empty. After an error the position is kept:
    /// the next call asks for the same page again.
    async fn next_page(&mut self) -> Option<Result<Page, StoreError>> {
        let mut page = Vec::new();
        while page.is_empty() && self.lane < self.store.inner.placement.lanes() {
            let (cursor, fields) = match self.scan().await {
                Ok(reply) => reply,
                Err(error) => return Some(Err(error)),
            };
            keep(&mut self.listed, &self.owner, &fields, &mut page);
            self.advance(cursor);
        }
        (!page.is_empty()).then_some(Ok(page))
    }

    /// One `HSCAN` of the current lane's hash from the cursor, on the node that holds it,
    /// within [`PAGE_BUDGET`] and outside the breaker.
    async fn scan(&self) -> Result<(String, Vec<Value>), StoreError> {
        let inner = &self.store.inner;
        let hash = inner.placement.overrides_key(&inner.prefix, self.lane);
        // The connections' own command timeout is the decisions' budget: a page sets its own.
        let options = Options {
            timeout: Some(PAGE_BUDGET),
            ..Options::default()
        };
        let hscan = |client: Client| {
            let command = CustomCommand::new_static("HSCAN", ClusterHash::FirstKey, false);
            let args: Vec<Value> = vec![
                hash.clone().into(),
                self.cursor.clone().into(),
                "COUNT".into(),
                PAGE.into(),
            ];
            let client = client.with_options(&options);
            async move { client.custom::<Value, Value>(command, args).await }
        };
        let reply = tokio::time::timeout(PAGE_BUDGET, inner.batcher.on(&hash, hscan)).await;
        let late = || {
            let why = format!("no page of overrides within {PAGE_BUDGET:?}");
            StoreError::Redis(Error::new(ErrorKind::Timeout, why))
        };
        read_page(reply.map_err(|_| late())??)
    }

    /// Moves to `cursor`, or to the next lane's hash when the scan of this one is over.
    fn advance(&mut self, cursor: String) {
        if cursor == "0" {
            self.lane += 1;
        }
        self.cursor = cursor;
    }
}

/// Adds to `page` the overrides among `fields` (field, value, field, value...) stored under
/// `owner` that are not in `listed` yet, and puts them there.
fn keep(listed: &mut HashSet<Scope>, owner: &str, fields: &[Value], page: &mut Page) {
    for pair in fields.chunks_exact(2) {
        // The hash's generation (`known.rs`) is no override.
        let Some(value) = pair[1]
            .as_bytes()
            .filter(|_| pair[0].as_bytes() != Some(b""))
        else {
            continue;
        };
        let Some((of, scope, stored)) = decode(value) else {
            continue;
        };
        if of == owner && listed.insert(scope.clone()) {
            page.push((scope, stored));
        }
    }
}

/// The next cursor and the fields and values (alternating) of an `HSCAN` reply.
fn read_page(reply: Value) -> Result<(String, Vec<Value>), StoreError> {
    let unexpected = || StoreError::Reply("HSCAN: not a cursor and an array".to_owned());
    let Value::Array(parts) = reply else {
        return Err(unexpected());
    };
    let mut parts = parts.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(cursor), Some(Value::Array(fields)), None) => {
            let cursor = cursor.as_str().ok_or_else(unexpected)?.into_owned();
            Ok((cursor, fields))
        }
        _ => Err(unexpected()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::value::encode;
    use super::*;
    use crate::store::overrides::{Override, Ruling};
    use crate::Key;

    #[test]
    fn pages_are_read_and_odd_replies_refused() {
        let fields = vec![Value::from("f"), Value::from("v")];
        let reply = Value::Array(vec![Value::from("17"), Value::Array(fields.clone())]);
        assert_eq!(read_page(reply).unwrap(), ("17".to_owned(), fields));
        assert!(read_page(Value::from("OK")).is_err());
        assert!(read_page(Value::Array(vec![Value::from("0")])).is_err());
    }

    /// A field that `HSCAN` returns twice, or a policy-wide override met again in another
    /// lane, is listed once; another policy's overrides are not listed; a key kept hashed is
    /// listed as the key it was set for.
    #[test]
    fn each_override_is_kept_once() {
        let sms = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
        let mail = Policy::new("mail", ["5/1h".parse().unwrap()]).unwrap();
        let block = Ruling::new(&sms, &Override::Block).unwrap();
        let value =
            |policy: &Policy, scope: &Scope| Value::Bytes(encode(policy, scope, &block).into());
        let phone = Scope::Key(Key::from("+44 7700 900123"));
        let field = |value: Value| [Value::from("field"), value];
        let lane = [
            field(value(&sms, &phone)),
            field(value(&sms, &Scope::All)),
            field(value(&mail, &phone)),
            field(value(&sms, &phone)),
            field(Value::from("not an override")),
        ]
        .concat();
        let (mut listed, mut page) = (HashSet::new(), Vec::new());
        keep(&mut listed, sms.owner().name(), &lane, &mut page);
        let mut next = Vec::new();
        keep(&mut listed, sms.owner().name(), &lane, &mut next);
        let block = || Stored {
            counts: vec![],
            identity: None,
        };
        assert_eq!(page, vec![(phone, block()), (Scope::All, block())]);
        assert_eq!(next, vec![]);
    }
}
