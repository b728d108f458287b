//! The value of an override in Redis: what a decision reads of it, then what listing needs.
//!
//! 64-bit little-endian integers: the kind ([`BLOCK`] or [`COUNTS`]), the identity id the
//! counts were set for ([`Policy::override_id`]; 0 for a block), the number of limits `m` (0
//! for a block), count and scale of each limit (0 and 0 for a window the override leaves out,
//! which keeps the request's own); then the scope's kind (0 policy-wide, 1 a
//! key's, 2 a plan's) and the text `<owner>\n<identity>\n<key or plan>` (the identity empty
//! for a block). A script reads the first three integers at once (`prelude.lua`, "Overrides").
//! Values written by versions before blocks went by name begin with `m >= 0`: the scripts and
//! listing skip them.

use crate::store::overrides::{Ruling, Scope, Stored};
use crate::{Key, Policy};

/// The kind of a block's value (`BLOCK` in `prelude.lua`).
const BLOCK: i64 = -1;

/// The kind of a value of counts (`COUNTS` in `prelude.lua`).
const COUNTS: i64 = -2;

/// An override's value (see the module's documentation).
pub(super) fn encode(policy: &Policy, scope: &Scope, ruling: &Ruling) -> Vec<u8> {
    let (kind, identity, limits): (i64, &str, Vec<(u64, u64)>) = match ruling {
        Ruling::Limits(counts) => (COUNTS, policy.identity(), counts.count_scales()),
        Ruling::Block => (BLOCK, "", Vec::new()),
    };
    let id = if kind == COUNTS {
        policy.override_id() as i64
    } else {
        0
    };
    let (scope_kind, rest) = match scope {
        Scope::All => (0, ""),
        Scope::Key(key) => (1, key.as_str()),
        Scope::Plan(plan) => (2, plan.as_str()),
    };
    let ints = [kind, id, limits.len() as i64]
        .into_iter()
        .chain(limits.iter().flat_map(|&(c, s)| [c as i64, s as i64]))
        .chain([scope_kind]);
    let mut value: Vec<u8> = ints.flat_map(i64::to_le_bytes).collect();
    for part in [policy.owner().name(), "\n", identity, "\n", rest] {
        value.extend_from_slice(part.as_bytes());
    }
    value
}

/// An override read back: the owner it was set under, its scope, and what it holds; `None`
/// for a value this version does not write.
pub(super) fn decode(value: &[u8]) -> Option<(&str, Scope, Stored)> {
    let int = |i: usize| {
        let bytes = value.get(8 * i..8 * i + 8)?;
        Some(i64::from_le_bytes(bytes.try_into().ok()?))
    };
    let kind = int(0)?;
    let m = usize::try_from(int(2)?).ok()?;
    let counts = (0..m)
        .map(|i| int(3 + 2 * i).and_then(|c| u64::try_from(c).ok()))
        .collect::<Option<Vec<u64>>>()?;
    let scope_kind = int(3 + 2 * m)?;
    let text = std::str::from_utf8(value.get(8 * (4 + 2 * m)..)?).ok()?;
    let (owner, text) = text.split_once('\n')?;
    let (identity, rest) = text.split_once('\n')?;
    let identity = match kind {
        COUNTS if m > 0 => Some(identity.into()),
        BLOCK if m == 0 => None,
        _ => return None,
    };
    let scope = match scope_kind {
        0 => Scope::All,
        1 => Scope::Key(Key::from_stored(rest)),
        2 => Scope::Plan(rest.to_owned()),
        _ => return None,
    };
    Some((owner, scope, Stored { counts, identity }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::overrides::Override;

    fn sms() -> Policy {
        Policy::new("sms", ["1/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap()
    }

    #[test]
    fn values_read_back() {
        let to = Override::Limits(vec!["2/1m".parse().unwrap(), "50/1h".parse().unwrap()]);
        let ruling = Ruling::new(&sms(), &to).unwrap();
        let key = Scope::Key(Key::from("+447700900123"));
        let value = encode(&sms(), &key, &ruling);
        let counts = Stored {
            counts: vec![2, 50],
            identity: Some("sms:log:1m+1h".into()),
        };
        assert_eq!(decode(&value), Some(("sms", key, counts)));
        // A key never holds a newline (one with control characters is kept hashed), so the
        // parts of the text split unambiguously; a plan's name comes last.
        assert!(!Key::from("+44\n7700").as_str().contains('\n'));
        let plan = Scope::Plan("free\ntier".into());
        let value = encode(&sms(), &plan, &Ruling::Block);
        let block = Stored {
            counts: vec![],
            identity: None,
        };
        assert_eq!(decode(&value), Some(("sms", plan, block.clone())));
        let value = encode(&sms(), &Scope::All, &Ruling::Block);
        assert_eq!(decode(&value), Some(("sms", Scope::All, block)));
        assert_eq!(decode(&value[..12]), None);
        assert_eq!(decode(b""), None);
    }

    #[test]
    fn values_of_earlier_versions_are_not_read() {
        // m = 1, count 5, scale 5, a key's (1), then the identity and the key.
        let mut old: Vec<u8> = [1i64, 5, 5, 1]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        old.extend_from_slice(b"sms:log:1m\nkey\n");
        assert_eq!(decode(&old), None);
    }
}
