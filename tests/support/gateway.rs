//! The LLM gateway of the body-keyed usage tests: keyed on the JSON body's `user`, each request
//! reserving the `max_tokens` it asks for.

use tower_redis_ratelimit::key::body::{BodyFieldLayer, BodyFields};
use tower_redis_ratelimit::RequestHead;

/// The body reader: `user` (the key) and the number `max_tokens`.
pub fn body_fields() -> BodyFieldLayer {
    BodyFieldLayer::builder("user")
        .number("max_tokens")
        .build()
        .unwrap()
}

/// A request's cost: the `max_tokens` its body asks for, 100 where it asks none.
pub fn max_tokens(head: &RequestHead<'_>) -> u32 {
    let asked = BodyFields::of(head).and_then(|fields| fields.number("max_tokens"));
    asked.map_or(100, |n| u32::try_from(n).unwrap_or(u32::MAX))
}
