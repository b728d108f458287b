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
//!
//! **The plain tier** (`scripts/plain.lua`) reads no hash: it goes by the override the
//! arguments carry. So a request goes there only while its lane's overrides are *confirmed*
//! ([`Known::plain_ok`]): a full call sent less than [`FOLLOW`] ago read the generation the
//! request's resolution was made at, and the limits version has not changed since that call
//! was sent. A full call reads the hash after its send, so every change made before the send
//! is in what it confirmed; a change made since is either announced (the version moves, and
//! the lane goes full at once) or not yet (a cluster writer between its hash writes and its
//! raise), and then the confirmation runs out within [`FOLLOW`] and the next full call reads
//! it. Either way a plain decision starting [`FOLLOW`] or more after an override was written
//! goes by it. A lane unconfirmed goes full, which confirms it again: one full call per lane
//! per [`FOLLOW`] under steady traffic.
//!
//! A plain call may also be run late: held in a stalled connection, it reaches Redis after
//! its budget has run out. So it carries the confirmation ([`Known::confirmation`]): the
//! generation confirmed and the Redis time [`FOLLOW`] after the confirming call ran, and the
//! plain script sends to the full tier every request resolved at another generation, and every
//! request at all once Redis's clock has passed that time. A write after the confirming call
//! ran is on the same Redis's clock later than it, so a plain decision that Redis runs
//! [`FOLLOW`] or more after an override was written goes by it too, however late its call.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use quick_cache::Equivalent;
use tokio::time::Instant;

use super::version::FOLLOW;
use crate::store::UNCONFIRMED_LIMITS as UNCONFIRMED;
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
    /// Each lane's latest confirmation by a full call ([`Known::plain_ok`]).
    confirmed: Vec<Confirmed>,
    /// Held while a confirmation is written, so that writes do not interleave.
    confirming: Mutex<()>,
    /// Times are µs since this instant, on tokio's clock (paused time in tests).
    origin: Instant,
}

