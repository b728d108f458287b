//! The overrides this instance has read, so that a decision's script need not read them again.
//!
//! Every write of an override also writes the hash's generation (field `""` of the hash,
//! `scripts/override_write.lua`): a number that changes with every change of the hash and
//! never comes back (the Redis time of the write in µs, or one more than the last where that is
//! not later). A decision's script reads it with one `HGET` and replies with it, and where it
//! read override fields, with their values (`prelude.lua`, "Overrides"). The store keeps those
//! values here, marked with the generation they were read at.
//!
//! A later decision of a key whose fields are all known at the hash's latest generation seen
//! is resolved here ([`Resolution`]): the store sends the override that applies, and the
//! generation it was read at. The script uses it only where the hash is still at that
//! generation, and reads the fields itself otherwise, so a decision never goes by an override
//! that has changed, as if every call read the hash. What it saves is the script's read of
//! the fields: one `HMGET` and a string per field, which cost a decision a tenth of its Redis
//! time (`docs/performance.md`, "What overrides cost").
//!
//! A hash without a generation holds no override (none was written, or Redis lost its data):
//! generation 0, where every field is known to be empty. The cache is bounded
//! ([`CAPACITY`] fields); a field it does not hold is read by the script, as before.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use quick_cache::Equivalent;

use crate::Policy;

/// The most fields kept, over every lane: about a hundred bytes each.
pub(in crate::store::redis) const CAPACITY: usize = 100_000;

/// The generation of a hash without one: it holds no override.
const EMPTY: i64 = 0;

/// The generation of a lane not heard from yet, or whose hash Redis refused to read: nothing
/// is known there.
const UNKNOWN: i64 = -1;

/// The kinds of an override's value (`overrides/value.rs`), and of a resolution that found
/// none (`prelude.lua`, "Overrides").
const NONE: i64 = 0;
const BLOCK: i64 = -1;
const COUNTS: i64 = -2;

/// An override field's value as a decision reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    /// A block: refused, no wait helps.
    Block,
    /// Counts set for override id `id`: count and scale of each limit.
    Counts { id: u64, limits: Arc<[[i64; 2]]> },
    /// A value that no decision goes by (an earlier version's).
    Other,
}

impl Value {
    /// Reads a value as `prelude.lua` does: its kind, the override id, m, then m pairs.
    fn read(bytes: &[u8]) -> Value {
        let ints: Vec<i64> = bytes
            .chunks_exact(8)
            .map(|int| i64::from_le_bytes(int.try_into().unwrap_or_default()))
            .collect();
        match ints.as_slice() {
            [BLOCK, ..] => Value::Block,
            [COUNTS, id, m, rest @ ..] => {
                let m = usize::try_from(*m).unwrap_or(usize::MAX);
                match (u64::try_from(*id), rest.get(..m.saturating_mul(2))) {
                    (Ok(id), Some(pairs)) => Value::Counts {
                        id,
                        limits: pairs.chunks_exact(2).map(|p| [p[0], p[1]]).collect(),
                    },
                    _ => Value::Other,
                }
            }
            _ => Value::Other,
        }
    }

    /// Whether it decides a request of a policy with override id `id` and `n` limits.
    fn applies(&self, id: u64, n: usize) -> bool {
        match self {
            Value::Block => true,
            Value::Counts {
                id: set_for,
                limits,
            } => *set_for == id && limits.len() == n,
            Value::Other => false,
        }
    }
}

/// A field of one lane's hash, as the cache keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    lane: usize,
    name: Box<str>,
}

/// A field looked up without making one.
struct FieldRef<'a> {
    lane: usize,
    name: &'a str,
}

impl Hash for Field {
    fn hash<H: Hasher>(&self, state: &mut H) {
        FieldRef {
            lane: self.lane,
            name: &self.name,
        }
        .hash(state);
    }
}

impl Hash for FieldRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.lane.hash(state);
        self.name.hash(state);
    }
}

impl Equivalent<Field> for FieldRef<'_> {
    fn equivalent(&self, key: &Field) -> bool {
        self.lane == key.lane && self.name == &*key.name
    }
}

/// What the store tells a decision's script of the override that applies to it: nothing
/// known, or what applies at a generation of the hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store::redis) enum Resolution {
    /// The script reads the fields.
    Unknown,
    /// At hash generation `generation`, no override applies, a block does, or counts do.
    At { generation: i64, applies: Applies },
}

/// The override that applies to a decision (see [`Resolution`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store::redis) enum Applies {
    Nothing,
    Block,
    Counts(Arc<[[i64; 2]]>),
}

impl Resolution {
    /// Its kind (`prelude.lua`'s `kind`: 0 none, or unknown, [`BLOCK`], [`COUNTS`]), and for
    /// counts, count and scale of each limit, which follow the decision's limits.
    pub(in crate::store::redis) fn kind(&self) -> (i64, &[[i64; 2]]) {
        match self {
            Resolution::Unknown => (NONE, &[]),
            Resolution::At { applies, .. } => match applies {
                Applies::Nothing => (NONE, &[]),
                Applies::Block => (BLOCK, &[]),
                Applies::Counts(limits) => (COUNTS, limits),
            },
        }
    }

    /// The generation it was made at (`prelude.lua`'s `known`; -1 when unknown).
    pub(in crate::store::redis) fn generation(&self) -> i64 {
        match self {
            Resolution::Unknown => UNKNOWN,
            Resolution::At { generation, .. } => *generation,
        }
    }
}

