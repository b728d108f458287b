//! [`Limiter`]: what a layer decides its requests with, shared by the layer, its clones, the
//! services they made and their futures.

use std::collections::HashSet;
use std::sync::Arc;

use ipnet::IpNet;

use crate::deny_cache::DenyCache;
use crate::ledger::post::Ledger;
use crate::ledger::slots::Holds;
use crate::ledger::tab::Metering;
use crate::response::{MissingKey, Responder};
use crate::rules::{PlanFn, RequestHead, RuleTable};
use crate::Key;

/// A request's cost, computed from its head.
pub(crate) type CostFn = dyn Fn(&RequestHead<'_>) -> u32 + Send + Sync;

/// A layer's settings and shared state, as its builder made them.
pub(crate) struct Limiter<K, St> {
    pub(crate) key: K,
    pub(crate) store: St,
    /// Which policy applies to a request: first matching rule, then the default; no policy at
    /// all means the request is not limited.
    pub(crate) table: RuleTable,
    /// Which plan a request is on, for policies with plans.
    pub(crate) plan: Option<Arc<PlanFn>>,
    pub(crate) allow: AllowList,
    pub(crate) cost: Option<Arc<CostFn>>,
    /// A request's cost when there is no cost function: 1, or the usage reservation.
    pub(crate) default_cost: u32,
    pub(crate) missing_key: MissingKey,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) usage: Option<Arc<Metering>>,
    /// The concurrency slots of the requests in flight, and the store they go back to.
    pub(crate) holds: Arc<Holds>,
    pub(crate) ledger: Arc<dyn Ledger>,
}

impl<K, St> Limiter<K, St> {
    /// The responder of the policy (and plan) that applies to `head`, if any.
    pub(crate) fn responder(&self, head: &RequestHead<'_>) -> Option<Arc<Responder>> {
        let table = self.table.load();
        table.responder(head, self.plan.as_deref()).cloned()
    }

    /// The cost of the request with head `head`.
    pub(crate) fn cost(&self, head: &RequestHead<'_>) -> u32 {
        self.cost
            .as_ref()
            .map_or(self.default_cost, |cost| cost(head))
    }
}

/// Keys and networks that are never limited.
#[derive(Debug, Default)]
pub(crate) struct AllowList {
    keys: HashSet<Key>,
    networks: Vec<IpNet>,
}

impl AllowList {
    /// Lists `keys` and `networks`.
    pub(crate) fn new(keys: HashSet<Key>, networks: Vec<IpNet>) -> Self {
        AllowList { keys, networks }
    }

    /// Whether `key` is listed, or is an address or IPv6 prefix that an IP extractor
    /// ([`PeerIp`](crate::PeerIp), [`ClientIp`](crate::ClientIp)) made, inside a listed
    /// network.
    pub(crate) fn contains(&self, key: &Key) -> bool {
        self.keys.contains(key)
            || key
                .network()
                .is_some_and(|net| self.networks.iter().any(|allowed| allowed.contains(&net)))
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    #[test]
    fn allow_list_matches_keys_addresses_and_prefixes() {
        let allow = AllowList::new(
            [Key::from("internal")].into_iter().collect(),
            vec![
                "10.0.0.0/8".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
        );
        let ip = |s: &str| Key::from(s.parse::<IpAddr>().unwrap());
        let net = |s: &str| Key::from_network(s.parse().unwrap());
        assert!(allow.contains(&Key::from("internal")));
        assert!(allow.contains(&ip("10.1.2.3")));
        assert!(allow.contains(&net("2001:db8:1:2::/64")));
        assert!(!allow.contains(&ip("11.1.2.3")));
        assert!(!allow.contains(&net("2001:db9::/64")));
        assert!(!allow.contains(&Key::from("someone")));
        // Text that looks like an address, e.g. an API key header, is not an address.
        assert!(!allow.contains(&Key::from("10.1.2.3")));
    }
}
