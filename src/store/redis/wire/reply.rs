//! A call's reply (`prelude.lua`, "Reply"): how the answer of each request is read.

use fred::error::{Error, ErrorKind};

use super::request::INT;
use crate::model::slots::Full;
use crate::model::Outcome;
use crate::{Decision, Policy, StoreError};

// The reply (`prelude.lua`, "Reply"): six integers per decision, Redis `TIME`, the generation of
// the hash of overrides, a byte per slot operation, then the override fields the call read
// ([`Read`]).

/// The limit index of a request refused because its key is in the policy's penalty box
/// (`BOXED` in `prelude.lua`); its retry is the time until the same request would be
/// admitted: the later of the box's end and the limits' own retry.
pub(crate) const BOXED: i64 = -1;

/// The limit index of a request refused because its key holds every concurrency slot
/// or every slot not kept for the waiters ahead of it (`SLOTS_FULL` in `prelude.lua`). Its
/// answer carries the request's place in line where it waits (in place of `remaining`), the
/// time until the first slot expires (as `reset_after`) and the key's typical hold time (as
/// `retry_after`; -1 while none is known).
pub(crate) const SLOTS_FULL: i64 = -2;

/// The `allowed` of a request refused only because attempts in flight hold what it needs
/// (`BUSY` in `prelude.lua`, "Attempts"): no failure, and no penalty box.
const BUSY: i64 = -1;

/// The limit index of an event time further back than the longest window (less a leasing
/// store's headroom) before Redis' now (`TOO_OLD` in `sliding_log.lua`):
/// [`StoreError::EventTooOld`].
const TOO_OLD: i64 = -3;

/// The limit index of a request the plain tier does not decide (`FULL_PATH` in `plain.lua`):
/// nothing was decided and nothing recorded, and the store decides the request again with the
/// full script ([`Tier::Full`](crate::store::redis::scripts::Tier::Full)). Its answer is
/// `0 FULL_PATH 0 0 -2 -1`.
pub(crate) const FULL_PATH: i64 = -4;

/// The generation of the hash of overrides in a plain script's reply (`plain.lua`): the call
/// did not read the hash, so its reply teaches the store nothing ([`read`]).
const NOT_READ: i64 = -2;

/// The generation [`read`] gives where the reply does not say it: Redis refused the read.
const NOT_KNOWN: i64 = -1;

/// The retry of an admitted request (`-1` in `prelude.lua`'s reply).
const RETRY_ADMITTED: i64 = -1;

/// The retry of a refusal that no wait helps (`-2` in `prelude.lua`'s reply).
const RETRY_NEVER: i64 = -2;

/// The count of a request decided by its own limits, no override's (`-1` in `prelude.lua`'s
/// reply).
const COUNT_OWN: i64 = -1;

/// What a script answered for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Allowed (0, or 1 + units leased beyond the cost), limit index, remaining, reset after,
    /// retry after, and the count of the reported limit when an override set it (-1: none).
    pub(crate) ints: [i64; 6],
    /// Redis `TIME` during the call, µs since the epoch.
    pub(crate) time: i64,
}

/// One request's answer, or the error that failed its call.
pub(crate) type Answered = Result<Answer, Error>;

