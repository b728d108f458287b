//! A call's keys and arguments (`prelude.lua`, "Arguments"): how one request is encoded.

use bytes::Bytes;
use fred::types::Value;

use crate::model::slots::Waiter;
use crate::model::{Algorithm, Window};
use crate::store::redis::overrides::{self, Known, Resolution};
use crate::store::redis::placement::Place;
use crate::Policy;

pub(crate) const INT: usize = std::mem::size_of::<i64>();

/// Bytes that [`encode_for`] puts before a decision's arguments: the length of its key's
/// override field (the first bytes of its state key, `overrides/place.rs`), which a call passes
/// apart from the arguments ([`Heads`]).
pub(crate) const HEAD: usize = INT;

/// Where in a decision's arguments ([`encode_into`]) its policy-wide and plan fields are.
const FIELDS_AT: usize = 6 * INT;

/// ARGV[3] of a call, what finds its decisions' override fields: the length of each
/// decision's key field ([`HEAD`] bytes each, in the decisions' order), then the number of
/// policy-wide and plan fields the decisions name, and each of those once (`prelude.lua`,
/// "Overrides"): the script reads every field with one `HMGET`.
#[derive(Debug, Default)]
pub(crate) struct Heads {
    keys: Vec<u8>,
    fields: Vec<i64>,
}

impl Heads {
    pub(crate) fn with_capacity(decisions: usize) -> Heads {
        Heads {
            keys: Vec::with_capacity(HEAD * decisions),
            fields: Vec::new(),
        }
    }

