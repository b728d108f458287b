//! The crate's text for a list of limits, `1/1m + 5/1h + 10/1d`: what a [`Policy`] is parsed
//! from.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