/// Whether `values` is a reply to `decisions` decisions and `slot_ops` slot operations: six
/// integers each, the time, the generation, a byte each, then the fields read ([`read`]).
pub(crate) fn check_length(values: &[u8], decisions: usize, slot_ops: usize) -> Result<(), Error> {
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
/// refused the read, or the call did not read it, as a plain script does; `0`: the hash holds
/// none) and Redis's time (µs) then, and each field the call read with its value (`None`:
/// absent), from a reply that [`check_length`] found whole. A generation of `-1` teaches the
/// store nothing (`overrides/known.rs`, `learn`).
pub(crate) fn read(values: &[u8], decisions: usize, slot_ops: usize) -> ((i64, i64), Fields<'_>) {
    let int = |at: usize| {
        let bytes = values.get(at..at + INT)?.try_into().ok()?;
        Some(i64::from_le_bytes(bytes))
    };
    let at = (6 * decisions + 1) * INT;
    let time = int(at - INT).unwrap_or(0);
    let generation = int(at).unwrap_or(NOT_KNOWN);
    if generation == NOT_READ {
        return ((NOT_KNOWN, time), Fields::new(&[]));
    }
    let tail = values.get(at + INT + slot_ops..).unwrap_or_default();
    ((generation, time), Fields::new(tail))
}

/// The fields a call read (`prelude.lua`, "Reply"): nothing, or their number, then for each
/// the length of its name, the name, the length of its value (`-1`: absent) and the value.
pub(crate) struct Fields<'a> {
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
pub(crate) fn answer(values: &[u8], decisions: usize, i: usize) -> Answer {
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
pub(crate) struct Reading {
    pub(crate) outcome: Outcome,
    /// The units leased beyond the request's cost.
    pub(crate) extra: u64,
    /// The count of the reported limit when an override set it.
    pub(crate) count: Option<u64>,
    /// When the key is in the policy's penalty box: how long (µs) until the request would be
    /// admitted.
    boxed: Option<u64>,
    /// When the key has no concurrency slot free for the request: why.
    slots_full: Option<Full>,
    /// Refused only because attempts in flight hold what the request needs (`allowed` -1,
    /// `prelude.lua`, "Attempts").
    busy: bool,
}

impl Reading {
    /// The verdict for a key in its policy's penalty box, admitted in `left` µs.
    fn boxed(left: u64) -> Reading {
        Reading {
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
            busy: false,
        }
    }

    /// The decision it tells, under `policy` or the override's count.
    pub(crate) fn decision(&self, policy: &Policy) -> Decision {
        if let Some(full) = self.slots_full {
            return Decision::refused_slot(policy, full);
        }
        if let Some(left) = self.boxed {
            let left = std::time::Duration::from_micros(left);
            return Decision::boxed(policy, left).with_limit(self.count);
        }
        let decision = Decision::from_outcome(self.outcome, policy).with_limit(self.count);
        match (self.busy, self.outcome.retry_after) {
            (true, Some(retry)) => decision.made_busy(std::time::Duration::from_micros(retry)),
            _ => decision,
        }
    }
}

impl Answer {
    /// Reads `{allowed, index, remaining, reset_after, retry_after, count}` under `policy`.
    pub(crate) fn verdict(&self, policy: &Policy) -> Result<Reading, StoreError> {
        let bad = || StoreError::Reply(format!("{:?}", self.ints));
        let [allowed, index, remaining, reset_after, retry_after, count] = self.ints;
        let non_negative = |v: i64| u64::try_from(v).map_err(|_| bad());
        let count = match count {
            COUNT_OWN => None,
            v => Some(non_negative(v)?),
        };
        match index {
            BOXED => {
                return Ok(Reading {
                    count,
                    ..Reading::boxed(non_negative(retry_after)?)
                })
            }
            TOO_OLD => return Err(StoreError::EventTooOld),
            // Not decided: the store sends such a request on to the full tier before it reads
            // a verdict.
            FULL_PATH => return Err(bad()),
            SLOTS_FULL => {
                let full = Full {
                    left: non_negative(reset_after)?,
                    place: non_negative(remaining)?,
                    hold: u64::try_from(retry_after).unwrap_or(0),
                };
                return Ok(Reading {
                    slots_full: Some(full),
                    ..Reading::boxed(full.left)
                });
            }
            _ => {}
        }
        // A policy without rate limits answers index 0 (`NO_LIMITS` in `prelude.lua`).
        let index = usize::try_from(index)
            .ok()
            .filter(|&i| i < policy.limits().len().max(1))
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
        Ok(Reading {
            outcome,
            extra: non_negative(allowed.max(1) - 1)?,
            count,
            boxed: None,
            slots_full: None,
            busy: allowed == BUSY,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain script's reply to two decisions: twelve integers, Redis `TIME`, and the
    /// generation it did not read.
    fn plain_reply() -> Vec<u8> {
        let ints = [
            1,
            0,
            9,
            100,
            -1,
            -1,
            0,
            FULL_PATH,
            0,
            0,
            -2,
            -1,
            1_700_000_000,
            NOT_READ,
        ];
        ints.iter().flat_map(|v: &i64| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_plain_reply_is_whole_and_teaches_nothing_of_the_overrides() {
        let reply = plain_reply();
        check_length(&reply, 2, 0).expect("six integers each, the time and the generation");
        let (read, fields) = read(&reply, 2, 0);
        assert_eq!(read, (NOT_KNOWN, 1_700_000_000));
        assert_eq!(fields.count(), Some(0));
        assert_eq!(answer(&reply, 2, 1).ints[1], FULL_PATH);
    }

    #[test]
    fn a_full_path_answer_is_no_verdict() {
        let limit = crate::Limit::new(1, std::time::Duration::from_secs(1)).unwrap();
        let policy = Policy::new("p", [limit]).unwrap();
        let answer = answer(&plain_reply(), 2, 1);
        assert!(
            answer.verdict(&policy).is_err(),
            "the store decides it again"
        );
    }
}
