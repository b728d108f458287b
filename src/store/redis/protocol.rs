//! The wire format between the store and its Lua scripts: the scripts themselves, what a
//! call's keys and arguments hold, how one request's arguments are encoded, and how the reply
//! is read.
//!
//! This is the Rust side of the contract that the header of `scripts/prelude.lua` states for
//! the scripts; the two follow the same order (keys, arguments, reply), and name the modes of
//! a request ([`Mode`]) and the answers that no limit gives ([`BOXED`], [`SLOTS_FULL`]) alike.
//! A change to one is a change to the other. `scripts/release.lua`'s header states the
//! arguments of a give-back of leased units ([`encode_release`]).
//!
//! Arguments and reply are 64-bit little-endian integers rather than Redis's text, so that
//! Redis neither parses nor prints a number per field (`prelude.lua`, "Cost").

use bytes::Bytes;
use fred::error::{Error, ErrorKind};
use fred::types::scripts::Script;
use fred::types::Value;

use super::overrides::{self, Known, Resolution};
use super::placement::Place;
use crate::algorithm::{Algorithm, Outcome, Window};
use crate::concurrency::{Full, Waiter};
use crate::{Decision, Policy, StoreError};

/// A script: exact arithmetic past 2^53, the shared prelude (arguments, reply, `TIME`), then,
/// for the algorithms that use it, the driver that combines limits (the counters) or the
/// format of events (the sliding log), then the algorithm's own file.
macro_rules! script {
    (log, $file:literal) => {
        concat!(
            include_str!("scripts/exact.lua"),
            include_str!("scripts/prelude.lua"),
            include_str!("scripts/log_events.lua"),
            include_str!($file)
        )
    };
    ($file:literal) => {
        concat!(
            include_str!("scripts/exact.lua"),
            include_str!("scripts/prelude.lua"),
            include_str!($file)
        )
    };
    (driver, $file:literal) => {
        concat!(
            include_str!("scripts/exact.lua"),
            include_str!("scripts/prelude.lua"),
            include_str!("scripts/common.lua"),
            include_str!($file)
        )
    };
}

/// The text of `algorithm`'s script. GCRA and the sliding log do without the driver, for
/// speed (their headers say why).
pub(super) const fn source(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::SlidingLog => script!(log, "scripts/sliding_log.lua"),
        Algorithm::SlidingWindow => script!(driver, "scripts/sliding_window.lua"),
        Algorithm::FixedWindow => script!(driver, "scripts/fixed_window.lua"),
        Algorithm::Gcra => script!("scripts/gcra.lua"),
    }
}

/// The text of `scripts/release.lua`, which gives leased units back: it decides nothing, so
/// it goes without the prelude; it makes the sliding log's events lighter as the log's own
/// script does (`scripts/log_events.lua`).
const RELEASE: &str = concat!(
    include_str!("scripts/exact.lua"),
    include_str!("scripts/log_events.lua"),
    include_str!("scripts/release.lua")
);

/// The text of `scripts/line.lua`, the line of reservations of a key (`src/store/line.rs`): it
/// decides nothing, and stands alone.
const LINE: &str = include_str!("scripts/line.lua");

/// The store's scripts, hashed once (`EVALSHA` names a script by its SHA-1).
pub(super) struct Scripts {
    sliding_log: Script,
    sliding_window: Script,
    fixed_window: Script,
    gcra: Script,
    /// `scripts/release.lua`.
    pub(super) release: Script,
    /// `scripts/line.lua`.
    pub(super) line: Script,
}

impl Scripts {
    pub(super) fn new() -> Scripts {
        let script = |algorithm| Script::from_lua(source(algorithm));
        Scripts {
            sliding_log: script(Algorithm::SlidingLog),
            sliding_window: script(Algorithm::SlidingWindow),
            fixed_window: script(Algorithm::FixedWindow),
            gcra: script(Algorithm::Gcra),
            release: Script::from_lua(RELEASE),
            line: Script::from_lua(LINE),
        }
    }

