//! The plain tier's arguments (`scripts/plain.lua`, ARGV[1]): which requests it decides
//! ([`plain_generation`]) and what of a request's full arguments
//! ([`encode_for`](super::encode_for)) a plain decision reads, and nothing else, both read
//! from those arguments by one reader.
//!
//! A request is encoded once, for the full scripts, and kept so, since the plain tier sends
//! on to the full one what it does not decide ([`FULL_PATH`](super::FULL_PATH)). A plain call
//! carries each request's fields that a look, an admission or a lease reads (five integers
//! instead of eleven before the mode's own and the limits), made from those bytes as the call
//! is laid out: every field is one integer more for Redis to unpack, about a tenth of a plain
//! GCRA decision's instructions for the six left out (`docs/performance.md`). The checks the
//! script made of the fields left out are made here, against the generation the call's
//! confirmation carries ([`plain_args`]).

use super::request::{Mode, HEAD, INT};

/// The kinds of override a request carries (`prelude.lua`, "Overrides"): only counts add
/// fields (a count and a scale per limit).
const COUNTS: i64 = -2;

/// A request's integers before its mode's own in the full arguments (`prelude.lua`, ARGV[1]):
/// n, cost, mode, event time, override id, penalty box, policy-wide and plan fields, known,
/// kind and attempt.
const FULL_HEAD: usize = 11;

/// What a plain call carries for a request the plain tier must not decide: a head of five
/// integers that reads as an admission at now with no override and n of -1, so no more
/// integers follow, which the script answers [`FULL_PATH`](super::FULL_PATH).
const SEND_FULL: [i64; 5] = [-1, 0, Mode::Admit as i64, -1, 0];

/// The plain tier's arguments for the `decisions` requests `full` holds one after the other
/// (each as [`encode_for`](super::encode_for) writes it, less its [`HEAD`](super::HEAD)), in
/// a call whose confirmation carries generation `confirmed`. Each request is n, cost, mode,
/// event time and the kind of override, then a look's or a lease's want and headroom, count,
/// window and scale of each limit, and an override's count and scale of each limit where it
/// sets counts. A request that the plain tier does not decide, as `plain.lua` once checked of
/// the fields left out (another mode than a look, an admission or a lease; an attempt; a
/// penalty box at now; resolved at another generation than the one confirmed), and any past
/// bytes that do not read as a request, are [`SEND_FULL`].
pub(crate) fn plain_args(full: &[u8], decisions: usize, confirmed: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(full.len() / 2);
    let mut at = 0;
    for _ in 0..decisions {
        let read = (at < full.len()).then(|| one(full, at)).flatten();
        match read {
            Some((next, ints)) => {
                at = next;
                match ints.decided(confirmed) {
                    true => ints.write(&mut out),
                    false => write(&mut out, SEND_FULL),
                }
            }
            None => {
                at = full.len();
                write(&mut out, SEND_FULL);
            }
        }
    }
    out
}

/// One request's full arguments, read in place.
struct Full<'a> {
    head: [i64; FULL_HEAD],
    /// The mode's own integers.
    extra: &'a [u8],
    /// Count, window and scale of each limit, then an override's counts.
    rest: &'a [u8],
}

/// The generation of the hash of overrides a request encoded as `args` ([`encode_for`], its
/// [`HEAD`] first) was resolved at, where the plain tier decides it: a look, an admission or a
/// lease, at now, with no penalty box and no attempt, whose override is known (what
/// [`plain_eligible`](super::plain_eligible) says of the request before it is encoded; a
/// concurrency slot is its own mode). `None` otherwise.
///
/// [`encode_for`]: super::encode_for
pub(crate) fn plain_generation(args: &[u8]) -> Option<i64> {
    let (_, request) = one(args, HEAD)?;
    let [_, _, _, t, _, block, _, _, known, _, _] = request.head;
    (request.plain_mode() && t < 0 && block == 0 && known >= 0).then_some(known)
}

impl Full<'_> {
    /// Whether its mode is one the plain tier decides, and it is no attempt.
    fn plain_mode(&self) -> bool {
        let [_, _, mode, _, _, _, _, _, _, _, attempt] = self.head;
        let modes = [Mode::Look, Mode::Admit, Mode::Lease].map(|mode| mode as i64);
        modes.contains(&mode) && attempt == 0
    }

    /// Whether the plain tier decides it in a call confirmed at generation `confirmed`.
    fn decided(&self, confirmed: i64) -> bool {
        let [_, _, _, t, _, block, _, _, known, _, _] = self.head;
        self.plain_mode() && !(block > 0 && t < 0) && known == confirmed
    }

    /// Writes its plain arguments onto `out`.
    fn write(&self, out: &mut Vec<u8>) {
        let [n, cost, mode, t, _, _, _, _, _, kind, _] = self.head;
        write(out, [n, cost, mode, t, kind]);
        out.extend_from_slice(self.extra);
        out.extend_from_slice(self.rest);
    }
}