/// The fields read, and the latest generation seen, of every lane's hash.
pub(in crate::store::redis) struct Known {
    generations: Vec<AtomicI64>,
    fields: quick_cache::sync::Cache<Field, (i64, Value)>,
}

impl std::fmt::Debug for Known {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Known")
            .field("fields", &self.fields.len())
            .finish()
    }
}

impl Known {
    pub(in crate::store::redis) fn new(lanes: usize) -> Known {
        Known {
            generations: (0..lanes.max(1)).map(|_| AtomicI64::new(UNKNOWN)).collect(),
            fields: quick_cache::sync::Cache::new(CAPACITY),
        }
    }

    fn generation(&self, lane: usize) -> &AtomicI64 {
        &self.generations[lane % self.generations.len()]
    }

    /// The override that applies to a decision under `policy` whose key's field in lane
    /// `lane`'s hash is `key_field`, where this instance knows it; `all` and `plan` are the
    /// policy-wide and plan fields (0: on no plan), in the order the script looks (the key's,
    /// the plan's, the policy-wide one: the first that applies).
    pub(in crate::store::redis) fn resolve(
        &self,
        lane: usize,
        key_field: &str,
        all: u64,
        plan: u64,
        policy: &Policy,
    ) -> Resolution {
        let generation = self.generation(lane).load(Ordering::Acquire);
        let applies = match generation {
            UNKNOWN => return Resolution::Unknown,
            EMPTY => Applies::Nothing,
            _ => {
                let (id, n) = (policy.override_id(), policy.windows().len());
                let mut found = Applies::Nothing;
                let (mut all_text, mut plan_text) = (itoa::Buffer::new(), itoa::Buffer::new());
                let plan = (plan != 0).then(|| plan_text.format(plan));
                for name in [Some(key_field), plan, Some(all_text.format(all))]
                    .into_iter()
                    .flatten()
                {
                    let Some((read_at, value)) = self.fields.get(&FieldRef { lane, name }) else {
                        return Resolution::Unknown;
                    };
                    if read_at != generation {
                        return Resolution::Unknown;
                    }
                    if value.applies(id, n) {
                        found = match value {
                            Value::Counts { limits, .. } => Applies::Counts(limits),
                            _ => Applies::Block,
                        };
                        break;
                    }
                }
                found
            }
        };
        Resolution::At {
            generation,
            applies,
        }
    }

    /// Takes in what a call to lane `lane` read: the hash's generation, and the fields it
    /// read with their values (`None`: absent), all in one script run.
    pub(in crate::store::redis) fn learn<'a>(
        &self,
        lane: usize,
        generation: i64,
        fields: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) {
        if generation == UNKNOWN {
            return;
        }
        self.generation(lane).store(generation, Ordering::Release);
        if generation == EMPTY {
            return;
        }
        for (name, value) in fields {
            let Ok(name) = std::str::from_utf8(name) else {
                continue;
            };
            let value = value.map_or(Value::Other, Value::read);
            let field = Field {
                lane,
                name: name.into(),
            };
            self.fields.insert(field, (generation, value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api() -> Policy {
        Policy::new("api", ["10/1m".parse().unwrap()]).unwrap()
    }

    fn counts(id: u64, count: i64) -> Vec<u8> {
        [COUNTS, id as i64, 1, count, 1]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect()
    }

    #[test]
    fn a_decision_is_resolved_only_where_every_field_is_known_at_the_latest_generation() {
        let known = Known::new(1);
        let policy = api();
        let all = policy.owner().all_id();
        let all_text = all.to_string();
        assert_eq!(known.resolve(0, "k", all, 0, &policy), Resolution::Unknown);
        // An empty hash: nothing applies, whatever the fields.
        known.learn(0, EMPTY, std::iter::empty());
        let nothing = Resolution::At {
            generation: EMPTY,
            applies: Applies::Nothing,
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), nothing);
        let own = counts(policy.override_id(), 99);
        let fields = [(&b"k"[..], Some(&own[..])), (all_text.as_bytes(), None)];
        known.learn(0, 7, fields.into_iter());
        let limits: Arc<[[i64; 2]]> = Arc::from(vec![[99, 1]]);
        let at_7 = Resolution::At {
            generation: 7,
            applies: Applies::Counts(limits),
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), at_7);
        // Another key's field was not read: the script reads it.
        assert_eq!(known.resolve(0, "j", all, 0, &policy), Resolution::Unknown);
        // A later generation makes everything read before unknown.
        known.learn(0, 8, std::iter::empty());
        assert_eq!(known.resolve(0, "k", all, 0, &policy), Resolution::Unknown);
        // Counts set for another identity are passed over, as the script does.
        let other = counts(policy.override_id() + 1, 5);
        let block = [BLOCK, 0, 0]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect::<Vec<u8>>();
        let fields = [
            (&b"k"[..], Some(&other[..])),
            (all_text.as_bytes(), Some(&block[..])),
        ];
        known.learn(0, 9, fields.into_iter());
        let blocked = Resolution::At {
            generation: 9,
            applies: Applies::Block,
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), blocked);
        assert_eq!(blocked.kind(), (BLOCK, &[][..]));
        assert_eq!(at_7.kind(), (COUNTS, &[[99, 1]][..]));
        assert_eq!(Resolution::Unknown.kind(), (NONE, &[][..]));
    }
}