    /// The script that decides `algorithm`'s requests (any of them takes slot operations).
    pub(super) fn of(&self, algorithm: Algorithm) -> &Script {
        match algorithm {
            Algorithm::SlidingLog => &self.sliding_log,
            Algorithm::SlidingWindow => &self.sliding_window,
            Algorithm::FixedWindow => &self.fixed_window,
            Algorithm::Gcra => &self.gcra,
        }
    }

    /// The scripts that decide, which the store loads when it connects.
    pub(super) fn deciding(&self) -> [&Script; 4] {
        [
            &self.sliding_log,
            &self.sliding_window,
            &self.fixed_window,
            &self.gcra,
        ]
    }
}

// KEYS and ARGV (`prelude.lua`): the keys of a call's decisions, then those of its slot
// operations; ARGV[1] the decisions' arguments one after the other ([`encode_into`]), ARGV[2] the
// name of the hash of overrides, ARGV[3] what finds the decisions' override fields
// ([`Heads`]), then two per slot operation ([`SlotOp`]).

/// Bytes per integer in a script's arguments and reply.
pub(super) const INT: usize = std::mem::size_of::<i64>();

/// Bytes that [`encode_for`] puts before a decision's arguments: the length of its key's
/// override field (the first bytes of its state key, `overrides/place.rs`), which a call passes
/// apart from the arguments ([`Heads`]).
pub(super) const HEAD: usize = INT;

/// Where in a decision's arguments ([`encode_into`]) its policy-wide and plan fields are.
const FIELDS_AT: usize = 6 * INT;

/// ARGV[3] of a call, what finds its decisions' override fields: the length of each
/// decision's key field ([`HEAD`] bytes each, in the decisions' order), then the number of
/// policy-wide and plan fields the decisions name, and each of those once (`prelude.lua`,
/// "Overrides"): the script reads every field with one `HMGET`.
#[derive(Debug, Default)]
pub(super) struct Heads {
    keys: Vec<u8>,
    fields: Vec<i64>,
}

impl Heads {
    pub(super) fn with_capacity(decisions: usize) -> Heads {
        Heads {
            keys: Vec::with_capacity(HEAD * decisions),
            fields: Vec::new(),
        }
    }

    /// Takes in a decision's [`HEAD`] and arguments.
    pub(super) fn push(&mut self, head: &[u8], args: &[u8]) {
        self.keys.extend_from_slice(head);
        for at in [FIELDS_AT, FIELDS_AT + INT] {
            let field = args
                .get(at..at + INT)
                .and_then(|bytes| bytes.try_into().ok())
                .map_or(0, i64::from_le_bytes);
            if field != 0 && !self.fields.contains(&field) {
                self.fields.push(field);
            }
        }
    }

    /// ARGV[3].
    pub(super) fn bytes(self) -> Bytes {
        let Heads { mut keys, fields } = self;
        keys.reserve_exact(INT * (1 + fields.len()));
        let count = std::iter::once(fields.len() as i64);
        for value in count.chain(fields) {
            keys.extend_from_slice(&value.to_le_bytes());
        }
        Bytes::from(keys)
    }
}

/// An algorithm script's arguments: `decisions`, the decisions' arguments ([`encode_into`]), then
/// `overrides`, the name of the hash of overrides of the call's lane, then `heads`, what finds
/// the decisions' override fields ([`Heads`]), then `ops`, two per slot operation
/// ([`SlotOp::args`]). The hash is read by name, not passed as a key: while a hash slot
/// migrates, a call whose keys include one that is missing on a node is refused (`TRYAGAIN`),
/// and the hash usually does not exist at all (`prelude.lua`).
pub(super) fn argv(
    decisions: Bytes,
    overrides: Value,
    heads: Bytes,
    ops: Vec<Value>,
) -> Vec<Value> {
    let mut argv = Vec::with_capacity(3 + ops.len());
    argv.push(Value::Bytes(decisions));
    argv.push(overrides);
    argv.push(Value::Bytes(heads));
    argv.extend(ops);
    argv
}

