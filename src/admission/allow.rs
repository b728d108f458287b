//! [`AllowList`]: the keys and networks a layer never limits.

use std::collections::HashSet;

use ipnet::IpNet;

use crate::Key;

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
