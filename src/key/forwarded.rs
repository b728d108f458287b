//! Parsers for the headers proxies use to pass on the client address.
//!
//! Each yields the hops of the chain from the right (the hop nearest to this server first), at
//! most [`MAX_HOPS`] of them. A hop that is not an IP address (`unknown`, an obfuscated
//! `_identifier`, garbage) yields `None`, which ends the walk. Nothing here allocates per hop
//! or panics on any input.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;

/// How many hops a walk looks at; a longer chain is cut (see `ClientIp`).
pub(crate) const MAX_HOPS: usize = 64;

/// The forwarding chain of `headers`, right to left: `Forwarded` if present, else
/// `X-Forwarded-For`, else `X-Real-IP`. `None` when none of them is present.
pub(crate) fn chain(headers: &HeaderMap) -> Option<Vec<Option<IpAddr>>> {
    let from = |name: &str, split: fn(&str) -> Vec<&str>, node: fn(&str) -> Option<IpAddr>| {
        let values: Vec<_> = headers.get_all(name).iter().collect();
        if values.is_empty() {
            return None;
        }
        let mut hops = Vec::new();
        // Later header lines are nearer to this server.
        for value in values.iter().rev() {
            let Ok(text) = value.to_str() else {
                hops.push(None);
                break;
            };
            for element in split(text).into_iter().rev() {
                hops.push(node(element));
                if hops.len() >= MAX_HOPS {
                    return Some(hops);
                }
            }
        }
        Some(hops)
    };
    from("forwarded", split_quoted, forwarded_for)
        .or_else(|| from("x-forwarded-for", |t| t.split(',').collect(), node))
        .or_else(|| from("x-real-ip", |t| vec![t], node))
}

/// Splits on commas outside quoted strings.
fn split_quoted(text: &str) -> Vec<&str> {
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
    parts
}

/// The `for=` node of one `Forwarded` element (RFC 7239), e.g. `for=192.0.2.60;proto=http`.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then(|| node(value))
            .flatten()
    })
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
            chain(&h).unwrap(),
            [
                ip("198.51.100.1"),
                None,
                ip("2001:db8:cafe::17"),
                ip("192.0.2.60")
            ]
        );
    }

    #[test]
    fn prefers_forwarded_then_x_forwarded_for_then_x_real_ip() {
        let xff = headers(&[
            ("x-forwarded-for", b"203.0.113.1, 10.0.0.2"),
            ("x-real-ip", b"1.1.1.1"),
        ]);
        assert_eq!(chain(&xff).unwrap(), [ip("10.0.0.2"), ip("203.0.113.1")]);
        let real = headers(&[("x-real-ip", b" 203.0.113.9 ")]);
        assert_eq!(chain(&real).unwrap(), [ip("203.0.113.9")]);
        assert_eq!(chain(&HeaderMap::new()), None);
    }

    #[test]
    fn hostile_values_end_the_walk_or_are_cut() {
        let garbage = headers(&[("forwarded", b"for=\"unterminated, for=;;;=,,\"\"")]);
        assert!(chain(&garbage).unwrap().iter().all(Option::is_none));
        let binary = headers(&[("x-forwarded-for", b"\xff\xfe")]);
        assert_eq!(chain(&binary).unwrap(), [None]);
        let long = "10.0.0.1,".repeat(1000);
        let many = headers(&[("x-forwarded-for", long.as_bytes())]);
        assert_eq!(chain(&many).unwrap().len(), MAX_HOPS);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_any_bytes(
            values in proptest::collection::vec(proptest::collection::vec(0x20u8..0x7f, 0..200), 0..4),
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            for name in ["forwarded", "x-forwarded-for", "x-real-ip"] {
                let mut map = HeaderMap::new();
                for v in &values {
                    map.append(name, HeaderValue::from_bytes(v).unwrap());
                }
                if let Ok(v) = HeaderValue::from_bytes(&raw) {
                    map.append(name, v);
                }
                let hops = chain(&map);
                proptest::prop_assert!(hops.map_or(0, |h| h.len()) <= MAX_HOPS);
            }
        }
    }
}