/// The `record` argument of a request: what the script does with it. The scripts name the
/// modes alike (`prelude.lua`: `LOOK`, `ADMIT`, `LEASE`, `SETTLE`, `TAKE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i64)]
pub(super) enum Mode {
    /// 0, `LOOK`: decide only, recording nothing (a peek), against a GCRA capacity less the
    /// request's headroom; followed by want (its cost) and headroom.
    Look = 0,
    /// 1, `ADMIT`: decide, and record an admitted request's cost.
    Admit = 1,
    /// 2, `LEASE`: decide, and record as many units as fit now up to want (at least the
    /// cost), keeping headroom free in every GCRA bucket; followed by want and headroom.
    Lease = 2,
    /// 3, `SETTLE`: decide nothing, and record a settlement of the cost (`Store::settle`), a
    /// charge or a refund; followed by refund (0 or 1), the admission time of the request
    /// settled and the units it recorded.
    Settle = 3,
    /// 4, `TAKE`: decide and record as `ADMIT`, and when admitted take a concurrency slot;
    /// followed by the key's cap of slots, the slot's id and its lifetime, then the waiter's
    /// id (0: the request does not wait), wait (µs) and whether it is in line (0 or 1).
    Take = 4,
    /// 5, `RESERVE`: decide the earliest turn at or after every reservation before within
    /// the most it may wait, and record it (`Reserve::reserve`); followed by that wait (µs),
    /// headroom, and the reservation's id and notice (µs) in its key's line.
    Reserve = 5,
}

/// What a request asks a script to do: its [`Mode`], with the arguments that mode takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Record {
    /// Decide only (a peek), against a GCRA capacity less `headroom` µs of drain, as a
    /// leasing store's decisions are.
    Look { headroom: u64 },
    /// Decide, and record an admitted request's cost.
    Admit,
    /// Decide, and record as many units as fit now, up to `want` (at least the cost), keeping
    /// `headroom` µs of drain free in every GCRA bucket: a lease.
    Lease { want: u64, headroom: u64 },
    /// Decide nothing: record a settlement of `cost` units now, added (a charge) or taken
    /// back (`refund`) from the `recorded` units a request recorded at `admitted` (Redis
    /// time, µs; -1: not known). The reply reads the sliding log's windows `headroom` µs
    /// longer, as a leasing store's decisions of it do (0 for the other algorithms, whose
    /// settlements read no headroom).
    Settle {
        refund: bool,
        admitted: i64,
        recorded: u64,
        headroom: u64,
    },
    /// Decide and record as [`Admit`](Record::Admit), and when admitted take concurrency slot
    /// `id` for `ttl` µs, refusing at once while the key's live slots and the waiters in line
    /// ahead of the request (those ahead of `waiter`, or all of them) leave none of its `cap`
    /// free; a `waiter` refused joins the line. `headroom` as for a look (the sliding log's on
    /// a leasing store, which reads every window that much longer).
    Take {
        cap: u32,
        id: u64,
        ttl: u64,
        waiter: Option<Waiter>,
        headroom: u64,
    },
    /// Reserve the cost for the earliest turn within `max_wait` µs, after every reservation
    /// before; answered as admitted with the turn (µs from now) as its retry, or refused with
    /// the turn it would have had. `headroom` as for a look; `id` and `notice`, the
    /// reservation's in its key's line (`scripts/line.lua`).
    Reserve {
        max_wait: u64,
        headroom: u64,
        id: u64,
        notice: u64,
    },
}

