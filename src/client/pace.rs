//! A pace learned from an upstream's pushbacks: per key, the rate at which this instance starts
//! reservations, lowered when the upstream pushes back and raised again while it does not
//! (AIMD, as TCP's congestion control does on loss).
//!
//! A pause alone (`Reserve::pause`) ends at one instant: every call held by it reserves then,
//! gets a turn at the pause's end where the policy allows them all, and the upstream, whose
//! real limit is lower than the policy, refuses them again. So each instance also learns a
//! rate per key:
//!
//! - **Decrease.** On a pushback (its own, or a pause it learns of from the store), the rate
//!   becomes half of what it actually sent of the key over the last window (less than the
//!   rate it was allowed where it sent less), at least one unit per window. One overload
//!   lowers it once: a pushback while a pause it knows of still runs, or within a window of
//!   the last decrease, only lengthens the pause.
//! - **Increase.** Each whole window after the pause's end without a pushback adds a tenth of
//!   the rate it was pushed back at (its *ceiling*); once back at the ceiling, each window
//!   adds twice what the one before added, probing for a limit that rose. Back at the policy's
//!   rate, the key is forgotten.
//! - **Spacing.** While a key is paced, the starts of its reservations are booked one after
//!   the other, `window / rate` apart and not before the pause's end, in the order they are
//!   asked: calls held by a pause resume spread over the window, and a policy above the
//!   upstream's real limit converges to it.
//!
//! What it keeps is bounded: a key's sends are counted (two numbers) until two windows after
//! its last, a paced key is kept until its rate is back (at most 9 + log2(count)
//! windows after the pause's end), and at most [`MAX_KEYS`] keys at once, the least recently
//! used going first. Keys no pace holds cost a load of one atomic in [`Pace::delay`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::shards::{Pinning, Shards};
use crate::{Key, Policy};

/// The most keys a pace keeps (counted sends and learned rates together).
pub(crate) const MAX_KEYS: u64 = 10_000;

/// The lowest learned rate: one unit per window.
const FLOOR: f64 = 1.0;

/// The most windows of growth a rate takes to come back: 5 to its ceiling (it starts at
/// least at half of it), then doubling steps from a tenth of a ceiling of at least 2 reach
/// the largest count, 2^50, within 52 more (57 in all). Past them, a key is forgotten
/// whatever its state.
const MAX_STEPS: u32 = 64;

/// The rates of one layer's keys, learned from the upstream's pushbacks. Thread-safe; a key
/// no pace holds costs one atomic load in [`delay`](Self::delay), a key's send one short
/// lock of its shard.
pub(crate) struct Pace {
    /// What the rates are measured in: the policy's limit of the lowest rate; `None` for a
    /// policy without limits (nothing to pace).
    limit: Option<Limit>,
    /// The policy, whose identity keys the map.
    policy: Policy,
    /// The instant times are counted from (µs).
    origin: Instant,
    keys: Shards<Learned>,
    /// Until when (µs) a key may still be paced: the latest end of any key's pace. Past it,
    /// no key is, and [`delay`](Self::delay) takes no lock.
    paced_until: AtomicU64,
}

impl std::fmt::Debug for Pace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pace")
            .field("policy", &self.policy.name())
            .finish_non_exhaustive()
    }
}

/// The limit rates are measured against.
#[derive(Debug, Clone, Copy)]
struct Limit {
    /// Its window (µs, at least 1).
    window: u64,
    /// Its count: the policy's rate, units per window.
    count: f64,
}

/// What a pace keeps about one key.
#[derive(Debug, Default)]
struct Learned {
    sends: Sends,
    paced: Option<Paced>,
}

impl Pinning for Learned {}

/// A key's sends, counted per window of the limit (a sliding-window counter).
#[derive(Debug, Default, Clone, Copy)]
struct Sends {
    /// The window counted in `this` (its index since the pace's origin).
    index: u64,
    this: u64,
    last: u64,
}

/// A key's learned rate and the schedule of its reservations' starts (times in µs).
#[derive(Debug, Clone, Copy)]
struct Paced {
    /// Units per window.
    rate: f64,
    /// The rate it was pushed back at.
    ceiling: f64,
    /// What the next window without a pushback adds.
    step: f64,
    /// The start of the window of growth under way.
    grown: u64,
    /// When the rate last halved.
    halved: u64,
    /// When the key's pause, as this instance knows it, ends.
    paused_until: u64,
    /// When the next reservation may start.
    next: u64,
    /// When the schedule last changed (a decrease, a longer pause): starts booked before
    /// then are booked again.
    changed: u64,
}