/// The request whose full arguments start at byte `at` of `full`, and the byte after them;
/// `None` where they do not read as one.
fn one(full: &[u8], at: usize) -> Option<(usize, Full<'_>)> {
    let int = |i: usize| {
        let from = at.checked_add(i.checked_mul(INT)?)?;
        let bytes = full.get(from..from.checked_add(INT)?)?;
        Some(i64::from_le_bytes(bytes.try_into().ok()?))
    };
    let mut head = [0; FULL_HEAD];
    for (i, value) in head.iter_mut().enumerate() {
        *value = int(i)?;
    }
    let (n, mode, kind) = (usize::try_from(head[0]).ok()?, head[2], head[9]);
    let extra = match mode {
        m if m == Mode::Look as i64 || m == Mode::Lease as i64 => 2,
        m if m == Mode::Admit as i64 => 0,
        m if m == Mode::Settle as i64 => 5,
        m if m == Mode::Take as i64 => 7,
        m if m == Mode::Reserve as i64 => 4,
        _ => return None,
    };
    let counts = if kind == COUNTS { 2 * n } else { 0 };
    let start = at.checked_add(FULL_HEAD * INT)?;
    let middle = start.checked_add(extra * INT)?;
    let end = middle.checked_add(n.checked_mul(3)?.checked_add(counts)?.checked_mul(INT)?)?;
    let request = Full {
        head,
        extra: full.get(start..middle)?,
        rest: full.get(middle..end)?,
    };
    Some((end, request))
}

fn write<const N: usize>(out: &mut Vec<u8>, ints: [i64; N]) {
    for value in ints {
        out.extend_from_slice(&value.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::wire::{encode, Record};
    use crate::Limit;

    fn ints(bytes: &[u8]) -> Vec<i64> {
        let chunks = bytes.chunks_exact(INT);
        chunks
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn windows(limits: &[&str]) -> Vec<crate::model::Window> {
        let limits: Vec<Limit> = limits.iter().map(|l| l.parse().unwrap()).collect();
        let policy = crate::Policy::new("p", limits).unwrap();
        policy.windows().to_vec()
    }

    /// A look, an admission and a lease keep their head's five fields, the mode's own and the
    /// limits; the fields left out are those `plain.lua` does not read.
    #[test]
    fn a_plain_request_keeps_what_the_plain_tier_reads() {
        let w = windows(&["10/1s", "100/1m"]);
        let lease = Record::Lease {
            want: 5,
            headroom: 7,
        };
        let mut full = encode(2, Record::Admit, -1, [9, 0, 3, 4], &w);
        full.extend(encode(1, lease, -1, [9, 0, 3, 4], &w));
        let plain = ints(&plain_args(&full, 2, -1));
        let limits: Vec<i64> = w
            .iter()
            .flat_map(|w| [w.count as i64, w.micros as i64, w.scale as i64])
            .collect();
        let admit = [vec![2, 2, Mode::Admit as i64, -1, 0], limits.clone()].concat();
        let leased = [vec![2, 1, Mode::Lease as i64, -1, 0, 5, 7], limits].concat();
        assert_eq!(plain, [admit, leased].concat());
    }

    /// A look, an admission or a lease at now with no box or attempt, resolved at a known
    /// generation, is decided plain, at that generation; an unknown generation, an event time,
    /// a penalty box and a settlement are not.
    #[test]
    fn which_requests_the_plain_tier_decides() {
        let w = windows(&["10/1s"]);
        let known = |mut args: Vec<u8>, generation: i64| {
            args[8 * INT..9 * INT].copy_from_slice(&generation.to_le_bytes());
            [vec![0; HEAD], args].concat()
        };
        let look = Record::Look { headroom: 0 };
        let settle = Record::Settle {
            refund: false,
            admitted: 5,
            recorded: 1,
            headroom: 0,
            drains: -1,
        };
        let admit = encode(1, Record::Admit, -1, [0; 4], &w);
        assert_eq!(plain_generation(&known(admit.clone(), 3)), Some(3));
        assert_eq!(
            plain_generation(&known(encode(1, look, -1, [0; 4], &w), 0)),
            Some(0)
        );
        assert_eq!(plain_generation(&[vec![0; HEAD], admit].concat()), None);
        let at = encode(1, Record::Admit, 1_000, [0; 4], &w);
        assert_eq!(plain_generation(&known(at, 3)), None);
        let boxed = encode(1, Record::Admit, -1, [0, 1_000, 0, 0], &w);
        assert_eq!(plain_generation(&known(boxed, 3)), None);
        assert_eq!(
            plain_generation(&known(encode(1, settle, -1, [0; 4], &w), 3)),
            None
        );
    }

    /// A request resolved at another generation than the call's, one with a penalty box at
    /// now, a settlement, and bytes that end mid-request are sent full, each five integers,
    /// and the requests after them still read.
    #[test]
    fn what_the_plain_tier_does_not_decide_is_sent_full() {
        let w = windows(&["10/1s"]);
        let settle = Record::Settle {
            refund: true,
            admitted: 5,
            recorded: 1,
            headroom: 0,
            drains: -1,
        };
        let mut full = encode(1, Record::Admit, -1, [0, 1_000, 0, 0], &w);
        full.extend(encode(1, settle, -1, [0; 4], &w));
        full.extend(encode(1, Record::Admit, -1, [0; 4], &w));
        let plain = ints(&plain_args(&full, 3, -1));
        let limit = [w[0].count, w[0].micros, w[0].scale].map(|v| v as i64);
        let admit = [&[1, 1, Mode::Admit as i64, -1, 0][..], &limit].concat();
        assert_eq!(plain, [&SEND_FULL[..], &SEND_FULL, &admit].concat());
        // Confirmed at another generation than the requests' (-1: unknown).
        assert_eq!(ints(&plain_args(&full[..], 3, 0)), SEND_FULL.repeat(3));
        let cut = &full[..full.len() - INT];
        assert_eq!(ints(&plain_args(cut, 3, -1)), SEND_FULL.repeat(3));
    }
}