impl Record {
    /// Its mode, and the arguments that follow the common six (`prelude.lua`, ARGV[1]): the
    /// first `len` of the seven.
    fn mode(&self, cost: u64) -> (Mode, [i64; 7], usize) {
        match *self {
            Record::Look { headroom } => {
                (Mode::Look, [clamp(cost), clamp(headroom), 0, 0, 0, 0, 0], 2)
            }
            Record::Admit => (Mode::Admit, [0; 7], 0),
            Record::Lease { want, headroom } => (
                Mode::Lease,
                [clamp(want), clamp(headroom), 0, 0, 0, 0, 0],
                2,
            ),
            Record::Settle {
                refund,
                admitted,
                recorded,
                headroom,
            } => (
                Mode::Settle,
                [
                    i64::from(refund),
                    admitted,
                    clamp(recorded),
                    clamp(headroom),
                    0,
                    0,
                    0,
                ],
                4,
            ),
            Record::Take {
                cap,
                id,
                ttl,
                waiter,
                headroom,
            } => {
                let (waiter, wait, queued) = waiter.map_or((0, 0, 0), |w| {
                    (clamp(w.id), clamp(w.wait_micros()), i64::from(w.queued))
                });
                let (ttl, headroom) = (clamp(ttl), clamp(headroom));
                let args = [cap.into(), clamp(id), ttl, waiter, wait, queued, headroom];
                (Mode::Take, args, 7)
            }
            Record::Reserve {
                max_wait,
                headroom,
                id,
                notice,
            } => {
                let args = [clamp(max_wait), clamp(headroom), clamp(id), clamp(notice)];
                (
                    Mode::Reserve,
                    [args[0], args[1], args[2], args[3], 0, 0, 0],
                    4,
                )
            }
        }
    }
}

/// What [`encode_into`] writes of a request's policy: its override id (`Policy::override_id`,
/// what count overrides must have been set for), its penalty box (µs, 0: none;
/// `Policy::block_for`), and its policy-wide and plan override fields (`overrides/place.rs`;
/// the plan's 0 on no plan).
pub(super) type Terms = [u64; 4];

/// A request's arguments ([`encode_into`]) alone, as the scripts' own tests send them (the
/// store sends them after the key's override field, [`encode_for`]).
#[cfg(test)]
pub(super) fn encode(
    cost: u64,
    record: Record,
    at: i64,
    terms: Terms,
    windows: &[Window],
) -> Vec<u8> {
    let mut args = Vec::with_capacity(encoded_len(&record, cost, windows));
    encode_into(
        &mut args,
        cost,
        record,
        at,
        terms,
        windows,
        &Resolution::Unknown,
    );
    args
}

/// The bytes [`encode_into`] writes for `record` and `windows`, less an override's.
fn encoded_len(record: &Record, cost: u64, windows: &[Window]) -> usize {
    INT * (10 + record.mode(cost).2 + 5 * windows.len())
}

/// Writes a request's arguments as the scripts read them (`prelude.lua`, ARGV[1]) onto the end
/// of `args`, 64-bit little-endian integers: the number of limits, cost, mode ([`Mode`]),
/// event time (µs, -1 for now), the policy's [`Terms`], the generation of the hash of
/// overrides that `known` was made at (-1: none) and the kind of override it says applies, the
/// mode's own arguments ([`Record`]), count, window (µs) and scale of each limit, then, for
/// counts, count and scale of each limit of the override ([`Resolution::kind`]).
fn encode_into(
    args: &mut Vec<u8>,
    cost: u64,
    record: Record,
    at: i64,
    terms: Terms,
    windows: &[Window],
    known: &Resolution,
) {
    let (mode, extra, len) = record.mode(cost);
    let [id, block, all, plan] = terms.map(clamp);
    let (kind, counts) = known.kind();
    let head = [
        windows.len() as i64,
        clamp(cost),
        mode as i64,
        at,
        id,
        block,
        all,
        plan,
        known.generation(),
        kind,
    ];
    let extra = extra.into_iter().take(len);
    let ints = head.into_iter().chain(extra).chain(limits(windows));
    for value in ints.chain(counts.iter().flatten().copied()) {
        args.extend_from_slice(&value.to_le_bytes());
    }
}

/// A request's [`HEAD`] (its key's override field's length) then its arguments
/// ([`encode_into`]) under `policy`, for its key at `place`, with the override that applies
/// where this instance knows it (`known`, `overrides/known.rs`).
pub(super) fn encode_for(
    policy: &Policy,
    place: &Place,
    cost: u64,
    record: Record,
    at: i64,
    known: &Known,
) -> Vec<u8> {
    let [keep, all, plan] = overrides::head(place, policy);
    let key_field = place.key.get(..keep as usize).unwrap_or(&place.key);
    let resolution = known.resolve(place.lane, key_field, all, plan, policy);
    let terms = [policy.override_id(), policy.block_micros(), all, plan];
    let windows = policy.windows();
    let mut args = Vec::with_capacity(HEAD + encoded_len(&record, cost, windows));
    args.extend_from_slice(&clamp(keep).to_le_bytes());
    encode_into(&mut args, cost, record, at, terms, windows, &resolution);
    args
}

