//! Where a client's state lives: its Redis key, and in a Redis Cluster its hash slot.
//!
//! A script call may only touch keys of one hash slot, so the batcher sends one call per hash slot.
//! If every client had a hash slot of its own, as `{<policy>:<key>}` gives, a cluster would decide
//! nearly every request in a call of its own, and lose the batching that a single Redis gets. In a
//! cluster the store therefore puts each client under one of a fixed set of hash tags, chosen by a
//! hash of policy and key: requests for many clients share a tag, and so a call. The tags are
//! picked so that their hash slots are spread evenly over the 16 384 hash slots, which a cluster
//! divides between its primaries in ranges: with `n` tags on `p` primaries that split the hash
//! slots evenly, each primary holds `n / p` tags when `p` divides `n`.
//!
//! All instances of a service must agree on a key, so the choice depends on nothing but the
//! settings (the hash is unkeyed CRC16, the tags are computed, not random). What it costs: all the
//! clients of one tag move together when its hash slot is resharded, a tag's hash slot carries
//! `1/n` of the load, and changing the number of tags (or moving from a single Redis to a cluster)
//! moves every key, which starts every client's limit afresh.

use crate::{Key, Policy};

/// Hash slots in a Redis Cluster.
const HASH_SLOTS: usize = 16_384;

/// How keys are named: one hash slot per client (a single Redis), or a fixed set of hash tags.
#[derive(Debug, Clone)]
pub(super) enum Placement {
    /// `<prefix>:{<policy>:<key>}:<algorithm>:<limits>`.
    PerClient,
    /// `<prefix>:{<tag>}:<policy>:<key>:<algorithm>:<limits>`, the tag chosen by a hash of
    /// policy name and key.
    Tagged(Vec<String>),
}

impl Placement {
    /// `tags` hash tags whose hash slots are spread evenly: tag `i` lies in the `i`-th of `tags`
    /// equal ranges of hash slots. `tags` must be in `1..=16 384`.
    pub(super) fn tagged(tags: usize) -> Placement {
        let mut chosen: Vec<Option<String>> = vec![None; tags];
        let mut missing = tags;
        // The first tag texts ("0", "1", ...) that fall in each range; about `tags · ln(tags)`
        // hashes in all.
        let mut candidate = 0u64;
        while missing > 0 {
            let text = candidate.to_string();
            let range = usize::from(hash_slot_of(text.as_bytes())) * tags / HASH_SLOTS;
            if chosen[range].is_none() {
                chosen[range] = Some(text);
                missing -= 1;
            }
            candidate += 1;
        }
        Placement::Tagged(chosen.into_iter().flatten().collect())
    }

    /// Where `key`'s state under `policy` lives.
    pub(super) fn place(&self, prefix: &str, key: &Key, policy: &Policy) -> Place {
        let (name, client, shape) = (policy.name(), key.as_str(), policy.shape());
        // `concat` allocates once, at the exact size.
        match self {
            Placement::PerClient => Place {
                key: [prefix, ":{", name, ":", client, "}:", shape].concat(),
                lane: 0,
            },
            Placement::Tagged(tags) => {
                let lane = tag_index(name, client, tags.len());
                let tag = &tags[lane];
                Place {
                    key: [prefix, ":{", tag, "}:", name, ":", client, ":", shape].concat(),
                    lane,
                }
            }
        }
    }

    /// The batching lane of `key` under `policy` (see [`Place::lane`]), without naming its
    /// key.
    pub(super) fn lane(&self, key: &Key, policy: &Policy) -> usize {
        match self {
            Placement::PerClient => 0,
            Placement::Tagged(tags) => tag_index(policy.name(), key.as_str(), tags.len()),
        }
    }

    /// The hash of overrides that the calls of lane `lane` read (`overrides/`): on a
    /// single Redis one for every key, in a cluster one per tag, in the tag's hash slot.
    pub(super) fn overrides_key(&self, prefix: &str, lane: usize) -> String {
        match self {
            Placement::PerClient => format!("{prefix}:overrides"),
            Placement::Tagged(tags) => {
                format!("{prefix}:{{{}}}:overrides", tags[lane % tags.len()])
            }
        }
    }

