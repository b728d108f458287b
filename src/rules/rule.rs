//! A rule (a policy and the requests it applies to: method, path pattern, predicate) with its
//! plans, and the heads of requests and responses that rules, costs and outcome conditions see.

use std::sync::Arc;

use http::{Extensions, HeaderMap, Method, Request, Uri};

use crate::{BuildError, Policy, PolicyError};

/// A rule's plans and the policy each decides by.
pub(crate) type Plans = Vec<(String, Policy)>;

/// A checked rule.
pub(crate) struct Built {
    pub(crate) matcher: Matcher,
    pub(crate) policy: Policy,
    pub(crate) plans: Plans,
    pub(crate) soft: bool,
}

/// What rule predicates and cost functions see of a request: everything but the body.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The request URI.
    pub uri: &'a Uri,
    /// The request headers.
    pub headers: &'a HeaderMap,
    /// The request extensions.
    pub extensions: &'a Extensions,
}

impl<'a> RequestHead<'a> {
    pub(crate) fn of<B>(request: &'a Request<B>) -> Self {
        RequestHead {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        }
    }
}

pub(crate) type Predicate = dyn Fn(&RequestHead<'_>) -> bool + Send + Sync;

/// What an outcome condition ([`RateLimitLayerBuilder::count_when`](crate::RateLimitLayerBuilder::count_when))
/// sees of a response: everything but the body.
#[derive(Debug, Clone, Copy)]
pub struct ResponseHead<'a> {
    /// The response status.
    pub status: http::StatusCode,
    /// The response headers.
    pub headers: &'a HeaderMap,
    /// The response extensions.
    pub extensions: &'a Extensions,
}

impl<'a> ResponseHead<'a> {
    pub(crate) fn of<B>(response: &'a http::Response<B>) -> Self {
        ResponseHead {
            status: response.status(),
            headers: response.headers(),
            extensions: response.extensions(),
        }
    }
}

/// Which plan a request is on: see [`RateLimitLayerBuilder::plan`](crate::RateLimitLayerBuilder::plan).
pub(crate) type PlanFn = dyn for<'a> Fn(&RequestHead<'a>) -> Option<&'a str> + Send + Sync;

/// A policy and the requests it applies to: a method, a path pattern, a predicate, or any
/// combination (all must match); a rule with none matches every request.
///
/// Path patterns are matched segment by segment: a literal matches itself, `{name}` or `*`
/// matches any one segment, and a last segment `{*name}` or `**` matches the rest of the
/// path, including nothing. Empty segments are ignored on both sides, so `/login`, `/login/`
/// and `//login` are one path; paths are compared as sent, without percent-decoding, as
/// routers match them. A `GET` rule also matches `HEAD`.
///
/// ```
/// use http::Method;
/// use tower_redis_ratelimit::{Policy, RateLimitLayer, Rule};
///
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new(Policy::new("login", ["5/1m".parse()?])?).method(Method::POST).path("/login"))
///     .rule(Rule::new(Policy::new("search", ["30/1m".parse()?])?).path("/search/{*rest}"))
///     .policy(Policy::new("default", ["300/1m".parse()?])?)
///     .build()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Rule {
    policy: Result<Policy, BuildError>,
    method: Option<Method>,
    path: Option<String>,
    predicate: Option<Arc<Predicate>>,
    /// Each plan's limits, in the order given.
    plans: Vec<(String, Result<Policy, BuildError>)>,
    /// Pass requests over the limit on, marked, instead of refusing them.
    soft: bool,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("policy", &self.policy)
            .field("method", &self.method)
            .field("path", &self.path)
            .field("predicate", &self.predicate.is_some())
            .field("plans", &self.plans)
            .field("soft", &self.soft)
            .finish()
    }
}

impl Rule {
    /// A rule for `policy` (a [`Policy`] or text such as `"5/1m"`, reported by `build()` if
    /// invalid) that matches every request until narrowed.
    pub fn new<P>(policy: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        Rule {
            policy: policy.try_into().map_err(Into::into),
            method: None,
            path: None,
            predicate: None,
            plans: Vec::new(),
            soft: false,
        }
    }

    /// Only requests with this method.
    pub fn method(mut self, method: Method) -> Self {
        self.method = Some(method);
        self
    }

    /// Only requests whose path matches `pattern`.
    pub fn path(mut self, pattern: impl Into<String>) -> Self {
        self.path = Some(pattern.into());
        self
    }

