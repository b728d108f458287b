//! A [`Limit`], `COUNT/WINDOW`: its bounds, and its text, which the rest of the crate's syntax
//! (policies, overrides, rules files) is made of.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// One rate limit: at most `count` units of cost in any window of `window`.
///
/// Parsed from the strings people already write in configuration files:
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Limit;
///
/// let limit: Limit = "100/1m".parse()?;
/// assert_eq!(limit.count(), 100);
/// assert_eq!(limit.window(), Duration::from_secs(60));
///
/// // Unit words work too, and a missing number means one unit.
/// assert_eq!("5/minute".parse::<Limit>()?, "5/1m".parse()?);
/// assert_eq!("10/1d".parse::<Limit>()?.window(), Duration::from_secs(86_400));
/// assert!("0/1m".parse::<Limit>().is_err());
/// # Ok::<(), tower_redis_ratelimit::LimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    count: u64,
    window: Duration,
}

/// Why a [`Limit`] could not be built; the message names the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The text is not of the form `COUNT/WINDOW`.
    #[error("limit {input:?} is not of the form COUNT/WINDOW, e.g. \"100/1m\"")]
    Syntax {
        /// The whole text that was parsed.
        input: String,
    },
    /// The count is not a whole number.
    #[error("limit count {part:?} is not a whole number")]
    Count {
        /// The count part of the text.
        part: String,
    },
    /// The count is zero: a limit that admits nothing is a block, not a rate limit.
    #[error("limit count must be at least 1")]
    ZeroCount,
    /// The window is not a number followed by a known unit.
    #[error("limit window {part:?} is not a duration such as 10s, 1m, 1h, 1d or minute")]
    Window {
        /// The window part of the text.
        part: String,
    },
    /// The window is shorter than one millisecond.
    #[error("limit window must be at least 1ms")]
    ZeroWindow,
    /// The count is above [`Limit::MAX_COUNT`].
    #[error(
        "limit count {count} is above the largest supported, 2^50 = {}",
        Limit::MAX_COUNT
    )]
    CountTooLarge {
        /// The count given.
        count: u64,
    },
    /// The window is longer than [`Limit::MAX_WINDOW`].
    #[error("limit window {window:?} is longer than the longest supported, 3650 days")]
    WindowTooLong {
        /// The window given.
        window: Duration,
    },
}

impl Limit {
    /// The largest count, 2^50 (about 1.1 * 10^15): every store keeps counts, sums and
    /// products of them exact within it, Redis' Lua (whose numbers are doubles) included.
    /// See `docs/operations.md`, "Range".
    pub const MAX_COUNT: u64 = 1 << 50;

    /// The longest window, 3650 days.
    pub const MAX_WINDOW: Duration = Duration::from_secs(3650 * 86_400);

    /// A limit of `count` units per `window`.
    ///
    /// Windows are kept with millisecond precision: anything below a millisecond is dropped.
    /// The count is at most [`MAX_COUNT`](Limit::MAX_COUNT), the window at most
    /// [`MAX_WINDOW`](Limit::MAX_WINDOW).
    pub fn new(count: u64, window: Duration) -> Result<Self, LimitError> {
        if count == 0 {
            return Err(LimitError::ZeroCount);
        }
        if count > Limit::MAX_COUNT {
            return Err(LimitError::CountTooLarge { count });
        }
        let window = Duration::from_millis(window.as_millis().min(u64::MAX as u128) as u64);
        if window.is_zero() {
            return Err(LimitError::ZeroWindow);
        }
        if window > Limit::MAX_WINDOW {
            return Err(LimitError::WindowTooLong { window });
        }
        Ok(Limit { count, window })
    }

    /// The number of units admitted per window.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The length of the window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// A short label for the window: `10s`, `1m`, `1h`, `1d` or `500ms`.
    pub(crate) fn window_label(&self) -> String {
        let ms = self.window.as_millis();
        const UNITS: [(u128, &str); 4] = [
            (86_400_000, "d"),
            (3_600_000, "h"),
            (60_000, "m"),
            (1_000, "s"),
        ];
        for (size, unit) in UNITS {
            if ms.is_multiple_of(size) {
                return format!("{}{unit}", ms / size);
            }
        }
        format!("{ms}ms")
    }
}

/// `COUNT/WINDOW`, the window in the largest unit that divides it exactly (`d`, `h`, `m`, `s`,
/// else `ms`): `5/1h`, `3/90s`, `20/500ms`. It is the text [`Limit::from_str`] parses back to
/// the same limit, so a limit shown in an admin listing or a log can be pasted into a
/// configuration file.
///
/// ```
/// use tower_redis_ratelimit::Limit;
///
/// let limit: Limit = "60/3600s".parse()?;
/// assert_eq!(limit.to_string(), "60/1h");
/// assert_eq!(limit.to_string().parse::<Limit>()?, limit);
/// assert_eq!("7/1500ms".parse::<Limit>()?.to_string(), "7/1500ms");
/// # Ok::<(), tower_redis_ratelimit::LimitError>(())
/// ```
impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.window_label())
    }
}

