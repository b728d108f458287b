//! The value of an override in Redis: its counts and what listing needs.

use crate::store::overrides::{Entry, Scope};
use crate::Policy;

/// The identity and the key (`None`: the policy's own) an override was set for.
type SetFor<'a> = (&'a str, Option<&'a str>);

/// An override's value: `m`, then count and scale of each limit, then 0 (a policy's) or 1 (a
/// key's), the identity, a newline and the key.
pub(super) fn encode(policy: &Policy, scope: &Scope, entry: &Entry) -> Vec<u8> {
    let limits: Vec<(u64, u64)> = match entry {
        Entry::Limits(other) => other.windows().iter().map(|w| (w.count, w.scale)).collect(),
        Entry::Block => Vec::new(),
    };
    let (kind, key) = match scope {
        Scope::All => (0i64, ""),
        Scope::Key(key) => (1, key.as_str()),
    };
    let ints = std::iter::once(limits.len() as i64)
        .chain(limits.iter().flat_map(|&(c, s)| [c as i64, s as i64]))
        .chain([kind]);
    let mut value: Vec<u8> = ints.flat_map(i64::to_le_bytes).collect();
    value.extend_from_slice(policy.identity().as_bytes());
    value.push(b'\n');
    value.extend_from_slice(key.as_bytes());
    value
}

/// The counts of an override's value (empty: a block), with the identity and the key (`None`
/// for a policy's) it was set for.
pub(super) fn decode(value: &[u8]) -> Option<(Vec<u64>, SetFor<'_>)> {
    let int = |i: usize| {
        let bytes = value.get(8 * i..8 * i + 8)?;
        Some(i64::from_le_bytes(bytes.try_into().ok()?))
    };
    let m = usize::try_from(int(0)?).ok()?;
    let counts = (0..m)
        .map(|i| int(1 + 2 * i).and_then(|c| u64::try_from(c).ok()))
        .collect::<Option<Vec<u64>>>()?;
    let kind = int(1 + 2 * m)?;
    let text = std::str::from_utf8(value.get(8 * (2 + 2 * m)..)?).ok()?;
    let (identity, key) = text.split_once('\n')?;
    Some((counts, (identity, (kind == 1).then_some(key))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::overrides::Override;
    use crate::Key;

    #[test]
    fn values_read_back() {
        let policy =
            Policy::new("sms", ["1/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
        let to = Override::Limits(vec!["2/1m".parse().unwrap(), "50/1h".parse().unwrap()]);
        let entry = Entry::new(&policy, &to).unwrap();
        let key = Scope::Key(Key::from("+447700900123"));
        let value = encode(&policy, &key, &entry);
        assert_eq!(
            decode(&value),
            Some((vec![2, 50], ("sms:log:1m+1h", Some("+447700900123"))))
        );
        // A key never holds a newline (one with control characters is kept hashed), so the
        // identity and the key part unambiguously.
        let hashed = Key::from("+44\n7700");
        assert!(!hashed.as_str().contains('\n'));
        let value = encode(&policy, &Scope::All, &Entry::Block);
        assert_eq!(decode(&value), Some((vec![], ("sms:log:1m+1h", None))));
        assert_eq!(decode(&value[..12]), None);
        assert_eq!(decode(b""), None);
    }
}