/// The code `scripts/release.lua` knows `algorithm`'s state by (`FIXED_WINDOW`,
/// `SLIDING_WINDOW`, `GCRA`, `SLIDING_LOG` there).
const fn release_code(algorithm: Algorithm) -> i64 {
    match algorithm {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindow => 2,
        Algorithm::Gcra => 3,
        Algorithm::SlidingLog => 4,
    }
}

/// One give-back's arguments as `scripts/release.lua` reads them: algorithm
/// ([`release_code`]), number of limits, units, the Redis time of the grant (µs), then
/// count, window and scale of each limit.
pub(super) fn encode_release(
    algorithm: Algorithm,
    units: u64,
    granted: i64,
    windows: &[Window],
) -> Vec<u8> {
    let code = release_code(algorithm);
    let head = [code, windows.len() as i64, clamp(units), granted];
    let ints = head.into_iter().chain(limits(windows));
    ints.flat_map(i64::to_le_bytes).collect()
}

/// Count, window (µs) and scale of each limit.
fn limits(windows: &[Window]) -> impl Iterator<Item = i64> + '_ {
    windows
        .iter()
        .flat_map(|w| [clamp(w.count), clamp(w.micros), clamp(w.scale)])
}

/// `v` as a script's integer; past `i64::MAX`, that (the policy's range keeps real values
/// well below).
fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// An operation on a key's concurrency slots: a give-back, a renewal, or a waiter leaving the
/// key's line. A call carries these after its decisions, as two arguments each
/// ([`args`](Self::args)), which the script uses as they come: no mode and no answer of six
/// integers, since they decide nothing (`prelude.lua`, "Slot operations"). Its answer is a
/// byte, read as `[kept, 0, 0, 0, -1, -1]` ([`answer`]), kept 1 where the slot (or the waiter)
/// was there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotOp {
    /// Gives slot `id` back, held `held` µs (0: not known).
    GiveBack { id: u64, held: u64 },
    /// Renews slot `id` for `lifetime` µs.
    Renew { id: u64, lifetime: u64 },
    /// Takes waiter `id` out of the line.
    Leave { id: u64 },
}

impl SlotOp {
    /// Its two arguments: the id (the slot's member in the key's set, or the waiter's), then
    /// what to do: a renewal's lifetime (positive), 0 for a waiter leaving, or for a give-back
    /// minus one more than the µs it was held.
    pub(super) fn args(self) -> [Value; 2] {
        let (id, what) = match self {
            SlotOp::GiveBack { id, held } => (id, -clamp(held).min(i64::MAX - 1) - 1),
            SlotOp::Renew { id, lifetime } => (id, clamp(lifetime.max(1))),
            SlotOp::Leave { id } => (id, 0),
        };
        [Value::Integer(clamp(id)), Value::Integer(what)]
    }

    /// Whether it renews a slot, which answers [`StoreError::SlotGone`] when it finds none.
    pub(super) fn is_renewal(&self) -> bool {
        matches!(self, SlotOp::Renew { .. })
    }
}

// The reply (`prelude.lua`, "Reply"): six integers per decision, Redis `TIME`, the generation of
// the hash of overrides, a byte per slot operation, then the override fields the call read
// ([`Read`]).

/// The limit index of a request refused because its key is in the policy's penalty box
/// (`BOXED` in `prelude.lua`); its retry is the time until the same request would be
/// admitted: the later of the box's end and the limits' own retry.
pub(super) const BOXED: i64 = -1;

/// The limit index of a request refused because its key holds every concurrency slot
/// or every slot not kept for the waiters ahead of it (`SLOTS_FULL` in `prelude.lua`). Its
/// answer carries the request's place in line where it waits (in place of `remaining`), the
/// time until the first slot expires (as `reset_after`) and the key's typical hold time (as
/// `retry_after`; -1 while none is known).
pub(super) const SLOTS_FULL: i64 = -2;

