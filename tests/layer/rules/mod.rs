//! Rules: the rule table replaced at run time, and a rules edit meeting the store's overrides.

mod overrides;
#[cfg(feature = "config")]
mod table;