    /// How many hash slots the keys may fall in, for the batcher's lanes: the tags, or one for
    /// a single Redis.
    pub(super) fn lanes(&self) -> usize {
        match self {
            Placement::PerClient => 1,
            Placement::Tagged(tags) => tags.len(),
        }
    }
}

/// A client's Redis key, and the index of its hash tag (0 on a single Redis): the batcher
/// queues the requests of each tag apart, since one call takes keys of one hash slot only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) key: String,
    pub(super) lane: usize,
}

/// Splits keys into groups that one call can take: all of them, or in a cluster one group per
/// hash slot. Returns indices into `keys`.
pub(super) fn by_hash_slot(keys: &[String], clustered: bool) -> Vec<Vec<usize>> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let hash_slot = match clustered {
            true => fred::util::redis_keyslot(key.as_bytes()),
            false => 0,
        };
        match groups.iter_mut().find(|(s, _)| *s == hash_slot) {
            Some((_, group)) => group.push(i),
            None => groups.push((hash_slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

/// Which of `tags` tags holds `client` under the policy `name`: CRC16 of both, with a
/// separator that keeps `("a:b", "c")` and `("a", "b:c")` apart.
fn tag_index(name: &str, client: &str, tags: usize) -> usize {
    let mut crc = crc16::State::<crc16::XMODEM>::new();
    crc.update(&(name.len() as u64).to_le_bytes());
    crc.update(name.as_bytes());
    crc.update(client.as_bytes());
    usize::from(crc.get()) % tags
}

/// The hash slot of a key without braces, as Redis computes it.
fn hash_slot_of(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key) % HASH_SLOTS as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        "10/1m".parse::<Policy>().unwrap().named("api").unwrap()
    }

    #[test]
    fn a_single_redis_keeps_one_hash_slot_per_client() {
        let place = Placement::PerClient.place("rl", &Key::from("c1"), &policy());
        assert_eq!(place.key, "rl:{api:c1}:log:1m");
        assert_eq!(place.lane, 0);
        // An unnamed policy's key carries its whole limits (see `Policy::identity`).
        let unnamed = "10/1m".parse::<Policy>().unwrap();
        let place = Placement::PerClient.place("rl", &Key::from("c1"), &unnamed);
        assert_eq!(place.key, "rl:{default:c1}:log:10/1m");
    }

    #[test]
    fn tags_are_spread_evenly_over_the_hash_slots() {
        for tags in [1, 3, 12, 64, 1000] {
            let Placement::Tagged(texts) = Placement::tagged(tags) else {
                unreachable!()
            };
            assert_eq!(texts.len(), tags);
            for (i, text) in texts.iter().enumerate() {
                let hash_slot = usize::from(fred::util::redis_keyslot(text.as_bytes()));
                assert_eq!(hash_slot * tags / HASH_SLOTS, i, "tag {text} of {tags}");
            }
        }
    }

    #[test]
    fn clients_share_the_tags_evenly() {
        let placement = Placement::tagged(12);
        let Placement::Tagged(texts) = &placement else {
            unreachable!()
        };
        let mut per_tag = vec![0usize; 12];
        for i in 0..12_000 {
            let Place { key, lane } =
                placement.place("rl", &Key::from(format!("c-{i}")), &policy());
            let tag = &key[key.find('{').unwrap() + 1..key.find('}').unwrap()];
            assert_eq!(texts[lane], tag);
            per_tag[lane] += 1;
            assert!(key.ends_with(&format!("}}:api:c-{i}:log:1m")), "{key}");
        }
        // 1000 expected per tag; a fair hash stays well within ±20 %.
        assert!(
            per_tag.iter().all(|&n| (800..1200).contains(&n)),
            "{per_tag:?}"
        );
    }

    #[test]
    fn the_tag_depends_on_policy_and_key_only() {
        let (a, b) = (Placement::tagged(16), Placement::tagged(16));
        let key = Key::from("10.0.0.1");
        assert_eq!(
            a.place("rl", &key, &policy()),
            b.place("rl", &key, &policy())
        );
        assert_ne!(tag_index("a:b", "c", 16_384), tag_index("a", "b:c", 16_384));
    }
}