impl Pace {
    /// The pace of a layer of `policy`: rates are measured against its limit of the lowest
    /// rate (count per window), in that limit's window.
    pub(crate) fn new(policy: &Policy) -> Pace {
        Pace::with_capacity(policy, MAX_KEYS)
    }

    /// A pace that keeps at most `max_keys` keys.
    pub(crate) fn with_capacity(policy: &Policy, max_keys: u64) -> Pace {
        // The lowest count per window: a.count / a.window against b's, without division.
        let slowest = policy.limits().iter().min_by(|a, b| {
            let (wa, wb) = (a.window().as_micros(), b.window().as_micros());
            (u128::from(a.count()) * wb).cmp(&(u128::from(b.count()) * wa))
        });
        let limit = slowest.map(|limit| Limit {
            window: micros(limit.window()).max(1),
            count: limit.count() as f64,
        });
        Pace {
            limit,
            policy: policy.clone(),
            origin: Instant::now(),
            keys: Shards::new(max_keys),
            paced_until: AtomicU64::new(0),
        }
    }

    /// How long a new reservation of `key` waits before it is made: zero unless the key is
    /// paced; else its start is booked, after those booked before it, so that callers at
    /// once get 0, s, 2s, … (`s` = window / rate).
    #[cfg(test)]
    pub(crate) fn delay(&self, key: &Key, now: Instant) -> Duration {
        self.delay_within(key, now, Duration::MAX)
            .unwrap_or(Duration::MAX)
    }

    /// How long a new reservation of `key` waits before it is made: zero unless the key is
    /// paced; else its start is booked, after those booked before it (callers at once get
    /// 0, s, 2s, …, `s` = window / rate), and nothing is booked where the start would come
    /// later than `most` from `now` (`None`: the call cannot be made within its wait).
    pub(crate) fn delay_within(&self, key: &Key, now: Instant, most: Duration) -> Option<Duration> {
        let at = self.at(now);
        if at >= self.paced_until.load(Ordering::Relaxed) {
            return Some(Duration::ZERO);
        }
        self.book(key, at, most)
    }

    /// After waiting the delay booked at `booked`: zero where that start still holds; where
    /// the key was pushed back since (its rate lowered, or its pause made longer), a start
    /// booked anew, as [`delay_within`](Self::delay_within) does.
    pub(crate) fn rebook(
        &self,
        key: &Key,
        booked: Instant,
        now: Instant,
        most: Duration,
    ) -> Option<Duration> {
        let at = self.at(now);
        if at >= self.paced_until.load(Ordering::Relaxed) {
            return Some(Duration::ZERO);
        }
        let booked = self.at(booked);
        let changed = {
            let mut shard = self.keys.lock(key, self.policy.state_id());
            let entry = shard.get(key, self.policy.state_id(), at);
            entry.and_then(|e| e.value.paced.map(|p| p.changed))
        };
        match changed {
            Some(changed) if changed > booked => self.book(key, at, most),
            _ => Some(Duration::ZERO),
        }
    }

    /// A request of `key` went out at `now`: counted, for the rate it halves from.
    pub(crate) fn sent(&self, key: &Key, now: Instant) {
        let Some(limit) = self.limit else {
            return;
        };
        let at = self.at(now);
        let index = at / limit.window;
        let mut shard = self.keys.lock(key, self.policy.state_id());
        match shard.get(key, self.policy.state_id(), at) {
            Some(entry) => {
                entry.value.sends.add(index);
                entry.expires = entry.expires.max(sends_end(index, limit));
            }
            None => {
                let mut learned = Learned::default();
                learned.sends.add(index);
                let expires = sends_end(index, limit);
                shard.insert(key, self.policy.state_id(), at, expires, learned);
            }
        }
    }

    /// The upstream pushed back on `key` at `now`, pausing it for `pause` (its own answer, or
    /// a pause learned from the store): the rate halves, once per overload, and no start is
    /// booked before the pause's end.
    pub(crate) fn pushed_back(&self, key: &Key, now: Instant, pause: Duration) {
        let Some(limit) = self.limit else {
            return;
        };
        let at = self.at(now);
        let until = at.saturating_add(micros(pause));
        let mut shard = self.keys.lock(key, self.policy.state_id());
        if shard.get(key, self.policy.state_id(), at).is_none() {
            shard.insert(key, self.policy.state_id(), at, at, Learned::default());
        }
        let Some(entry) = shard.get(key, self.policy.state_id(), at) else {
            return;
        };
        let learned = &mut entry.value;
        if let Some(paced) = learned.paced.as_mut() {
            if paced.grow(at, limit) {
                learned.paced = None;
            }
        }
        learned.paced = match learned.paced {
            Some(mut paced) if at < paced.paused_until || at < paced.halved + limit.window => {
                paced.pause(at, until);
                Some(paced)
            }
            paced => {
                let rate = paced.map_or(limit.count, |p| p.rate);
                let sent = learned.sends.over_last_window(at, limit);
                Paced::halved(rate.min(sent), at, until, limit)
            }
        };
        let Some(paced) = learned.paced else {
            return;
        };
        let ends = paced.ends(limit);
        entry.expires = entry.expires.max(ends);
        self.paced_until.fetch_max(ends, Ordering::Relaxed);
    }