/// The retry of an admitted request (`-1` in `prelude.lua`'s reply).
const RETRY_ADMITTED: i64 = -1;

/// The retry of a refusal that no wait helps (`-2` in `prelude.lua`'s reply).
const RETRY_NEVER: i64 = -2;

/// The count of a request decided by its own limits, no override's (`-1` in `prelude.lua`'s
/// reply).
const COUNT_OWN: i64 = -1;

/// What a script answered for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Answer {
    /// Allowed (0, or 1 + units leased beyond the cost), limit index, remaining, reset after,
    /// retry after, and the count of the reported limit when an override set it (-1: none).
    pub(super) ints: [i64; 6],
    /// Redis `TIME` during the call, µs since the epoch.
    pub(super) time: i64,
}

/// One request's answer, or the error that failed its call.
pub(super) type Answered = Result<Answer, Error>;

/// Whether `values` is a reply to `decisions` decisions and `slot_ops` slot operations: six
/// integers each, the time, the generation, a byte each, then the fields read ([`read`]).
pub(super) fn check_length(values: &[u8], decisions: usize, slot_ops: usize) -> Result<(), Error> {
    let fixed = (6 * decisions + 2) * INT + slot_ops;
    let fields = values
        .get(fixed..)
        .and_then(|tail| Fields::new(tail).count());
    if fields.is_none() {
        let message = format!(
            "{} bytes for {decisions} decisions and {slot_ops} slot operations",
            values.len()
        );
        return Err(Error::new(ErrorKind::Parse, message));
    }
    Ok(())
}

/// What a call read of its lane's hash of overrides: the hash's generation (`-1`: Redis
/// refused the read; `0`: the hash holds none), and each field the call read with its value
/// (`None`: absent), from a reply that [`check_length`] found whole.
pub(super) fn read(values: &[u8], decisions: usize, slot_ops: usize) -> (i64, Fields<'_>) {
    let at = (6 * decisions + 1) * INT;
    let generation = values
        .get(at..at + INT)
        .and_then(|int| int.try_into().ok())
        .map_or(-1, i64::from_le_bytes);
    let tail = values.get(at + INT + slot_ops..).unwrap_or_default();
    (generation, Fields::new(tail))
}

/// The fields a call read (`prelude.lua`, "Reply"): nothing, or their number, then for each
/// the length of its name, the name, the length of its value (`-1`: absent) and the value.
pub(super) struct Fields<'a> {
    tail: &'a [u8],
    left: Option<usize>,
}

impl<'a> Fields<'a> {
    fn new(tail: &'a [u8]) -> Fields<'a> {
        let mut fields = Fields {
            tail,
            left: Some(0),
        };
        if !tail.is_empty() {
            fields.left = fields.int().and_then(|n| usize::try_from(n).ok());
        }
        fields
    }

    fn int(&mut self) -> Option<i64> {
        let (int, rest) = self.tail.split_at_checked(INT)?;
        self.tail = rest;
        Some(i64::from_le_bytes(int.try_into().ok()?))
    }

    fn bytes(&mut self, len: i64) -> Option<&'a [u8]> {
        let (bytes, rest) = self.tail.split_at_checked(usize::try_from(len).ok()?)?;
        self.tail = rest;
        Some(bytes)
    }

    /// How many fields there are, where the tail is whole and holds nothing more.
    fn count(mut self) -> Option<usize> {
        let mut n = 0;
        for field in self.by_ref() {
            field?;
            n += 1;
        }
        (self.left == Some(0) && self.tail.is_empty()).then_some(n)
    }
}

impl<'a> Iterator for Fields<'a> {
    /// A field and its value, or `None` where the tail is cut short.
    type Item = Option<(&'a [u8], Option<&'a [u8]>)>;

    fn next(&mut self) -> Option<Self::Item> {
        let left = self.left?;
        if left == 0 {
            return None;
        }
        let mut field = || {
            let len = self.int()?;
            let name = self.bytes(len)?;
            let value = match self.int()? {
                -1 => None,
                len => Some(self.bytes(len)?),
            };
            Some((name, value))
        };
        let field = field();
        self.left = field.map(|_| left - 1);
        Some(field)
    }
}