impl FromStr for Limit {
    type Err = LimitError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let (count, window) = input.split_once('/').ok_or_else(|| LimitError::Syntax {
            input: input.to_owned(),
        })?;
        let count = count.trim();
        let count: u64 = count.parse().map_err(|_| LimitError::Count {
            part: count.to_owned(),
        })?;
        Limit::new(count, parse_window(window.trim())?)
    }
}

/// A duration such as `10s`, `1m`, `15m`, `1h`, `1d` or `500ms`.
pub(crate) fn parse_window(part: &str) -> Result<Duration, LimitError> {
    let bad = || LimitError::Window {
        part: part.to_owned(),
    };
    let split = part.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (number, unit) = part.split_at(split);
    let number: u64 = match number {
        "" => 1,
        n => n.parse().map_err(|_| bad())?,
    };
    let unit_ms: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "ms" | "millisecond" | "milliseconds" => 1,
        "s" | "sec" | "secs" | "second" | "seconds" => 1_000,
        "m" | "min" | "mins" | "minute" | "minutes" => 60_000,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000,
        "d" | "day" | "days" => 86_400_000,
        _ => return Err(bad()),
    };
    let ms = number.checked_mul(unit_ms).ok_or_else(bad)?;
    if ms == 0 {
        return Err(LimitError::ZeroWindow);
    }
    Ok(Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn parses_common_forms() {
        let cases = [
            ("5/10s", 5, ms(10_000)),
            ("100/1m", 100, ms(60_000)),
            ("1000/1h", 1000, ms(3_600_000)),
            ("10/1d", 10, ms(86_400_000)),
            ("100/minute", 100, ms(60_000)),
            ("100/second", 100, ms(1_000)),
            ("3/day", 3, ms(86_400_000)),
            (" 7 / 250ms ", 7, ms(250)),
            ("2/2 hours", 2, ms(7_200_000)),
        ];
        for (text, count, window) in cases {
            let limit: Limit = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((limit.count(), limit.window()), (count, window), "{text}");
        }
    }

    #[test]
    fn errors_name_the_bad_part() {
        assert_eq!("0/1m".parse::<Limit>(), Err(LimitError::ZeroCount));
        assert_eq!("5/0s".parse::<Limit>(), Err(LimitError::ZeroWindow));
        assert_eq!(
            "five/1m".parse::<Limit>(),
            Err(LimitError::Count {
                part: "five".into()
            })
        );
        assert_eq!(
            "5/1fortnight".parse::<Limit>(),
            Err(LimitError::Window {
                part: "1fortnight".into()
            })
        );
        assert_eq!(
            "5/10".parse::<Limit>(),
            Err(LimitError::Window { part: "10".into() })
        );
        assert_eq!(
            "garbage".parse::<Limit>(),
            Err(LimitError::Syntax {
                input: "garbage".into()
            })
        );
        let msg = "5/1fortnight".parse::<Limit>().unwrap_err().to_string();
        assert!(msg.contains("1fortnight"), "{msg}");
    }

    #[test]
    fn displays_in_the_largest_unit_that_divides_the_window() {
        let cases = [
            ("5/3600s", "5/1h"),
            ("1/60000ms", "1/1m"),
            ("7/1440m", "7/1d"),
            ("3/90s", "3/90s"),
            ("3/120m", "3/2h"),
            ("20/500ms", "20/500ms"),
            ("1/1500ms", "1/1500ms"),
            ("2/36h", "2/36h"),
            ("100/minute", "100/1m"),
        ];
        for (text, shown) in cases {
            let limit: Limit = text.parse().unwrap();
            assert_eq!(limit.to_string(), shown, "{text}");
            assert_eq!(limit.to_string().parse::<Limit>(), Ok(limit), "{text}");
        }
    }

    proptest::proptest! {
        /// Every limit, in every unit, reads back as itself.
        #[test]
        fn display_parses_back(
            count in 1..=Limit::MAX_COUNT,
            unit in proptest::sample::select(vec![1u64, 1_000, 60_000, 3_600_000, 86_400_000]),
            times in 1u64..=3650 * 86_400_000,
        ) {
            let window = ms(times.saturating_mul(unit).min(Limit::MAX_WINDOW.as_millis() as u64));
            let limit = Limit::new(count, window).unwrap();
            proptest::prop_assert_eq!(limit.to_string().parse::<Limit>(), Ok(limit));
        }
    }
}