    /// Only requests for which `predicate` holds.
    pub fn when<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&RequestHead<'_>) -> bool + Send + Sync + 'static,
    {
        self.predicate = Some(Arc::new(predicate));
        self
    }

    /// The limits of the rule's policy for requests on plan `plan` (as the layer's
    /// [plan function](crate::RateLimitLayerBuilder::plan) names it): a [`Policy`] or text such
    /// as `"600/1m + 10000/1d"`, of which only the limits count. They must have the policy's
    /// windows, checked by `build()`: the plan's limits decide the policy's own state, which
    /// a customer keeps when changing plans (upgrading after 60 requests of a free `60/1m`
    /// leaves 540 of a pro `600/1m`). A request on no plan, or on one the rule does not
    /// name, gets the policy's own limits. An [override](crate::store::Overrides) in the
    /// store, for the key, for the plan or for the whole policy, wins over a plan's limits
    /// (the order: [`Scope`](crate::store::Scope)).
    ///
    /// ```
    /// use tower_redis_ratelimit::{Policy, RateLimitLayer, Rule};
    ///
    /// #[derive(Clone)]
    /// struct Plan(&'static str); // set by the authentication middleware
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .plan(|head| head.extensions.get::<Plan>().map(|plan| plan.0))
    ///     .rule(
    ///         Rule::new(Policy::new("api", ["60/1m".parse()?, "1000/1d".parse()?])?)
    ///             .plan("pro", "600/1m + 10000/1d")
    ///             .plan("enterprise", "6000/1m + 100000/1d"),
    ///     )
    ///     .build()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn plan<P>(self, plan: impl Into<String>, limits: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        self.plan_checked(plan.into(), limits.try_into().map_err(Into::into))
    }

    /// Adds a plan whose limits have been read already.
    pub(crate) fn plan_checked(mut self, plan: String, limits: Result<Policy, BuildError>) -> Self {
        self.plans.push((plan, limits));
        self
    }

    /// A soft limit: a request over it is passed on to the service instead of refused, with
    /// its decision, not allowed, in the request's [`Decisions`](crate::Decisions) and the
    /// `RateLimit` fields on the response, so that the handler decides what to do (ask for a
    /// captcha, degrade the answer). It counts as refused in the metrics, records nothing
    /// (a refused request never does; counted by outcome, it is charged when it matches), and
    /// the deny cache does not answer for it. With a penalty box
    /// ([`Policy::block_for`](crate::Policy::block_for)), a soft policy marks the key's
    /// requests over for the box's length, and its limits' as long as they would refuse. A rule
    /// with no method, path or predicate is soft for every request it meets.
    ///
    /// ```
    /// use axum::{routing::post, Extension, Router};
    /// use tower_redis_ratelimit::{Decisions, Policy, RateLimitLayer, Rule};
    ///
    /// async fn login(Extension(decisions): Extension<Decisions>) -> &'static str {
    ///     if decisions.is_over() {
    ///         return "solve the captcha first";
    ///     }
    ///     "welcome"
    /// }
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .rule(Rule::new(Policy::new("login", ["3/1m".parse()?])?).soft())
    ///     .build()?;
    /// let app: Router = Router::new().route("/login", post(login)).layer(layer);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn soft(mut self) -> Self {
        self.soft = true;
        self
    }

    /// Checks the rule: its policy, its plans' limits and its path pattern.
    pub(crate) fn build(self) -> Result<Built, BuildError> {
        let path = self.path.as_deref().map(PathPattern::parse).transpose()?;
        let matcher = Matcher {
            method: self.method,
            path,
            predicate: self.predicate,
        };
        let policy = self.policy?;
        let plans = self
            .plans
            .into_iter()
            .map(|(plan, limits)| {
                let error = |error: PolicyError| BuildError::Plan {
                    policy: policy.name().to_owned(),
                    plan: plan.clone(),
                    why: error.to_string(),
                };
                let limits = limits?;
                let limits = policy
                    .with_limits(limits.limits().iter().copied())
                    .map_err(error)?
                    .on_plan(&plan);
                Ok((plan, limits))
            })
            .collect::<Result<Plans, BuildError>>()?;
        if let Some(i) = (1..plans.len()).find(|&i| plans[..i].iter().any(|p| p.0 == plans[i].0)) {
            return Err(BuildError::Plan {
                policy: policy.name().to_owned(),
                plan: plans[i].0.clone(),
                why: "the plan is named twice".into(),
            });
        }
        let soft = self.soft;
        Ok(Built {
            matcher,
            policy,
            plans,
            soft,
        })
    }
}

