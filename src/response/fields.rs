//! The rate-limit header fields: `RateLimit-Policy` and `RateLimit`, after
//! draft-ietf-httpapi-ratelimit-headers-10, and the rounding of their seconds, which
//! `Retry-After` shares.

use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;

use super::responder::{Options, Responder, Unit};
use crate::{Decision, Policy};

/// The `RateLimit-Policy` header field name.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit` header field name.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// A responder's header fields: its `RateLimit-Policy` value, computed once, and the fields it
/// adds to each response.
impl Responder {
    /// The responder of `policy`, with the `RateLimit-Policy` value that lists its limits.
    pub(crate) fn new(policy: Policy, options: Options) -> Self {
        let policy = match options.counts_outcomes {
            true => policy.counting_attempts(),
            false => policy,
        };
        let mut limit_names: Vec<String> = (0..policy.limits().len())
            .map(|i| policy.limit_name(i))
            .collect();
        let mut items: Vec<String> = policy
            .limits()
            .iter()
            .zip(&limit_names)
            .map(|(l, name)| format!("\"{name}\";q={};w={}", l.count(), ceil_secs(l.window())))
            .map(|item| match options.unit {
                // The draft's quota unit for bytes of content (its registry's
                // `content-bytes`); `request`, the default, goes without saying.
                Unit::ContentBytes => item + ";qu=\"content-bytes\"",
                Unit::Requests => item,
            })
            .collect();
        // The concurrency limit, after the rate limits (its decisions' index), in the draft's
        // quota unit for it.
        if let Some(slots) = policy.concurrency_limit() {
            let name = format!("{}-concurrency", policy.name());
            items.push(format!("\"{name}\";q={slots};qu=\"concurrent-requests\""));
            limit_names.push(name);
        }
        Responder {
            policy_header: value(items.join(", ")),
            limit_names,
            policy,
            options,
            name_repeated: Default::default(),
        }
    }

    /// Adds `RateLimit-Policy` and `RateLimit` for `decision`; only `RateLimit-Policy` for an
    /// admitted request of a policy without rate limits, whose slots left are not counted.
    pub(crate) fn add_headers(&self, headers: &mut HeaderMap, decision: &Decision) {
        if decision.is_allowed() && self.policy.limits().is_empty() {
            add_member(headers, RATELIMIT_POLICY, self.policy_header.clone());
            return;
        }
        let name = self
            .limit_names
            .get(decision.limit_index())
            .map_or(self.policy.name(), String::as_str);
        // Built by hand: `format!` costs more than the rest of a refusal answered from the
        // deny cache. `concat` sizes the text exactly, so that the header value takes it over
        // without a second allocation.
        // A refused client reads `t` as when to come back, so it is never before `Retry-After`,
        // which is later than the limit's next reset when usage recorded after the fact took
        // the key past its limit, or when the request costs more than one unit.
        let reset = match decision.retry_after() {
            Some(retry) if !decision.is_allowed() => decision.reset_after().max(retry),
            _ => decision.reset_after(),
        };
        let reset = reset.as_micros().div_ceil(1_000_000);
        let (mut remaining, mut reset_secs) = (itoa::Buffer::new(), itoa::Buffer::new());
        let state = [
            "\"",
            name,
            "\";r=",
            remaining.format(decision.remaining()),
            ";t=",
            reset_secs.format(u64::try_from(reset).unwrap_or(u64::MAX)),
        ]
        .concat();
        // An override in the store decided the request by other counts than the policy's own:
        // the field then states the one limit the decision knows, as it was decided.
        let own = self.policy.limits().get(decision.limit_index());
        let policy = match own {
            Some(limit) if limit.count() != decision.limit() => value(format!(
                "\"{name}\";q={};w={}",
                decision.limit(),
                ceil_secs(limit.window())
            )),
            _ => self.policy_header.clone(),
        };
        add_member(headers, RATELIMIT_POLICY, policy);
        add_member(headers, RATELIMIT, value(state));
    }
}

/// Adds `member` to the list field `name`: after the members that layers further in put there
/// (each layer of a stack adds its own policy's; draft-ietf-httpapi-ratelimit-headers-10 makes
/// both fields lists), or as the field itself.
fn add_member(headers: &mut HeaderMap, name: HeaderName, member: HeaderValue) {
    match headers.entry(name) {
        http::header::Entry::Occupied(mut inner) => {
            let inner = inner.get_mut();
            let mut list = Vec::with_capacity(inner.len() + 2 + member.len());
            list.extend_from_slice(inner.as_bytes());
            list.extend_from_slice(b", ");
            list.extend_from_slice(member.as_bytes());
            if let Ok(list) = HeaderValue::from_bytes(&list) {
                *inner = list;
            }
        }
        http::header::Entry::Vacant(empty) => {
            empty.insert(member);
        }
    }
}

/// Whole seconds, rounded up, and at least 1.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_micros().div_ceil(1_000_000).max(1) as u64
}

/// Our header texts are built from policy names limited to visible ASCII, and numbers.
/// `text` as a header value. `Bytes` takes a string over as it is when its capacity is its
/// length; otherwise it allocates a shared header for it.
pub(super) fn value(text: String) -> HeaderValue {
    HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use http::header::{CONTENT_TYPE, RETRY_AFTER};

    use super::*;
    use crate::model::Outcome;

    #[test]
    fn renders_draft_10_fields() {
        let policy: Policy = "2/2s + 3/10s".parse().unwrap();
        let responder = Responder::new(policy.clone(), Options::default());
        assert_eq!(
            responder.policy_header,
            "\"default-2s\";q=2;w=2, \"default-10s\";q=3;w=10"
        );
        let denied = Decision::from_outcome(
            Outcome {
                allowed: false,
                index: 1,
                remaining: 0,
                reset_after: 7_800_000,
                retry_after: Some(7_800_000),
            },
            &policy,
        );
        let response = responder.rejection(&denied, None);
        assert_eq!(response.status(), 429);
        let h = response.headers();
        assert_eq!(h[RETRY_AFTER], "8");
        assert_eq!(h[RATELIMIT], "\"default-10s\";r=0;t=8");

        // Over the limit (usage recorded after the fact): the oldest entry leaves in 2 s, but
        // the request fits only in 9.
        let over = Decision::from_outcome(
            Outcome {
                allowed: false,
                index: 1,
                remaining: 0,
                reset_after: 2_000_000,
                retry_after: Some(8_500_000),
            },
            &policy,
        );
        let h = responder.rejection(&over, None).headers().clone();
        assert_eq!(
            (&h[RETRY_AFTER], &h[RATELIMIT]),
            (
                &"9".parse::<HeaderValue>().unwrap(),
                &"\"default-10s\";r=0;t=9".parse::<HeaderValue>().unwrap()
            )
        );

        let web = HeaderValue::from_static("application/grpc-web+proto");
        let grpc = responder.rejection(&denied, Some(&web));
        assert_eq!(grpc.status(), 200);
        let h = grpc.headers();
        assert_eq!(h[CONTENT_TYPE], web);
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["grpc-retry-pushback-ms"], "7800");
        assert_eq!(h[RETRY_AFTER], "8");
    }

    #[test]
    fn rounds_up_and_never_zero() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_micros(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
    }
}
