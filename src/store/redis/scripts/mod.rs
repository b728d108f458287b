//! The store's Lua scripts, put together from the `.lua` files beside this one at compile
//! time, and hashed once for `EVALSHA`. Each file's header states its keys, arguments and
//! reply; `prelude.lua`'s is the contract that `wire/` keeps on the Rust side.

use fred::types::scripts::Script;

use crate::model::Algorithm;

/// A script: integers as text and the keys' expiry, exact arithmetic past 2^53, the shared
/// prelude (arguments, reply, `TIME`), then, for the algorithms that use it, the driver that
/// combines limits (the counters) or the format of events (the sliding log), then the
/// algorithm's own file. A plain script has its own prelude (`plain.lua`) instead, and the
/// sliding log's no exact arithmetic.
macro_rules! script {
    (log, $file:literal) => {
        concat!(
            include_str!("expiry.lua"),
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!("log_events.lua"),
            include_str!("log_lighten.lua"),
            include_str!($file)
        )
    };
    ($file:literal) => {
        concat!(
            include_str!("expiry.lua"),
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!($file)
        )
    };
    (driver, $file:literal) => {
        concat!(
            include_str!("expiry.lua"),
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!("common.lua"),
            include_str!($file)
        )
    };
    (plain, $file:literal) => {
        concat!(
            include_str!("expiry.lua"),
            include_str!("exact.lua"),
            include_str!("plain.lua"),
            include_str!($file)
        )
    };
    (plain log, $file:literal) => {
        concat!(
            include_str!("expiry.lua"),
            include_str!("plain.lua"),
            include_str!("log_events.lua"),
            include_str!($file)
        )
    };
}

/// Which of an algorithm's scripts decides a request. Both read the same request (the plain
/// tier what of its arguments it decides by, `wire/plain.rs`) and keep the same state byte for
/// byte, so that a key's requests may go to either, one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Tier {
    /// Looks, admissions and leases of a policy that uses no penalty box, slot, attempt or
    /// line, with the override its arguments carry (`plain.lua`): such a decision pays for
    /// none of those features, nor for reading the hash of overrides. What it does not
    /// decide it answers [`FULL_PATH`](crate::store::redis::wire::FULL_PATH), recording
    /// nothing. Its reply's generation is "not read".
    Plain,
    /// Every request, every feature (`prelude.lua`).
    Full,
}

/// The text of `algorithm`'s script of `tier`. GCRA and the sliding log do without the
/// driver, for speed (their headers say why). The counters have no plain script yet: their
/// plain tier is the full script, which takes the full arguments (no request of theirs is
/// sent plain: [`Scripts::has_plain`]).
pub(crate) const fn source(algorithm: Algorithm, tier: Tier) -> &'static str {
    match (algorithm, tier) {
        (Algorithm::SlidingLog, Tier::Plain) => script!(plain log, "sliding_log_plain.lua"),
        (Algorithm::SlidingLog, Tier::Full) => script!(log, "sliding_log.lua"),
        (Algorithm::SlidingWindow, _) => script!(driver, "sliding_window.lua"),
        (Algorithm::FixedWindow, _) => script!(driver, "fixed_window.lua"),
        (Algorithm::Gcra, Tier::Plain) => script!(plain, "gcra_plain.lua"),
        (Algorithm::Gcra, Tier::Full) => script!("gcra.lua"),
    }
}

/// The text of `scripts/return.lua`, which gives leased units back: it decides nothing, so
/// it goes without the prelude; it makes the sliding log's events lighter as the log's own
/// script does (`scripts/log_lighten.lua`).
const RETURN: &str = concat!(
    include_str!("expiry.lua"),
    include_str!("exact.lua"),
    include_str!("log_events.lua"),
    include_str!("log_lighten.lua"),
    include_str!("return.lua")
);

/// The text of `scripts/line.lua`, the line of reservations of a key (`src/model/line.rs`): it
/// decides nothing, and stands alone.
const LINE: &str = include_str!("line.lua");

/// The store's scripts, hashed once (`EVALSHA` names a script by its SHA-1).
pub(crate) struct Scripts {
    sliding_log: Script,
    sliding_window: Script,
    fixed_window: Script,
    gcra: Script,
    /// The plain tier of the sliding log and of GCRA ([`Tier::Plain`]).
    sliding_log_plain: Script,
    gcra_plain: Script,
    /// `scripts/return.lua`.
    pub(crate) returns: Script,
    /// `scripts/line.lua`.
    pub(crate) line: Script,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        let script = |algorithm| Script::from_lua(source(algorithm, Tier::Full));
        let plain = |algorithm| Script::from_lua(source(algorithm, Tier::Plain));
        Scripts {
            sliding_log: script(Algorithm::SlidingLog),
            sliding_window: script(Algorithm::SlidingWindow),
            fixed_window: script(Algorithm::FixedWindow),
            gcra: script(Algorithm::Gcra),
            sliding_log_plain: plain(Algorithm::SlidingLog),
            gcra_plain: plain(Algorithm::Gcra),
            returns: Script::from_lua(RETURN),
            line: Script::from_lua(LINE),
        }
    }

    /// The script of `tier` that decides `algorithm`'s requests (a full one takes slot
    /// operations; a plain one none). An algorithm without a plain script
    /// ([`has_plain`](Self::has_plain)) answers its full one for both tiers.
    pub(crate) fn of(&self, algorithm: Algorithm, tier: Tier) -> &Script {
        match (algorithm, tier) {
            (Algorithm::SlidingLog, Tier::Plain) => &self.sliding_log_plain,
            (Algorithm::SlidingLog, Tier::Full) => &self.sliding_log,
            (Algorithm::SlidingWindow, _) => &self.sliding_window,
            (Algorithm::FixedWindow, _) => &self.fixed_window,
            (Algorithm::Gcra, Tier::Plain) => &self.gcra_plain,
            (Algorithm::Gcra, Tier::Full) => &self.gcra,
        }
    }

    /// Whether `algorithm` has a plain script of its own, which decides a plain request for
    /// less than its full script does (else [`Tier::Plain`] is the full script).
    pub(crate) fn has_plain(algorithm: Algorithm) -> bool {
        matches!(algorithm, Algorithm::SlidingLog | Algorithm::Gcra)
    }

    /// The scripts that decide, which the store loads when it connects.
    pub(crate) fn deciding(&self) -> [&Script; 6] {
        [
            &self.sliding_log,
            &self.sliding_window,
            &self.fixed_window,
            &self.gcra,
            &self.sliding_log_plain,
            &self.gcra_plain,
        ]
    }
}

// KEYS and ARGV (`prelude.lua`): the keys of a call's decisions, then those of its slot
// operations; ARGV[1] the decisions' arguments one after the other ([`encode_into`]), ARGV[2] the
// name of the hash of overrides, ARGV[3] what finds the decisions' override fields
// ([`Heads`]), then two per slot operation ([`SlotOp`]).
