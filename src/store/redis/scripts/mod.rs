//! The store's Lua scripts, put together from the `.lua` files beside this one at compile
//! time, and hashed once for `EVALSHA`. Each file's header states its keys, arguments and
//! reply; `prelude.lua`'s is the contract that `wire/` keeps on the Rust side.

use fred::types::scripts::Script;

use crate::model::Algorithm;

/// A script: exact arithmetic past 2^53, the shared prelude (arguments, reply, `TIME`), then,
/// for the algorithms that use it, the driver that combines limits (the counters) or the
/// format of events (the sliding log), then the algorithm's own file.
macro_rules! script {
    (log, $file:literal) => {
        concat!(
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!("log_events.lua"),
            include_str!($file)
        )
    };
    ($file:literal) => {
        concat!(
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!($file)
        )
    };
    (driver, $file:literal) => {
        concat!(
            include_str!("exact.lua"),
            include_str!("prelude.lua"),
            include_str!("common.lua"),
            include_str!($file)
        )
    };
}

/// The text of `algorithm`'s script. GCRA and the sliding log do without the driver, for
/// speed (their headers say why).
pub(crate) const fn source(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::SlidingLog => script!(log, "sliding_log.lua"),
        Algorithm::SlidingWindow => script!(driver, "sliding_window.lua"),
        Algorithm::FixedWindow => script!(driver, "fixed_window.lua"),
        Algorithm::Gcra => script!("gcra.lua"),
    }
}

/// The text of `scripts/return.lua`, which gives leased units back: it decides nothing, so
/// it goes without the prelude; it makes the sliding log's events lighter as the log's own
/// script does (`scripts/log_events.lua`).
const RETURN: &str = concat!(
    include_str!("exact.lua"),
    include_str!("log_events.lua"),
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
    /// `scripts/return.lua`.
    pub(crate) returns: Script,
    /// `scripts/line.lua`.
    pub(crate) line: Script,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        let script = |algorithm| Script::from_lua(source(algorithm));
        Scripts {
            sliding_log: script(Algorithm::SlidingLog),
            sliding_window: script(Algorithm::SlidingWindow),
            fixed_window: script(Algorithm::FixedWindow),
            gcra: script(Algorithm::Gcra),
            returns: Script::from_lua(RETURN),
            line: Script::from_lua(LINE),
        }
    }

    /// The script that decides `algorithm`'s requests (any of them takes slot operations).
    pub(crate) fn of(&self, algorithm: Algorithm) -> &Script {
        match algorithm {
            Algorithm::SlidingLog => &self.sliding_log,
            Algorithm::SlidingWindow => &self.sliding_window,
            Algorithm::FixedWindow => &self.fixed_window,
            Algorithm::Gcra => &self.gcra,
        }
    }

    /// The scripts that decide, which the store loads when it connects.
    pub(crate) fn deciding(&self) -> [&Script; 4] {
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
