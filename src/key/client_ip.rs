use std::net::IpAddr;
use std::sync::Arc;

use http::Request;
use ipnet::IpNet;

use super::forwarded::{self, ForwardedHeader};
use super::{peer, Key, KeyError, KeyExtractor};

/// The client's IP address, also behind trusted proxies and load balancers.
///
/// With no trusted proxies (the default) this is the peer address, and `Forwarded`,
/// `X-Forwarded-For` and `X-Real-IP` are ignored: anybody can send them, so believing them
/// would let a client choose its own key. With trusted proxy networks configured, and only when
/// the peer is one of them, the forwarding chain is walked from the right (the hop nearest to
/// this server) past every trusted address, and the first untrusted address is the client. A
/// client can prepend whatever it likes; the proxies append the address they saw, and that is
/// what is found.
///
/// The chain is read from exactly one header, the one the proxies set:
/// [`ForwardedHeader::XForwardedFor`] by default, or `Forwarded` (RFC 7239) or `X-Real-IP`.
/// Never several: a proxy passes the headers it does not set through from the client. If the
/// walk meets an entry that is not an address (`unknown`, an obfuscated
/// identifier, garbage), or looks at more than 64 hops, the client is taken to be the last
/// trusted hop reached: the proxy that passed on the unusable header, so such requests share
/// that proxy's budget rather than choose one. If every hop is trusted, the leftmost is the
/// client.
///
/// IPv4-mapped IPv6 addresses count as IPv4. IPv6 clients are keyed by their network prefix
/// (default /64, one customer's usual allocation), so a host cannot get a new budget by moving
/// to another address of its subnet.
///
/// ```
/// use tower_redis_ratelimit::key::ClientIp;
///
/// // Behind a load balancer in 10.0.0.0/8.
/// let client_ip = ClientIp::builder().trust("10.0.0.0/8")?.build()?;
/// # Ok::<(), tower_redis_ratelimit::key::ClientIpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Arc<[IpNet]>,
    ipv6_prefix: u8,
    header: ForwardedHeader,
}

/// Why a [`ClientIp`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientIpError {
    /// A trusted network is not in CIDR notation.
    #[error("trusted proxy network {0:?} is not an address or CIDR network such as 10.0.0.0/8")]
    Network(String),
    /// The IPv6 prefix length is above 128.
    #[error("IPv6 prefix length {0} is above 128")]
    Prefix(u8),
}

/// Configures a [`ClientIp`].
#[derive(Debug, Clone)]
pub struct ClientIpBuilder {
    trusted: Vec<IpNet>,
    ipv6_prefix: u8,
    header: ForwardedHeader,
}

impl Default for ClientIp {
    fn default() -> Self {
        ClientIp::new()
    }
}

impl ClientIp {
    /// The peer address, with no trusted proxies, IPv6 grouped by /64.
    pub fn new() -> Self {
        ClientIp {
            trusted: Arc::new([]),
            ipv6_prefix: 64,
            header: ForwardedHeader::default(),
        }
    }

    /// Configures trusted proxies and the IPv6 prefix.
    pub fn builder() -> ClientIpBuilder {
        ClientIpBuilder {
            trusted: Vec::new(),
            ipv6_prefix: 64,
            header: ForwardedHeader::default(),
        }
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client address: see the type's documentation for the walk.
    fn client(&self, peer: IpAddr, headers: &http::HeaderMap) -> IpAddr {
        // A dual-stack socket shows an IPv4 proxy as ::ffff:a.b.c.d.
        let peer = peer.to_canonical();
        if self.trusted.is_empty() || !self.trusts(peer) {
            return peer;
        }
        let Some(hops) = forwarded::chain(headers, self.header) else {
            return peer;
        };
        let mut last_trusted = peer;
        for hop in &hops {
            match hop.map(|ip| ip.to_canonical()) {
                Some(ip) if self.trusts(ip) => last_trusted = ip,
                Some(ip) => return ip,
                None => return last_trusted,
            }
        }
        last_trusted
    }

    fn key(&self, ip: IpAddr) -> Key {
        match ip.to_canonical() {
            IpAddr::V6(v6) if self.ipv6_prefix < 128 => {
                match ipnet::Ipv6Net::new(v6, self.ipv6_prefix) {
                    Ok(net) => Key::from_network(IpNet::V6(net.trunc())),
                    Err(_) => Key::from(ip),
                }
            }
            ip => Key::from(ip),
        }
    }
}

impl ClientIpBuilder {
    /// Trusts the proxies in `network` (`10.0.0.0/8`, `2001:db8::/32`, or one address).
    pub fn trust(mut self, network: &str) -> Result<Self, ClientIpError> {
        let net = network
            .parse::<IpNet>()
            .or_else(|_| network.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| ClientIpError::Network(network.to_owned()))?;
        self.trusted.push(net.trunc());
        Ok(self)
    }