/// The checked form of a rule's conditions.
#[derive(Clone)]
pub(crate) struct Matcher {
    method: Option<Method>,
    path: Option<PathPattern>,
    predicate: Option<Arc<Predicate>>,
}

impl Matcher {
    /// A request this matcher matches, as a method and a path (each wildcard segment made
    /// `x`), for the file watcher's check of what a new table leaves unlimited; `None` for a
    /// rule with a predicate, whose requests a method and path do not tell.
    #[cfg(feature = "config")]
    pub(crate) fn probe(&self) -> Option<(Method, String)> {
        if self.predicate.is_some() {
            return None;
        }
        let method = self.method.clone().unwrap_or(Method::GET);
        let segments = self.path.as_ref().map_or(&[][..], |p| &p.0[..]);
        let path: String = segments
            .iter()
            .map(|segment| match segment {
                Segment::Literal(literal) => format!("/{literal}"),
                Segment::Any | Segment::Rest => "/x".to_owned(),
            })
            .collect();
        Some((
            method,
            if path.is_empty() {
                "/".to_owned()
            } else {
                path
            },
        ))
    }

    pub(crate) fn matches(&self, head: &RequestHead<'_>) -> bool {
        // A GET handler answers HEAD too (axum's `get` does), so a GET rule covers it.
        let method =
            |m: &Method| m == head.method || (m == Method::GET && head.method == Method::HEAD);
        self.method.as_ref().is_none_or(method)
            && self
                .path
                .as_ref()
                .is_none_or(|p| p.matches(head.uri.path()))
            && self.predicate.as_ref().is_none_or(|p| p(head))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Any,
    Rest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PathPattern(Vec<Segment>);

impl PathPattern {
    fn parse(pattern: &str) -> Result<Self, BuildError> {
        let bad = |why: &str| BuildError::Pattern {
            pattern: pattern.to_owned(),
            why: why.to_owned(),
        };
        let rest = pattern
            .strip_prefix('/')
            .ok_or_else(|| bad("must start with /"))?;
        let segments: Vec<Segment> = rest
            .split('/')
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "*" => Ok(Segment::Any),
                "**" => Ok(Segment::Rest),
                s if s.starts_with("{*") && s.ends_with('}') => Ok(Segment::Rest),
                s if s.starts_with('{') && s.ends_with('}') => Ok(Segment::Any),
                s if s.contains(['{', '}', '*']) => {
                    Err(bad("a segment is a literal, {name}, *, {*name} or **"))
                }
                s => Ok(Segment::Literal(s.to_owned())),
            })
            .collect::<Result<_, _>>()?;
        if segments.iter().rev().skip(1).any(|s| *s == Segment::Rest) {
            return Err(bad("{*name} or ** must be the last segment"));
        }
        Ok(PathPattern(segments))
    }

    fn matches(&self, path: &str) -> bool {
        let mut parts = path.split('/').filter(|s| !s.is_empty());
        for segment in &self.0 {
            match (segment, parts.next()) {
                (Segment::Rest, _) => return true,
                (Segment::Any, Some(_)) => {}
                (Segment::Literal(l), Some(p)) if l == p => {}
                _ => return false,
            }
        }
        parts.next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_patterns() {
        let p = |s| PathPattern::parse(s).unwrap();
        assert!(p("/users/{id}").matches("/users/42"));
        assert!(!p("/users/{id}").matches("/users/42/posts"));
        assert!(!p("/users/{id}").matches("/users"));
        assert!(p("/static/{*rest}").matches("/static/css/site.css"));
        assert!(p("/static/**").matches("/static/"));
        assert!(p("/a/*/c").matches("/a/b/c"));
        assert!(p("/").matches("/"));
        assert!(!p("/").matches("/x"));
        assert!(p("/login").matches("/login/"));
        assert!(p("/login").matches("//login"));
        assert!(PathPattern::parse("users").is_err());
        assert!(PathPattern::parse("/a/{*rest}/b").is_err());
        assert!(PathPattern::parse("/a{b").is_err());
    }
}