    /// Books the next start of `key` at `at` (µs), unless it comes later than `most`.
    fn book(&self, key: &Key, at: u64, most: Duration) -> Option<Duration> {
        let limit = self.limit?;
        let mut shard = self.keys.lock(key, self.policy.state_id());
        let Some(entry) = shard.get(key, self.policy.state_id(), at) else {
            return Some(Duration::ZERO);
        };
        let learned = &mut entry.value;
        let Some(paced) = learned.paced.as_mut() else {
            return Some(Duration::ZERO);
        };
        if paced.grow(at, limit) {
            learned.paced = None;
            return Some(Duration::ZERO);
        }
        let start = at.max(paced.next).max(paced.paused_until);
        let wait = Duration::from_micros(start - at);
        if wait > most {
            return None;
        }
        paced.next = start + (limit.window as f64 / paced.rate) as u64;
        Some(wait)
    }

    /// `now` in µs since the pace's origin.
    fn at(&self, now: Instant) -> u64 {
        micros(now.saturating_duration_since(self.origin))
    }
}

impl Sends {
    /// One more send, in window `index`.
    fn add(&mut self, index: u64) {
        self.roll(index);
        self.this = self.this.saturating_add(1);
    }

    /// Moves the count on to window `index` (a time of an earlier window counts in this one).
    fn roll(&mut self, index: u64) {
        match index.saturating_sub(self.index) {
            0 => return,
            1 => self.last = self.this,
            _ => self.last = 0,
        }
        self.this = 0;
        self.index = index;
    }

    /// About how many were sent in the window up to `at`: this window's sends, and the part
    /// of the last window's that the sliding window still covers.
    fn over_last_window(mut self, at: u64, limit: Limit) -> f64 {
        self.roll(at / limit.window);
        let covered = 1.0 - (at % limit.window) as f64 / limit.window as f64;
        self.this as f64 + self.last as f64 * covered
    }
}

impl Paced {
    /// The pace after a pushback at `at` with a pause until `until`, from `basis`, the rate it
    /// was pushed back at: half of it; `None` where that is the policy's rate.
    fn halved(basis: f64, at: u64, until: u64, limit: Limit) -> Option<Paced> {
        let rate = (basis / 2.0).max(FLOOR);
        if rate >= limit.count {
            return None;
        }
        let ceiling = basis.max(2.0 * FLOOR);
        Some(Paced {
            rate,
            ceiling,
            step: ceiling / 10.0,
            grown: at,
            halved: at,
            paused_until: until,
            next: until,
            changed: at,
        })
    }

    /// A pushback within the overload already learned: the pause lasts at least until
    /// `until`.
    fn pause(&mut self, at: u64, until: u64) {
        if until > self.paused_until {
            self.paused_until = until;
            self.next = self.next.max(until);
            self.changed = at;
        }
    }

    /// Adds what each whole window since the last step, after the pause, brings; true once
    /// the rate is back at the policy's (the key is forgotten).
    fn grow(&mut self, at: u64, limit: Limit) -> bool {
        let mut start = self.grown.max(self.paused_until);
        for _ in 0..MAX_STEPS {
            if at < start.saturating_add(limit.window) {
                self.grown = start;
                return false;
            }
            start += limit.window;
            if self.step_up(limit) {
                return true;
            }
        }
        true
    }

    /// One window's increase: a tenth of the ceiling below it, twice the last step from it on.
    fn step_up(&mut self, limit: Limit) -> bool {
        // Within a rounding error of the ceiling is at it (3 + 5 × 0.6 is 5.999…).
        if self.rate >= self.ceiling * (1.0 - 1e-9) {
            self.step *= 2.0;
        }
        self.rate += self.step;
        self.rate >= limit.count
    }

    /// When, without another pushback, the rate is back at the policy's (µs).
    fn ends(&self, limit: Limit) -> u64 {
        let mut paced = *self;
        let mut at = self.grown.max(self.paused_until);
        for _ in 0..MAX_STEPS {
            at = at.saturating_add(limit.window);
            if paced.step_up(limit) {
                return at;
            }
        }
        at
    }
}

