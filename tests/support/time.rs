//! Time for scenarios that run on both stores: the memory store's virtual clock, or real time
//! for Redis.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tower_redis_ratelimit::store::{Clock, ManualClock};

const MS: Duration = Duration::from_millis(1);
const MINUTE: Duration = Duration::from_secs(60);

/// The time a scenario runs in: a virtual clock (the memory store's), or real time (Redis's).
#[derive(Clone)]
pub enum Time {
    Manual(ManualClock),
    Real,
}

impl Time {
    pub fn now(&self) -> Duration {
        match self {
            Time::Manual(clock) => clock.now(),
            Time::Real => SystemTime::now().duration_since(UNIX_EPOCH).unwrap(),
        }
    }

    pub async fn pass(&self, by: Duration) {
        match self {
            Time::Manual(clock) => clock.advance(by),
            Time::Real => tokio::time::sleep(by).await,
        }
    }

    /// Waits until `offset` after the next multiple of `period` since the epoch.
    pub async fn align(&self, period: Duration, offset: Duration) {
        let (now, period) = (self.now().as_micros(), period.as_micros());
        let wait = period - now % period + offset.as_micros();
        self.pass(Duration::from_micros(wait as u64)).await;
    }

    /// Time elapsed in the current window of `w`.
    pub fn elapsed_in_window(&self, w: Duration) -> Duration {
        Duration::from_micros((self.now().as_micros() % w.as_micros()) as u64)
    }

    /// Makes sure the current minute has at least 5 s left, so that a scenario on minute
    /// windows stays within one.
    pub async fn away_from_minute_edge(&self) {
        if MINUTE - self.elapsed_in_window(MINUTE) < Duration::from_secs(5) {
            self.align(MINUTE, 50 * MS).await;
        }
    }

    /// How far figures that depend on time may drift.
    pub fn margin(&self) -> Duration {
        match self {
            Time::Manual(_) => Duration::ZERO,
            Time::Real => 300 * MS,
        }
    }
}

/// Redis's time now, in µs (`TIME`), for tests that compare what scripts did with Redis's
/// clock rather than this process's.
pub async fn redis_now(client: &fred::prelude::Client) -> i64 {
    use fred::prelude::LuaInterface;
    let time: Vec<String> = client
        .eval("return redis.call('TIME')", Vec::<String>::new(), ())
        .await
        .unwrap();
    time[0].parse::<i64>().unwrap() * 1_000_000 + time[1].parse::<i64>().unwrap()
}

/// µs since the Unix epoch of `at`: how Redis `TIME` and the stores' event times count.
pub fn micros(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}
