use std::net::{IpAddr, SocketAddr};

use http::Request;

use super::{Key, KeyError, KeyExtractor};

/// The IP address of the connecting peer.
///
/// Read from axum's `ConnectInfo<SocketAddr>` (feature `axum`, serve the app with
/// `into_make_service_with_connect_info::<SocketAddr>()`), from tonic's `TcpConnectInfo`
/// (feature `tonic`), or from a plain `SocketAddr` request extension (what a hyper or tower
/// server can insert). IPv4-mapped IPv6 addresses count as
/// the IPv4 address they carry.
///
/// Behind a load balancer the peer is the balancer, so every client would share one budget;
/// there, use [`ClientIp`](super::ClientIp) with the balancer's network trusted. Unlike
/// `ClientIp`, this keys IPv6 clients by their full address.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp;

impl<B> KeyExtractor<B> for PeerIp {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        peer_ip(request)
            .map(Key::from)
            .ok_or(KeyError::MissingPeerAddr)
    }
}

/// The peer address from axum's `ConnectInfo`, tonic's `TcpConnectInfo`, or a `SocketAddr`
/// extension.
pub(crate) fn peer_ip<B>(request: &Request<B>) -> Option<IpAddr> {
    let ext = request.extensions();
    #[cfg(feature = "axum")]
    if let Some(info) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = ext
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|info| info.remote_addr())
    {
        return Some(addr.ip());
    }
    ext.get::<SocketAddr>().map(SocketAddr::ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_socket_addr_and_unmaps_ipv4() {
        let mut req = Request::new(());
        assert_eq!(PeerIp.extract(&req), Err(KeyError::MissingPeerAddr));
        req.extensions_mut()
            .insert::<SocketAddr>("[::ffff:192.0.2.1]:443".parse().unwrap());
        assert_eq!(PeerIp.extract(&req).unwrap().as_str(), "192.0.2.1");
    }

    #[cfg(feature = "axum")]
    #[test]
    fn reads_axum_connect_info() {
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo::<SocketAddr>(
                "[2001:db8::1]:80".parse().unwrap(),
            ));
        assert_eq!(PeerIp.extract(&req).unwrap().as_str(), "2001:db8::1");
    }
}