    /// Takes in a decision's [`HEAD`] and arguments.
    pub(crate) fn push(&mut self, head: &[u8], args: &[u8]) {
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
    pub(crate) fn bytes(self) -> Bytes {
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
pub(crate) fn argv(
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
pub(crate) enum Mode {
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
    /// settled, the units it recorded, headroom, and when its units start draining (-1: at
    /// admission; a single-limit GCRA attempt's, after the units ahead of it).
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
pub(crate) enum Record {
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
        /// When a refunded attempt's units start draining in a single-limit GCRA bucket,
        /// after the units ahead of them (Redis time, µs; -1: at `admitted`).
        drains: i64,
    },
    /// Decide and record as [`Admit`](Record::Admit) (or as a lease of the cost alone, with
    /// `headroom` µs of drain kept free in every GCRA bucket, when `headroom` is not 0), sent
    /// with no penalty box: a step of a metered body (`Engine::step`), which no box refuses
    /// and whose refusal sets none.
    Step { headroom: u64 },
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
            Record::Admit | Record::Step { headroom: 0 } => (Mode::Admit, [0; 7], 0),
            Record::Step { headroom } => (
                Mode::Lease,
                [clamp(cost), clamp(headroom), 0, 0, 0, 0, 0],
                2,
            ),
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
                drains,
            } => (
                Mode::Settle,
                [
                    i64::from(refund),
                    admitted,
                    clamp(recorded),
                    clamp(headroom),
                    drains,
                    0,
                    0,
                ],
                5,
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
pub(crate) type Terms = [u64; 4];

/// A request's arguments ([`encode_into`]) alone, as the scripts' own tests send them (the
/// store sends them after the key's override field, [`encode_for`]).
#[cfg(test)]
pub(crate) fn encode(
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
        0,
    );
    args
}

/// The bytes [`encode_into`] writes for `record` and `windows`, less an override's.
fn encoded_len(record: &Record, cost: u64, windows: &[Window]) -> usize {
    INT * (11 + record.mode(cost).2 + 5 * windows.len())
}

/// Writes a request's arguments as the scripts read them (`prelude.lua`, ARGV[1]) onto the end
/// of `args`, 64-bit little-endian integers: the number of limits, cost, mode ([`Mode`]),
/// event time (µs, -1 for now), the policy's [`Terms`], the generation of the hash of
/// overrides that `known` was made at (-1: none) and the kind of override it says applies, the
/// attempt the request is or settles (0: none; `prelude.lua`, "Attempts"), the mode's own
/// arguments ([`Record`]), count, window (µs) and scale of each limit, then, for
/// counts, count and scale of each limit of the override ([`Resolution::kind`]).
#[allow(clippy::too_many_arguments)]
fn encode_into(
    args: &mut Vec<u8>,
    cost: u64,
    record: Record,
    at: i64,
    terms: Terms,
    windows: &[Window],
    known: &Resolution,
    attempt: u64,
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
        clamp(attempt),
    ];
    let extra = extra.into_iter().take(len);
    let ints = head.into_iter().chain(extra).chain(limits(windows));
    for value in ints.chain(counts.iter().flatten().copied()) {
        args.extend_from_slice(&value.to_le_bytes());
    }
}

/// A request's [`HEAD`] (its key's override field's length) then its arguments
/// ([`encode_into`]) under `policy`, for its key at `place`, with the override that applies
/// where this instance knows it (`known`, `overrides/known.rs`), as `attempt` (0: none).
pub(crate) fn encode_for(
    policy: &Policy,
    place: &Place,
    units: (u64, u64),
    record: Record,
    at: i64,
    known: &Known,
) -> Vec<u8> {
    let resolution = resolve(policy, place, known);
    encode_with(policy, place, units, record, at, &resolution)
}

/// The override that applies to a request under `policy` for its key at `place`, where this
/// instance knows it (`overrides/known.rs`).
pub(crate) fn resolve(policy: &Policy, place: &Place, known: &Known) -> Resolution {
    let [keep, all, plan] = overrides::head(place, policy);
    let key_field = place.key.get(..keep as usize).unwrap_or(&place.key);
    known.resolve(place.lane, key_field, all, plan, policy)
}

/// Whether the plain tier (`scripts/plain.lua`) decides a request of `record` under `policy`,
/// as attempt `attempt` (0: none), at event time `at` (-1: now): a look, an admission, a
/// lease or a step, at now, with no penalty box (a step is sent without one), no concurrency
/// slot and no attempt. Where its overrides are known too ([`Known::plain_ok`]), the store
/// sends it there.
pub(crate) fn plain_eligible(record: &Record, policy: &Policy, attempt: u64, at: i64) -> bool {
    let boxed = policy.block_micros() != 0;
    let fits = match record {
        Record::Look { .. } | Record::Admit | Record::Lease { .. } => !boxed,
        Record::Step { .. } => true,
        Record::Settle { .. } | Record::Take { .. } | Record::Reserve { .. } => false,
    };
    fits && attempt == 0 && at < 0 && policy.concurrency_limit().is_none()
}

/// [`encode_for`] with the override `resolution` found by [`resolve`].
pub(crate) fn encode_with(
    policy: &Policy,
    place: &Place,
    (cost, attempt): (u64, u64),
    record: Record,
    at: i64,
    resolution: &Resolution,
) -> Vec<u8> {
    let [keep, all, plan] = overrides::head(place, policy);
    // A step is decided by the limits alone: sent with no penalty box to meet or set.
    let block = match record {
        Record::Step { .. } => 0,
        _ => policy.block_micros(),
    };
    let terms = [policy.override_id(), block, all, plan];
    let windows = policy.windows();
    let mut args = Vec::with_capacity(HEAD + encoded_len(&record, cost, windows));
    args.extend_from_slice(&clamp(keep).to_le_bytes());
    encode_into(
        &mut args, cost, record, at, terms, windows, resolution, attempt,
    );
    args
}

/// The code `scripts/return.lua` knows `algorithm`'s state by (`FIXED_WINDOW`,
/// `SLIDING_WINDOW`, `GCRA`, `SLIDING_LOG` there).
const fn return_code(algorithm: Algorithm) -> i64 {
    match algorithm {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingWindow => 2,
        Algorithm::Gcra => 3,
        Algorithm::SlidingLog => 4,
    }
}

/// One give-back's arguments as `scripts/return.lua` reads them: algorithm
/// ([`return_code`]), number of limits, units, the Redis time of the grant (µs), then
/// count, window and scale of each limit.
pub(crate) fn encode_return(
    algorithm: Algorithm,
    units: u64,
    granted: i64,
    windows: &[Window],
) -> Vec<u8> {
    let code = return_code(algorithm);
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
pub(crate) enum SlotOp {
    /// Gives slot `id` back, held `held` µs (0: not known).
    Release { id: u64, held: u64 },
    /// Renews slot `id` for `lifetime` µs.
    Renew { id: u64, lifetime: u64 },
    /// Takes waiter `id` out of the line.
    Leave { id: u64 },
}

impl SlotOp {
    /// Its two arguments: the id (the slot's member in the key's set, or the waiter's), then
    /// what to do: a renewal's lifetime (positive), 0 for a waiter leaving, or for a give-back
    /// minus one more than the µs it was held.
    pub(crate) fn args(self) -> [Value; 2] {
        let (id, what) = match self {
            SlotOp::Release { id, held } => (id, -clamp(held).min(i64::MAX - 1) - 1),
            SlotOp::Renew { id, lifetime } => (id, clamp(lifetime.max(1))),
            SlotOp::Leave { id } => (id, 0),
        };
        [Value::Integer(clamp(id)), Value::Integer(what)]
    }

    /// Whether it renews a slot, which answers [`StoreError::SlotGone`] when it finds none.
    pub(crate) fn is_renewal(&self) -> bool {
        matches!(self, SlotOp::Renew { .. })
    }
}