/// The answer to request `i` (in the reply's order) in a reply of the right length to
/// `decisions` decisions and any slot operations after them.
pub(super) fn answer(values: &[u8], decisions: usize, i: usize) -> Answer {
    let int = |at: usize| {
        let mut le = [0; INT];
        le.copy_from_slice(&values[at..at + INT]);
        i64::from_le_bytes(le)
    };
    let time_at = 6 * decisions * INT;
    let time = int(time_at);
    if i >= decisions {
        let kept = values[time_at + 2 * INT + (i - decisions)] == b'1';
        return Answer {
            ints: [i64::from(kept), 0, 0, 0, RETRY_ADMITTED, COUNT_OWN],
            time,
        };
    }
    let mut ints = [0; 6];
    for (j, value) in ints.iter_mut().enumerate() {
        *value = int((6 * i + j) * INT);
    }
    Answer { ints, time }
}

/// A script's answer to one request, read under its policy.
pub(super) struct Verdict {
    pub(super) outcome: Outcome,
    /// The units leased beyond the request's cost.
    pub(super) extra: u64,
    /// The count of the reported limit when an override set it.
    pub(super) count: Option<u64>,
    /// When the key is in the policy's penalty box: how long (µs) until the request would be
    /// admitted.
    boxed: Option<u64>,
    /// When the key has no concurrency slot free for the request: why.
    slots_full: Option<Full>,
}

impl Verdict {
    /// The verdict for a key in its policy's penalty box, admitted in `left` µs.
    fn boxed(left: u64) -> Verdict {
        Verdict {
            outcome: Outcome {
                allowed: false,
                index: 0,
                remaining: 0,
                reset_after: left,
                retry_after: Some(left),
            },
            extra: 0,
            count: None,
            boxed: Some(left),
            slots_full: None,
        }
    }

    /// The decision it tells, under `policy` or the override's count.
    pub(super) fn decision(&self, policy: &Policy) -> Decision {
        if let Some(full) = self.slots_full {
            return Decision::refused_slot(policy, full);
        }
        if let Some(left) = self.boxed {
            let left = std::time::Duration::from_micros(left);
            return Decision::boxed(policy, left).with_limit(self.count);
        }
        Decision::from_outcome(self.outcome, policy).with_limit(self.count)
    }
}

impl Answer {
    /// Reads `{allowed, index, remaining, reset_after, retry_after, count}` under `policy`.
    pub(super) fn verdict(&self, policy: &Policy) -> Result<Verdict, StoreError> {
        let bad = || StoreError::Reply(format!("{:?}", self.ints));
        let [allowed, index, remaining, reset_after, retry_after, count] = self.ints;
        let non_negative = |v: i64| u64::try_from(v).map_err(|_| bad());
        let count = match count {
            COUNT_OWN => None,
            v => Some(non_negative(v)?),
        };
        match index {
            BOXED => {
                return Ok(Verdict {
                    count,
                    ..Verdict::boxed(non_negative(retry_after)?)
                })
            }
            SLOTS_FULL => {
                let full = Full {
                    left: non_negative(reset_after)?,
                    place: non_negative(remaining)?,
                    hold: u64::try_from(retry_after).unwrap_or(0),
                };
                return Ok(Verdict {
                    slots_full: Some(full),
                    ..Verdict::boxed(full.left)
                });
            }
            _ => {}
        }
        let index = usize::try_from(index)
            .ok()
            .filter(|&i| i < policy.limits().len())
            .ok_or_else(bad)?;
        let outcome = Outcome {
            allowed: allowed >= 1,
            index,
            remaining: non_negative(remaining)?,
            reset_after: non_negative(reset_after)?,
            retry_after: match retry_after {
                RETRY_ADMITTED | RETRY_NEVER => None,
                v => Some(non_negative(v)?),
            },
        };
        Ok(Verdict {
            outcome,
            extra: non_negative(allowed.max(1) - 1)?,
            count,
            boxed: None,
            slots_full: None,
        })
    }
}
