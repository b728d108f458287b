//! Parsers for the headers proxies use to pass on the client address.
//!
//! Each yields the hops of the chain from the right (the hop nearest to this server first), at
//! most [`MAX_HOPS`] of them. A hop that is not an IP address (`unknown`, an obfuscated
//! `_identifier`, garbage) yields `None`, which ends the walk. Nothing here panics on any
//! input; the work is bounded by the header's size, which the HTTP server already limits.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;

/// How many hops a walk looks at; a longer chain is cut (see `ClientIp`).
pub(crate) const MAX_HOPS: usize = 64;

/// Which header carries the forwarding chain. Read exactly one: a proxy sets the one it is
/// configured for and passes the others through from the client, so falling back from one to
/// another would let a client choose its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the de-facto standard; the default).
    #[default]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
    /// `X-Real-IP: client`, as nginx's `proxy_set_header X-Real-IP $remote_addr` sets it.
    XRealIp,
}

/// Splits a header line into elements; `None` if it cannot be split safely.
type Split = fn(&str) -> Option<Vec<&str>>;
/// Reads the address of one element.
type Node = fn(&str) -> Option<IpAddr>;

/// The forwarding chain in `header`, right to left; `None` when the header is absent.
pub(crate) fn chain(headers: &HeaderMap, header: ForwardedHeader) -> Option<Vec<Option<IpAddr>>> {
    let (name, split, node): (&str, Split, Node) = match header {
        ForwardedHeader::XForwardedFor => {
            ("x-forwarded-for", |t| Some(t.split(',').collect()), node)
        }
        ForwardedHeader::Forwarded => ("forwarded", split_quoted, forwarded_for),
        ForwardedHeader::XRealIp => ("x-real-ip", |t| Some(vec![t]), node),
    };
    let values: Vec<_> = headers.get_all(name).iter().collect();
    if values.is_empty() {
        return None;
    }
    let mut hops = Vec::new();
    // Later header lines are nearer to this server.
    for value in values.iter().rev() {
        // A line that is not text, or whose quotes do not close, is one unusable hop: its
        // parts cannot be told apart from what a client wrote.
        let Some(elements) = value.to_str().ok().and_then(split) else {
            hops.push(None);
            break;
        };
        for element in elements.into_iter().rev() {
            hops.push(node(element));
            if hops.len() >= MAX_HOPS {
                return Some(hops);
            }
        }
    }
    Some(hops)
}

/// Splits on commas outside quoted strings; `None` if a quoted string does not close.
fn split_quoted(text: &str) -> Option<Vec<&str>> {
    let (mut parts, mut start, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    (!quoted).then_some(parts)
}

/// The `for=` node of one `Forwarded` element (RFC 7239), e.g. `for=192.0.2.60;proto=http`.
/// An element with no `for`, or more than one, has no usable node.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    let mut fors = element.split(';').filter_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        name.trim().eq_ignore_ascii_case("for").then_some(value)
    });
    match (fors.next(), fors.next()) {
        (Some(value), None) => node(value),
        _ => None,
    }
}

/// A node: `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`, `[2001:db8::1]:80`, optionally quoted.
fn node(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    let text = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    if let Some(rest) = text.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|a| a.ip()))
}

#[cfg(test)]
mod tests {
    use super::ForwardedHeader::*;
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn reads_forwarded_right_to_left() {
        let h = headers(&[
            ("forwarded", b"for=192.0.2.60;proto=http;by=203.0.113.43"),
            (
                "forwarded",
                b"For=\"[2001:db8:cafe::17]:4711\", for=unknown, for=\"198.51.100.1:80\"",
            ),
        ]);
        assert_eq!(
            chain(&h, Forwarded).unwrap(),
            [
                ip("198.51.100.1"),
                None,
                ip("2001:db8:cafe::17"),
                ip("192.0.2.60")
            ]
        );
    }

    #[test]
    fn client_quotes_cannot_swallow_the_proxys_entry() {
        // The client opened a quote; the proxy appended its entry to the same line.
        let h = headers(&[("forwarded", b"for=6.6.6.6;x=\", for=198.51.100.7")]);
        assert_eq!(chain(&h, Forwarded).unwrap(), [None]);
        let twice = headers(&[("forwarded", b"for=unknown;for=6.6.6.6")]);
        assert_eq!(chain(&twice, Forwarded).unwrap(), [None]);
    }

    #[test]
    fn reads_only_the_configured_header() {
        let h = headers(&[
            ("x-forwarded-for", b"203.0.113.1, 10.0.0.2"),
            ("x-real-ip", b" 203.0.113.9 "),
            ("forwarded", b"for=6.6.6.6"),
        ]);
        let xff = [ip("10.0.0.2"), ip("203.0.113.1")];
        assert_eq!(chain(&h, XForwardedFor).unwrap(), xff);
        assert_eq!(chain(&h, XRealIp).unwrap(), [ip("203.0.113.9")]);
        assert_eq!(chain(&h, Forwarded).unwrap(), [ip("6.6.6.6")]);
        assert_eq!(chain(&HeaderMap::new(), XForwardedFor), None);
    }

    #[test]
    fn hostile_values_end_the_walk_or_are_cut() {
        let garbage = headers(&[("forwarded", b"for=\"unterminated, for=;;;=,,\"\"")]);
        assert!(chain(&garbage, Forwarded)
            .unwrap()
            .iter()
            .all(Option::is_none));
        let binary = headers(&[("x-forwarded-for", b"\xff\xfe")]);
        assert_eq!(chain(&binary, XForwardedFor).unwrap(), [None]);
        let long = "10.0.0.1,".repeat(1000);
        let many = headers(&[("x-forwarded-for", long.as_bytes())]);
        assert_eq!(chain(&many, XForwardedFor).unwrap().len(), MAX_HOPS);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_any_bytes(
            values in proptest::collection::vec(proptest::collection::vec(0x20u8..0x7f, 0..200), 0..4),
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            let kinds = [("forwarded", Forwarded), ("x-forwarded-for", XForwardedFor), ("x-real-ip", XRealIp)];
            for (name, header) in kinds {
                let mut map = HeaderMap::new();
                for v in &values {
                    map.append(name, HeaderValue::from_bytes(v).unwrap());
                }
                if let Ok(v) = HeaderValue::from_bytes(&raw) {
                    map.append(name, v);
                }
                let hops = chain(&map, header);
                proptest::prop_assert!(hops.map_or(0, |h| h.len()) <= MAX_HOPS);
            }
        }
    }
}