/// What a full call to a lane read of its hash, and when it was sent.
///
/// Written generation and token first, then `sent` (release), under [`Known::confirming`];
/// read `sent` first (acquire). A reader that sees a write's `sent` sees its generation and
/// token, or a later write's, whose call was sent later still: either way the hash was at
/// the generation it reads at some time after the `sent` it read.
#[derive(Default)]
struct Confirmed {
    /// When the call was sent, µs since [`Known::origin`], plus one (0: never).
    sent: AtomicU64,
    /// The generation it read.
    generation: AtomicI64,
    /// The limits version's token (`version.rs`) when it was sent.
    token: AtomicU64,
    /// Redis's time (µs) [`FOLLOW`] after the call ran: the plain tier decides nothing later.
    until: AtomicI64,
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
            confirmed: (0..lanes.max(1)).map(|_| Confirmed::default()).collect(),
            confirming: Mutex::new(()),
            origin: Instant::now(),
        }
    }

    /// Whether a request of lane `lane` resolved as `resolution` may go to the plain tier,
    /// which goes by the resolution without reading the hash (see the module's "The plain
    /// tier"): the resolution is known, a full call sent less than [`FOLLOW`] ago read the
    /// generation it was made at, and the limits version's `token` now (`Limits::token`) is
    /// the one of when that call was sent, and confirmed.
    pub(in crate::store::redis) fn plain_ok(
        &self,
        lane: usize,
        resolution: &Resolution,
        token: u64,
    ) -> bool {
        match resolution {
            Resolution::At { generation, .. } => self.plain_ok_at(lane, *generation, token),
            Resolution::Unknown => false,
        }
    }

    /// [`plain_ok`](Self::plain_ok) of a request resolved at generation `generation`.
    pub(in crate::store::redis) fn plain_ok_at(
        &self,
        lane: usize,
        generation: i64,
        token: u64,
    ) -> bool {
        let confirmed = &self.confirmed[lane % self.confirmed.len()];
        let sent = confirmed.sent.load(Ordering::Acquire);
        let now = self.micros(Instant::now()) + 1;
        sent != 0
            && now < sent.saturating_add(FOLLOW.as_micros() as u64)
            && confirmed.generation.load(Ordering::Acquire) == generation
            && token != UNCONFIRMED
            && confirmed.token.load(Ordering::Acquire) == token
    }

    /// What a plain call of lane `lane` carries, made now under the limits version's `token`:
    /// the generation its latest confirmation read and the Redis time until which the plain
    /// tier may decide by it (see the module's "The plain tier"), or `None` where the lane is
    /// not confirmed now, when the call goes to the full tier instead. Read as one, so that the
    /// time is never another confirmation's.
    pub(in crate::store::redis) fn confirmation(
        &self,
        lane: usize,
        token: u64,
    ) -> Option<(i64, i64)> {
        let confirmed = &self.confirmed[lane % self.confirmed.len()];
        let _reading = self.confirming.lock().unwrap_or_else(|e| e.into_inner());
        let generation = confirmed.generation.load(Ordering::Acquire);
        self.plain_ok_at(lane, generation, token)
            .then(|| (generation, confirmed.until.load(Ordering::Acquire)))
    }

    /// µs from [`origin`](Self::origin) to `at` (0 before it).
    fn micros(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin);
        u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
    }

    /// Records that a full call to lane `lane` sent at `sent`, when the limits version's token
    /// was `token`, read generation `generation` at Redis time `time` (µs); a call sent before
    /// the latest confirmation adds nothing.
    fn confirm(&self, lane: usize, (generation, time): (i64, i64), (sent, token): (Instant, u64)) {
        let confirmed = &self.confirmed[lane % self.confirmed.len()];
        let sent = self.micros(sent) + 1;
        let _writing = self.confirming.lock().unwrap_or_else(|e| e.into_inner());
        if sent <= confirmed.sent.load(Ordering::Acquire) {
            return;
        }
        let until = time.saturating_add(FOLLOW.as_micros() as i64);
        confirmed.generation.store(generation, Ordering::Release);
        confirmed.token.store(token, Ordering::Release);
        confirmed.until.store(until, Ordering::Release);
        confirmed.sent.store(sent, Ordering::Release);
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

    /// Takes in what a call to lane `lane` read: the hash's generation and Redis's time (µs)
    /// then, and the fields it read with their values (`None`: absent), all in one script
    /// run. `sent`: for a full call, when it was sent and the limits version's token then,
    /// which confirm the lane for the plain tier ([`plain_ok`](Self::plain_ok)).
    pub(in crate::store::redis) fn learn<'a>(
        &self,
        lane: usize,
        (generation, time): (i64, i64),
        fields: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
        sent: Option<(Instant, u64)>,
    ) {
        if generation == UNKNOWN {
            return;
        }
        self.generation(lane).store(generation, Ordering::Release);
        self.learn_fields(lane, generation, fields);
        // After the fields, so that a resolution at this generation finds them.
        if let Some(sent) = sent {
            self.confirm(lane, (generation, time), sent);
        }
    }

    /// The fields part of [`learn`](Self::learn).
    fn learn_fields<'a>(
        &self,
        lane: usize,
        generation: i64,
        fields: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    ) {
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
    use std::time::Duration;

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
        known.learn(0, (EMPTY, 0), std::iter::empty(), None);
        let nothing = Resolution::At {
            generation: EMPTY,
            applies: Applies::Nothing,
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), nothing);
        let own = counts(policy.override_id(), 99);
        let fields = [(&b"k"[..], Some(&own[..])), (all_text.as_bytes(), None)];
        known.learn(0, (7, 0), fields.into_iter(), None);
        let limits: Arc<[[i64; 2]]> = Arc::from(vec![[99, 1]]);
        let at_7 = Resolution::At {
            generation: 7,
            applies: Applies::Counts(limits),
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), at_7);
        // Another key's field was not read: the script reads it.
        assert_eq!(known.resolve(0, "j", all, 0, &policy), Resolution::Unknown);
        // A later generation makes everything read before unknown.
        known.learn(0, (8, 0), std::iter::empty(), None);
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
        known.learn(0, (9, 0), fields.into_iter(), None);
        let blocked = Resolution::At {
            generation: 9,
            applies: Applies::Block,
        };
        assert_eq!(known.resolve(0, "k", all, 0, &policy), blocked);
        assert_eq!(blocked.kind(), (BLOCK, &[][..]));
        assert_eq!(at_7.kind(), (COUNTS, &[[99, 1]][..]));
        assert_eq!(Resolution::Unknown.kind(), (NONE, &[][..]));
    }

    /// A lane confirmed by a full call at generation 0 (no override), under token 5.
    fn confirmed_at(known: &Known, sent: Instant) -> Resolution {
        known.learn(0, (EMPTY, 0), std::iter::empty(), Some((sent, 5)));
        Resolution::At {
            generation: EMPTY,
            applies: Applies::Nothing,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirmation_lets_the_plain_tier_decide_for_less_than_follow_from_its_send() {
        let known = Known::new(1);
        let policy = api();
        let all = policy.owner().all_id();
        // Nothing confirmed yet: full.
        assert!(!known.plain_ok(0, &Resolution::Unknown, 5));
        let sent = Instant::now();
        tokio::time::advance(Duration::from_millis(40)).await;
        let resolution = confirmed_at(&known, sent);
        assert_eq!(known.resolve(0, "k", all, 0, &policy), resolution);
        assert!(known.plain_ok(0, &resolution, 5));
        // Counted from the call's send, not its reply.
        tokio::time::advance(FOLLOW - Duration::from_millis(41)).await;
        assert!(known.plain_ok(0, &resolution, 5));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!known.plain_ok(0, &resolution, 5));
        // A reply to a call sent before the latest confirmation confirms nothing newer.
        known.learn(0, (EMPTY, 0), std::iter::empty(), Some((sent, 5)));
        assert!(!known.plain_ok(0, &resolution, 5));
        known.learn(0, (EMPTY, 0), std::iter::empty(), Some((Instant::now(), 5)));
        assert!(known.plain_ok(0, &resolution, 5));
        // A plain call's reply (no send) confirms nothing.
        tokio::time::advance(FOLLOW).await;
        known.learn(0, (EMPTY, 0), std::iter::empty(), None);
        assert!(!known.plain_ok(0, &resolution, 5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_call_carries_the_generation_confirmed_until_follow_after_redis_ran_it() {
        let known = Known::new(1);
        assert_eq!(known.confirmation(0, 5), None);
        // Sent now; Redis ran it at its time 1 000 000 µs.
        known.learn(
            0,
            (7, 1_000_000),
            std::iter::empty(),
            Some((Instant::now(), 5)),
        );
        let until = 1_000_000 + FOLLOW.as_micros() as i64;
        assert_eq!(known.confirmation(0, 5), Some((7, until)));
        // Another limits version since: none.
        assert_eq!(known.confirmation(0, 6), None);
        // Out of date here: none, whatever Redis's time.
        tokio::time::advance(FOLLOW).await;
        assert_eq!(known.confirmation(0, 5), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_of_the_limits_version_ends_a_confirmation_at_once() {
        let known = Known::new(1);
        let resolution = confirmed_at(&known, Instant::now());
        assert!(known.plain_ok(0, &resolution, 5));
        // Another version was read since the confirming call was sent.
        assert!(!known.plain_ok(0, &resolution, 6));
        // The version unread for too long (`Limits::token`), even where it was 5 before.
        assert!(!known.plain_ok(0, &resolution, UNCONFIRMED));
        known.learn(
            0,
            (EMPTY, 0),
            std::iter::empty(),
            Some((Instant::now(), UNCONFIRMED)),
        );
        assert!(!known.plain_ok(0, &resolution, UNCONFIRMED));
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_resolution_at_the_confirmed_generation_goes_plain() {
        let known = Known::new(2);
        let policy = api();
        let all = policy.owner().all_id();
        let all_text = all.to_string();
        let own = counts(policy.override_id(), 99);
        let fields = [(&b"k"[..], Some(&own[..])), (all_text.as_bytes(), None)];
        known.learn(0, (7, 0), fields.into_iter(), Some((Instant::now(), 5)));
        let at_7 = known.resolve(0, "k", all, 0, &policy);
        assert!(matches!(at_7, Resolution::At { generation: 7, .. }));
        assert!(known.plain_ok(0, &at_7, 5));
        // A field the call did not read: unknown, so full.
        let unknown = known.resolve(0, "j", all, 0, &policy);
        assert_eq!(unknown, Resolution::Unknown);
        assert!(!known.plain_ok(0, &unknown, 5));
        // Another lane is not confirmed by this one's call.
        assert!(!known.plain_ok(1, &at_7, 5));
        // A full call sent later confirms generation 8: what was resolved at 7 goes full.
        tokio::time::advance(Duration::from_millis(1)).await;
        known.learn(0, (8, 0), std::iter::empty(), Some((Instant::now(), 5)));
        assert!(!known.plain_ok(0, &at_7, 5));
        assert_eq!(known.resolve(0, "k", all, 0, &policy), Resolution::Unknown);
    }
}
