//! The crate's text for a list of limits, `1/1m + 5/1h + 10/1d`: what a [`Policy`] is parsed
//! from and shown as, and an override ([`Override`](crate::store::Override)) too, so that an
//! admin tool reads back what it lists.

use std::fmt;
use std::str::FromStr;

use super::{sorted, Limit, Policy, PolicyError};

/// Limits separated by `+` or `,`, each as [`Limit`] parses it, returned shortest window
/// first; at least one, and no two with one window.
pub(crate) fn parse_limits(input: &str) -> Result<Vec<Limit>, PolicyError> {
    let limits = input
        .split(['+', ','])
        .map(str::parse)
        .collect::<Result<Vec<Limit>, _>>()?;
    sorted(limits)
}

/// `limits` as [`Limit`] displays each, in their order, joined by ` + `: the text
/// [`parse_limits`] reads.
pub(crate) fn write_limits(f: &mut fmt::Formatter<'_>, limits: &[Limit]) -> fmt::Result {
    for (i, limit) in limits.iter().enumerate() {
        if i > 0 {
            f.write_str(" + ")?;
        }
        fmt::Display::fmt(limit, f)?;
    }
    Ok(())
}

/// Parses `"5/10s"` or `"1/1m + 5/1h + 10/1d"` (limits separated by `+` or `,`, in any order)
/// into a policy named [`Policy::DEFAULT_NAME`].
impl FromStr for Policy {
    type Err = PolicyError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        Policy::new(Self::DEFAULT_NAME, parse_limits(input)?)
    }
}

impl TryFrom<&str> for Policy {
    type Error = PolicyError;

    fn try_from(input: &str) -> Result<Self, Self::Error> {
        input.parse()
    }
}

/// The policy's limits in the text it is parsed from, shortest window first, joined by
/// ` + `: `1/1m + 50/1h + 100/1d`, each limit as [`Limit`] displays it.
///
/// Only the limits, which is all the string syntax holds: the name, the algorithm, the plan,
/// the penalty box ([`Policy::block_for`]) and the concurrency limit ([`Policy::concurrency`])
/// are not printed ([`Policy::name`] and [`Policy::algorithm`] read the first two). So
/// `policy.to_string().parse::<Policy>()` gives a policy with the same limits, and gives back
/// the policy itself for one parsed from text (named [`Policy::DEFAULT_NAME`], the sliding log,
/// no box, no concurrency limit, no plan). A policy without rate limits, which a concurrency
/// limit alone decides, prints as nothing, which does not parse.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::{Algorithm, Policy};
///
/// let sms: Policy = "10/1d + 1/60s, 5/1h".parse()?;
/// assert_eq!(sms.to_string(), "1/1m + 5/1h + 10/1d");
/// assert_eq!(sms.to_string().parse::<Policy>()?, sms);
///
/// // A name, an algorithm and a box are not part of the text: the limits are.
/// let login = Policy::new("login", ["3/1m".parse()?])?
///     .with_algorithm(Algorithm::Gcra)
///     .block_for(Duration::from_secs(900))?;
/// assert_eq!(login.to_string(), "3/1m");
/// assert_eq!(login.to_string().parse::<Policy>()?.limits(), login.limits());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_limits(f, self.limits())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Algorithm;

    #[test]
    fn shows_limits_shortest_first_as_they_parse() {
        let cases = [
            ("1/1m + 50/1h + 100/1d", "1/1m + 50/1h + 100/1d"),
            ("100/1d,1/60s,50/3600s", "1/1m + 50/1h + 100/1d"),
            ("5/10s", "5/10s"),
            ("20/500ms + 30/1500ms", "20/500ms + 30/1500ms"),
            ("3/minute + 2/2 hours", "3/1m + 2/2h"),
        ];
        for (text, shown) in cases {
            let policy: Policy = text.parse().unwrap();
            assert_eq!(policy.to_string(), shown, "{text}");
            assert_eq!(policy.to_string().parse::<Policy>(), Ok(policy), "{text}");
        }
    }

    #[test]
    fn refuses_what_a_policy_refuses() {
        assert_eq!(
            parse_limits("1/1m + 2/60s"),
            Err(PolicyError::DuplicateWindow {
                window: "1m".into()
            })
        );
        assert!(matches!(parse_limits(""), Err(PolicyError::Limit(_))));
        assert!(matches!(parse_limits("1/1m +"), Err(PolicyError::Limit(_))));
        assert!(matches!(parse_limits("block"), Err(PolicyError::Limit(_))));
    }

    /// Limits with distinct windows, each window a whole number of one unit (so that every
    /// unit is shown), in any order.
    fn limits() -> impl proptest::strategy::Strategy<Value = Vec<Limit>> {
        use proptest::prelude::*;
        let units = vec![1u64, 1_000, 60_000, 3_600_000, 86_400_000];
        let limit = (
            1..=Limit::MAX_COUNT,
            proptest::sample::select(units),
            1u64..=5000,
        )
            .prop_map(|(count, unit, times)| {
                let ms = (unit * times).min(Limit::MAX_WINDOW.as_millis() as u64);
                Limit::new(count, Duration::from_millis(ms)).unwrap()
            });
        proptest::collection::vec(limit, 1..6).prop_map(|mut limits| {
            let mut seen = std::collections::HashSet::new();
            limits.retain(|l| seen.insert(l.window()));
            limits
        })
    }

    proptest::proptest! {
        /// An unnamed policy reads back as itself, and any policy as its limits, whatever its
        /// name, algorithm, box or concurrency limit.
        #[test]
        fn display_parses_back(limits in limits(), gcra: bool, boxed: bool) {
            let parsed = Policy::new(Policy::DEFAULT_NAME, limits.clone()).unwrap();
            proptest::prop_assert_eq!(parsed.to_string().parse::<Policy>(), Ok(parsed.clone()));
            let mut named = Policy::new("api", limits).unwrap().concurrency(3).unwrap();
            if gcra {
                named = named.with_algorithm(Algorithm::Gcra);
            }
            if boxed {
                named = named.block_for(Duration::from_secs(60)).unwrap();
            }
            let back: Policy = named.to_string().parse().unwrap();
            proptest::prop_assert_eq!(back.limits(), named.limits());
            proptest::prop_assert_eq!(back.to_string(), parsed.to_string());
        }
    }
}
