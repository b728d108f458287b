//! Where an override lives in Redis: which hash, which field.
//!
//! Fields are named by the policy's owner (its name; an unnamed policy's identity), never by
//! its windows or algorithm, so that a block outlives a change of those (`store/owner.rs`).
//! One scope is one field, so counts and a block of one scope replace each other in one write:
//!
//! - a key's: its state key without the policy's windows (`:<shape>`, [`Policy::shape`]), in
//!   the hash of the key's lane; for an unnamed policy, the whole state key;
//! - a plan's: the decimal plan id ([`Owner::plan_id_of`](crate::store::owner::Owner)), in
//!   every lane's hash;
//! - the policy-wide one: the decimal owner id ([`Owner::all_id`](crate::store::owner::Owner)),
//!   in every lane's hash.
//!
//! No field is named `""`: that one holds the hash's generation (`known.rs`).
//!
//! A decision's script finds the same fields from what [`head`] passes it (`prelude.lua`,
//! "Overrides").

use super::super::placement::Place;
use super::super::RedisStore;
use crate::store::overrides::Scope;
use crate::Policy;

/// How many bytes of the state key at `place` name the key's override field.
pub(in crate::store::redis) fn key_field_len(place: &Place, policy: &Policy) -> usize {
    if policy.name() == Policy::DEFAULT_NAME {
        return place.key.len();
    }
    // Both placements end a state key in `:<shape>`.
    place.key.len().saturating_sub(policy.shape().len() + 1)
}

/// What a decision's script needs to find the overrides of a request at `place` under
/// `policy`: the length of its key's field, the policy-wide field and the plan's (0: none).
pub(in crate::store::redis) fn head(place: &Place, policy: &Policy) -> [u64; 3] {
    let owner = policy.owner();
    let keep = key_field_len(place, policy) as u64;
    [keep, owner.all_id(), owner.plan_id()]
}

impl RedisStore {
    /// Where the override of `policy` for `scope` lives: (hash, field) pairs, one per lane for
    /// a plan's or the policy-wide one.
    pub(super) fn fields(&self, policy: &Policy, scope: &Scope) -> Vec<(String, String)> {
        let inner = &self.inner;
        let everywhere = |field: u64| {
            let field = field.to_string();
            (0..inner.placement.lanes())
                .map(|lane| {
                    (
                        inner.placement.overrides_key(&inner.prefix, lane),
                        field.clone(),
                    )
                })
                .collect()
        };
        match scope {
            Scope::Key(key) => {
                let place = inner.place(key, policy);
                let hash = inner.placement.overrides_key(&inner.prefix, place.lane);
                let len = key_field_len(&place, policy);
                vec![(hash, place.key[..len].to_owned())]
            }
            Scope::Plan(plan) => everywhere(policy.owner().plan_id_of(plan)),
            Scope::All => everywhere(policy.owner().all_id()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::placement::Placement;
    use super::*;
    use crate::Key;

    #[test]
    fn a_key_field_leaves_the_windows_out() {
        let api = Policy::new("api", ["5/1m".parse().unwrap()]).unwrap();
        let wider = Policy::new("api", ["5/1m".parse().unwrap(), "50/1h".parse().unwrap()])
            .unwrap()
            .with_algorithm(crate::Algorithm::Gcra);
        let unnamed: Policy = "5/1m".parse().unwrap();
        let key = Key::from("k:1");
        for placement in [Placement::PerClient, Placement::Tagged(vec!["a".into()])] {
            let field = |policy: &Policy| {
                let place = placement.place("rl", &key, policy);
                place.key[..key_field_len(&place, policy)].to_owned()
            };
            assert_eq!(field(&api), field(&wider));
            assert!(field(&api).ends_with("api:k:1") || field(&api).ends_with("api:k:1}"));
            // An unnamed policy's is its whole state key: its limits are its identity.
            let place = placement.place("rl", &key, &unnamed);
            assert_eq!(field(&unnamed), place.key);
        }
    }
}