/// When counted sends of window `index` no longer matter: once the window after it ended.
fn sends_end(index: u64, limit: Limit) -> u64 {
    index.saturating_add(2).saturating_mul(limit.window)
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn pace(policy: &str) -> Pace {
        Pace::new(&policy.parse().unwrap())
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// The delays `n` callers at once at `now` get.
    fn delays(pace: &Pace, key: &Key, now: Instant, n: usize) -> Vec<Duration> {
        (0..n).map(|_| pace.delay(key, now)).collect()
    }

    /// The learned rate of `key` at `now`, units per window (None: not paced).
    fn rate(pace: &Pace, key: &Key, now: Instant) -> Option<f64> {
        let at = pace.at(now);
        let limit = pace.limit.unwrap();
        let mut shard = pace.keys.lock(key, pace.policy.state_id());
        let entry = shard.get(key, pace.policy.state_id(), at)?;
        let mut paced = entry.value.paced?;
        (!paced.grow(at, limit)).then_some(paced.rate)
    }

    /// `n` sends of `key`, `every` apart from `from`; the instant after the last.
    fn send(pace: &Pace, key: &Key, from: Instant, n: u32, every: Duration) -> Instant {
        for i in 0..n {
            pace.sent(key, from + every * i);
        }
        from + every * n
    }

    #[tokio::test(start_paused = true)]
    async fn an_unpaced_key_waits_for_nothing() {
        let pace = pace("100/1s");
        let (key, now) = (Key::from("a"), Instant::now());
        send(&pace, &key, now, 50, ms(10));
        assert!(delays(&pace, &key, now, 10).iter().all(Duration::is_zero));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pushback_halves_what_was_sent_and_spaces_callers_after_the_pause() {
        let pace = pace("100/1s");
        let (key, start) = (Key::from("a"), Instant::now());
        // Six sent in the last 300 ms (of a policy allowing a hundred): the upstream pushes
        // back for 700 ms.
        let now = send(&pace, &key, start, 6, ms(50));
        pace.pushed_back(&key, now, ms(700));
        assert_eq!(rate(&pace, &key, now), Some(3.0));
        let spaced: Vec<Duration> = [700, 1033, 1366, 1699].map(ms).into();
        let got = delays(&pace, &key, now, 4);
        for (got, want) in got.iter().zip(&spaced) {
            assert!(got.abs_diff(*want) <= ms(1), "{got:?} vs {want:?}");
        }
        // Another key is not paced.
        assert_eq!(pace.delay(&Key::from("b"), now), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn one_overload_halves_once_and_a_new_one_halves_again() {
        let pace = pace("100/1s");
        let (key, start) = (Key::from("a"), Instant::now());
        // Forty sent in the last second.
        let now = send(&pace, &key, start, 40, ms(25));
        pace.pushed_back(&key, now, ms(500));
        assert_eq!(rate(&pace, &key, now), Some(20.0));
        // Every waiting call learns the same pause from the store; fifteen refusals at once.
        for i in 0..15 {
            pace.pushed_back(&key, now + ms(10 * i), ms(500) - ms(10 * i));
        }
        assert_eq!(rate(&pace, &key, now + ms(200)), Some(20.0));
        // A pushback after the pause, more than a window after the first: a new overload,
        // halving what was sent (20 in the last second).
        let later = send(&pace, &key, now + SECOND, 20, ms(50));
        pace.pushed_back(&key, later, ms(100));
        assert_eq!(rate(&pace, &key, later), Some(10.0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_halves_to_a_floor_of_one_per_window() {
        let pace = pace("100/1s");
        let (key, now) = (Key::from("a"), Instant::now());
        // Learned from the store: this instance sent nothing.
        pace.pushed_back(&key, now, Duration::ZERO);
        assert_eq!(rate(&pace, &key, now), Some(FLOOR));
        let got = delays(&pace, &key, now, 3);
        assert_eq!(got, [0, 1000, 2000].map(ms));
    }

    #[tokio::test(start_paused = true)]
    async fn windows_without_pushback_add_a_tenth_of_the_ceiling_then_probe_and_forget() {
        let pace = pace("100/1s");
        let (key, start) = (Key::from("a"), Instant::now());
        let now = send(&pace, &key, start, 20, ms(50));
        pace.pushed_back(&key, now, SECOND);
        // Ceiling 20, rate 10; nothing grows during the pause.
        let resumed = now + SECOND;
        assert_eq!(rate(&pace, &key, resumed), Some(10.0));
        let after = |windows: u32| rate(&pace, &key, resumed + SECOND * windows);
        let additive: Vec<Option<f64>> = (1..=5).map(after).collect();
        let want = [12.0, 14.0, 16.0, 18.0, 20.0];
        for (got, want) in additive.iter().zip(want) {
            assert!((got.unwrap() - want).abs() < 1e-9, "{got:?} vs {want}");
        }
        // From the ceiling on, each step doubles: 24, 32, 48, 80, then past the policy's 100.
        assert!((after(9).unwrap() - 80.0).abs() < 1e-9);
        assert_eq!(after(10), None, "back at the policy's rate: forgotten");
        assert_eq!(pace.delay(&key, resumed + SECOND * 10), Duration::ZERO);
        let at = pace.at(resumed + SECOND * 10);
        let limit = pace.limit.unwrap();
        assert!(
            pace.paced_until.load(Ordering::Relaxed) <= at + limit.window,
            "the lock-free check knows it by then"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn spacing_follows_the_growing_rate() {
        let pace = pace("100/1s");
        let (key, start) = (Key::from("a"), Instant::now());
        let now = send(&pace, &key, start, 10, ms(100));
        pace.pushed_back(&key, now, Duration::ZERO);
        // Rate 5: 200 ms apart. A window later, 6: about 167 ms apart.
        assert_eq!(delays(&pace, &key, now, 2), [0, 200].map(ms));
        let later = now + SECOND + ms(500);
        let got = delays(&pace, &key, later, 3);
        assert_eq!(got[0], Duration::ZERO);
        assert!(got[1].abs_diff(ms(167)) <= ms(1), "{got:?}");
        assert!(got[2].abs_diff(ms(333)) <= ms(1), "{got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_booked_before_a_pushback_is_booked_again_after_the_pause() {
        let pace = pace("100/1s");
        let (key, start) = (Key::from("a"), Instant::now());
        let now = send(&pace, &key, start, 10, ms(100));
        pace.pushed_back(&key, now, Duration::ZERO);
        let booked = now;
        let waits = delays(&pace, &key, booked, 3);
        assert_eq!(waits, [0, 200, 400].map(ms));
        // The first goes at once; nothing changed for it.
        assert_eq!(
            pace.rebook(&key, booked, booked, SECOND),
            Some(Duration::ZERO)
        );
        // A pause learned 100 ms later, for 2 s: the others' starts fall in it.
        pace.pushed_back(&key, now + ms(100), SECOND * 2);
        let woke = booked + ms(200);
        let again = pace.rebook(&key, booked, woke, SECOND * 5).unwrap();
        assert_eq!(again, ms(1900), "after the pause, not at its old start");
        // Its wait allows less: nothing is booked.
        assert_eq!(pace.rebook(&key, booked, woke, SECOND), None);
        assert_eq!(
            pace.delay_within(&key, woke, SECOND * 5),
            Some(ms(2100)),
            "the refused booking left no gap"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn keys_kept_are_bounded() {
        let pace = Pace::with_capacity(&"100/1s".parse().unwrap(), 16);
        let now = Instant::now();
        for i in 0..1_000 {
            let key = Key::from(format!("k{i}"));
            pace.sent(&key, now);
            pace.pushed_back(&key, now, SECOND);
        }
        assert!(pace.keys.len(pace.at(now)) <= 16);
        // Sends alone are forgotten two windows on.
        let idle = Pace::new(&"100/1s".parse().unwrap());
        for i in 0..100 {
            idle.sent(&Key::from(format!("k{i}")), now);
        }
        assert_eq!(idle.keys.len(idle.at(now)), 100);
        assert_eq!(idle.keys.len(idle.at(now + SECOND * 2)), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_largest_count_is_back_within_the_bound() {
        let pace = pace("1125899906842624/1s");
        let (key, now) = (Key::from("a"), Instant::now());
        pace.pushed_back(&key, now, Duration::ZERO);
        assert_eq!(rate(&pace, &key, now), Some(FLOOR));
        let back = now + SECOND * 57;
        assert!(rate(&pace, &key, back - SECOND).is_some());
        assert_eq!(rate(&pace, &key, back), None);
        assert_eq!(pace.delay(&key, back), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn rates_are_measured_against_the_slowest_limit() {
        let two = pace("10/1s + 100/1m");
        let limit = two.limit.unwrap();
        assert_eq!((limit.count, limit.window), (100.0, 60_000_000));
        let one = pace("1/1s");
        let (key, now) = (Key::from("a"), Instant::now());
        one.sent(&key, now);
        one.pushed_back(&key, now, SECOND);
        assert_eq!(
            rate(&one, &key, now),
            None,
            "one per window: nothing lower to learn"
        );
    }
}