    /// The header the trusted proxies set (default `X-Forwarded-For`).
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Keys IPv6 clients by this prefix length (default 64; 128 keys each address).
    pub fn ipv6_prefix(mut self, len: u8) -> Self {
        self.ipv6_prefix = len;
        self
    }

    /// Checks the configuration.
    pub fn build(self) -> Result<ClientIp, ClientIpError> {
        if self.ipv6_prefix > 128 {
            return Err(ClientIpError::Prefix(self.ipv6_prefix));
        }
        Ok(ClientIp {
            trusted: self.trusted.into(),
            ipv6_prefix: self.ipv6_prefix,
            header: self.header,
        })
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let peer = peer::peer_ip(request).ok_or(KeyError::MissingPeerAddr)?;
        Ok(self.key(self.client(peer, request.headers())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn request(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut builder = Request::builder();
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let mut request = builder.body(()).unwrap();
        request
            .extensions_mut()
            .insert(SocketAddr::new(peer.parse().unwrap(), 1234));
        request
    }

    fn key(extractor: &ClientIp, peer: &str, headers: &[(&str, &str)]) -> String {
        extractor
            .extract(&request(peer, headers))
            .unwrap()
            .as_str()
            .to_owned()
    }

    #[test]
    fn without_trusted_proxies_headers_are_ignored() {
        let plain = ClientIp::new();
        let forged = [
            ("x-forwarded-for", "1.2.3.4"),
            ("forwarded", "for=5.6.7.8"),
            ("x-real-ip", "9.9.9.9"),
        ];
        assert_eq!(key(&plain, "203.0.113.5", &forged), "203.0.113.5");
    }

    #[test]
    fn walks_past_trusted_hops_only() {
        let ip = ClientIp::builder()
            .trust("10.0.0.0/8")
            .unwrap()
            .build()
            .unwrap();
        // The client forged the left-most entry; the proxies appended what they saw.
        let xff = [("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.1.1.1")];
        assert_eq!(key(&ip, "10.0.0.1", &xff), "198.51.100.7");
        // An untrusted peer's headers are not believed.
        assert_eq!(key(&ip, "198.51.100.99", &xff), "198.51.100.99");
        // Garbage on the way: the proxy that passed it on is the key.
        let bad = [("x-forwarded-for", "198.51.100.7, garbage, 10.1.1.1")];
        assert_eq!(key(&ip, "10.0.0.1", &bad), "10.1.1.1");
        // All hops trusted: the left-most.
        let internal = [("x-forwarded-for", "10.9.9.9, 10.1.1.1")];
        assert_eq!(key(&ip, "10.0.0.1", &internal), "10.9.9.9");
        // A dual-stack socket's view of the proxy is trusted too.
        assert_eq!(key(&ip, "::ffff:10.0.0.1", &xff), "198.51.100.7");
    }

    #[test]
    fn only_the_configured_header_counts() {
        let xff = ClientIp::builder()
            .trust("10.0.0.0/8")
            .unwrap()
            .build()
            .unwrap();
        let headers = [
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-for", "198.51.100.7"),
        ];
        assert_eq!(key(&xff, "10.0.0.1", &headers), "198.51.100.7");
        let real = ClientIp::builder()
            .trust("10.0.0.0/8")
            .unwrap()
            .header(ForwardedHeader::XRealIp)
            .build()
            .unwrap();
        let headers = [
            ("x-forwarded-for", "6.6.6.6"),
            ("x-real-ip", "198.51.100.8"),
        ];
        assert_eq!(key(&real, "10.0.0.1", &headers), "198.51.100.8");
    }

    #[test]
    fn ipv6_clients_are_grouped_by_prefix() {
        let ip = ClientIp::new();
        assert_eq!(key(&ip, "2001:db8:1:2:aaaa::1", &[]), "2001:db8:1:2::/64");
        assert_eq!(key(&ip, "2001:db8:1:2:ffff::9", &[]), "2001:db8:1:2::/64");
        assert_eq!(key(&ip, "::ffff:192.0.2.1", &[]), "192.0.2.1");
        let exact = ClientIp::builder().ipv6_prefix(128).build().unwrap();
        assert_eq!(key(&exact, "2001:db8::1", &[]), "2001:db8::1");
        assert!(ClientIp::builder().ipv6_prefix(129).build().is_err());
        assert!(ClientIp::builder().trust("10.0.0.0/33").is_err());
    }
}
