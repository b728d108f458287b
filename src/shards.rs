//! A bounded map from (policy, key) to what is kept about that client, split into shards that
//! are locked independently.
//!
//! [`MemoryStore`](crate::MemoryStore) keeps its rate-limit state here and the deny cache its
//! refusals. Both are on the path of every request, so a lookup borrows the key instead of
//! cloning it, hashes it once (foldhash, seeded per map), and holds one shard's lock for a few
//! arithmetic steps; two cores rarely meet on one lock. Every entry carries the time its value
//! stops mattering and the time it was last used; its value says until when it must not be
//! evicted (its pin, [`Pinning`]). Times are whole microseconds on a clock the owner chooses.
//!
//! A full shard evicts unpinned entries first, least recently used first; when every entry of
//! a shard is pinned, the one whose pin ends soonest goes (counted in
//! `ratelimit_evicted_pinned_total`), so that the bound always holds. The memory store pins a
//! key while it is in its penalty box or holds concurrency slots; the deny cache and the lease
//! book pin nothing.
//!
//! Pinning is written here by hand rather than taken from a cache crate such as `quick_cache`
//! (`Lifecycle::is_pinned`): there a pinned entry is never evicted, so a cache full of pinned
//! entries outgrows its bound, which a client could force with boxed keys; it has no expiry per
//! entry, which the sweep of dead state needs; and the store changes a key's state in place
//! under its shard's lock, one atomic step per decision, where a cache hands out copies or
//! guards. A pin here is read from the value by the eviction scan, in the pass it already makes,
//! so it can never disagree with the state it protects.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::policy::Id;
use crate::Key;

/// What the map asks of a value when it must evict: until when (µs) the value must not go
/// unless every entry of its shard must (0, the default: it may go any time).
pub(crate) trait Pinning {
    fn pinned_until(&self) -> u64 {
        0
    }
}

/// How often a shard drops expired entries while new keys arrive, at most (µs).
const SWEEP_INTERVAL: u64 = 1_000_000;

/// The map. `max_keys` bounds the entries of all shards together.
pub(crate) struct Shards<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    /// Seeded per map, so that clients cannot choose keys that collide.
    hasher: RandomState,
    /// The most entries one shard holds.
    capacity: usize,
}

struct Shard<V> {
    entries: HashTable<Entry<V>>,
    /// When expired entries are next swept out.
    next_sweep: u64,
}

/// What is kept about one key under one policy.
pub(crate) struct Entry<V> {
    hash: u64,
    /// The policy's id the map is keyed by (`Policy::state_id` or `Policy::terms_id`), not
    /// its name alone.
    policy: Arc<str>,
    key: Key,
    /// When the value stops mattering; the entry is dead from then on.
    pub(crate) expires: u64,
    /// When the key was last looked up. When a shard is full, the entries used least recently
    /// are evicted first.
    used: u64,
    pub(crate) value: V,
}

/// One shard, locked, for one key.
pub(crate) struct Locked<'a, V> {
    hash: u64,
    shard: MutexGuard<'a, Shard<V>>,
    capacity: usize,
}

impl<V> Shards<V> {
    /// A map of at most `max_keys` entries (at least one per shard).
    pub(crate) fn new(max_keys: u64) -> Self {
        let max_keys = usize::try_from(max_keys).unwrap_or(usize::MAX);
        // Enough shards that two cores rarely meet on one lock, few enough that small bounds
        // still split evenly: one shard per 256 keys, at most 64, a power of two.
        let shards = (max_keys / 256).clamp(1, 64).next_power_of_two().min(64);
        Shards {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        entries: HashTable::new(),
                        next_sweep: 0,
                    })
                })
                .collect(),
            hasher: RandomState::default(),
            capacity: (max_keys / shards).max(1),
        }
    }

    /// Locks the shard of `key` under `policy` (one of a policy's ids).
    pub(crate) fn lock(&self, key: &Key, policy: Id<'_>) -> Locked<'_, V> {
        let hash = self.hasher.hash_one((policy.hash, key.as_str()));
        // Bits 32 and up pick the shard: the table inside uses the lowest bits for the bucket
        // and the top seven as a tag, so this choice leaves both evenly spread.
        let index = (hash >> 32) as usize & (self.shards.len() - 1);
        Locked {
            hash,
            shard: lock(&self.shards[index]),
            capacity: self.capacity,
        }
    }

    /// Visits every entry, live or expired, shard by shard, and drops those for which `keep`
    /// returns false.
    #[cfg(feature = "redis")]
    pub(crate) fn retain(&self, mut keep: impl FnMut(&Key, &mut V) -> bool) {
        for shard in self.shards.iter() {
            lock(shard)
                .entries
                .retain(|entry| keep(&entry.key, &mut entry.value));
        }
    }

    /// The number of live entries at `now`, once expired ones are dropped.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn len(&self, now: u64) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let mut shard = lock(shard);
                shard.sweep(now);
                shard.entries.len() as u64
            })
            .sum()
    }
}

impl<V: Pinning> Locked<'_, V> {
    /// The entry of `key` under `policy`, live or expired, marked as used at `now`.
    pub(crate) fn get(&mut self, key: &Key, policy: Id<'_>, now: u64) -> Option<&mut Entry<V>> {
        let entry = self
            .shard
            .entries
            .find_mut(self.hash, matches(key, policy))?;
        entry.used = now;
        Some(entry)
    }

    /// Adds an entry for `key` under `policy`, which [`get`](Self::get) just did not find,
    /// expiring at `expires`, making room first if the shard is full.
    pub(crate) fn insert(&mut self, key: &Key, policy: Id<'_>, now: u64, expires: u64, value: V) {
        self.shard.make_room(now, self.capacity);
        let entry = Entry {
            hash: self.hash,
            policy: Arc::clone(policy.text),
            key: key.clone(),
            expires,
            used: now,
            value,
        };
        self.shard
            .entries
            .insert_unique(self.hash, entry, |e| e.hash);
    }

    /// Forgets `key` under `policy`.
    pub(crate) fn remove(&mut self, key: &Key, policy: Id<'_>) {
        if let Ok(entry) = self
            .shard
            .entries
            .find_entry(self.hash, matches(key, policy))
        {
            entry.remove();
        }
    }
}

impl<V> Entry<V> {
    /// Whether the value still matters at `now`.
    pub(crate) fn is_live(&self, now: u64) -> bool {
        self.expires > now
    }
}

fn matches<'a, V>(key: &'a Key, policy: Id<'a>) -> impl Fn(&Entry<V>) -> bool + 'a {
    move |entry| entry.key == *key && policy.is(&entry.policy)
}

/// A poisoned lock only means another thread panicked while holding it; every entry is valid
/// between two field writes, so keep using it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V> Shard<V> {
    /// Drops expired entries.
    fn sweep(&mut self, now: u64) {
        self.entries.retain(|e| e.is_live(now));
        self.next_sweep = now.saturating_add(SWEEP_INTERVAL);
    }
}

impl<V: Pinning> Shard<V> {
    /// Before a new entry goes in: sweeps now and then, and when the shard is full, drops
    /// expired entries and then the eighth of the unpinned rest used least recently, so that
    /// the work of evicting is spread over many insertions. When every entry is pinned, the
    /// one whose pin ends soonest goes: the bound holds whatever clients do.
    fn make_room(&mut self, now: u64, capacity: usize) {
        if now >= self.next_sweep || self.entries.len() >= capacity {
            self.sweep(now);
        }
        if self.entries.len() < capacity {
            return;
        }
        let mut used: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| e.value.pinned_until() <= now)
            .map(|e| e.used)
            .collect();
        if used.is_empty() {
            return self.evict_pinned();
        }
        let evict = (used.len() / 8).max(1);
        let (_, &mut threshold, _) = used.select_nth_unstable(evict - 1);
        self.entries
            .retain(|e| e.value.pinned_until() > now || e.used > threshold);
    }

    /// Evicts the entry whose pin ends soonest, in a shard whose entries are all pinned.
    #[cold]
    fn evict_pinned(&mut self) {
        let pin = |e: &Entry<V>| e.value.pinned_until();
        let soonest = self.entries.iter().map(|e| (pin(e), e.hash)).min();
        let Some((pinned, hash)) = soonest else {
            return;
        };
        if let Ok(entry) = self
            .entries
            .find_entry(hash, |e| pin(e) == pinned && e.hash == hash)
        {
            crate::metrics::Report::evicted_pinned(&entry.get().policy);
            entry.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;

    /// A value pinned until the time it holds.
    struct Pin(u64);

    impl Pinning for Pin {
        fn pinned_until(&self) -> u64 {
            self.0
        }
    }

    impl Pinning for char {}

    fn policy() -> Policy {
        "1/1s".parse().unwrap()
    }

    #[test]
    fn finds_inserts_and_removes() {
        let map = Shards::new(1_000);
        let (a, b, p) = (Key::from("a"), Key::from("b"), policy());
        let other = p.clone().named("other").unwrap();
        map.lock(&a, p.state_id())
            .insert(&a, p.state_id(), 0, 10, 'a');
        assert_eq!(
            map.lock(&a, p.state_id())
                .get(&a, p.state_id(), 1)
                .map(|s| s.value),
            Some('a')
        );
        assert!(map
            .lock(&b, p.state_id())
            .get(&b, p.state_id(), 1)
            .is_none());
        assert!(map
            .lock(&a, other.state_id())
            .get(&a, other.state_id(), 1)
            .is_none());
        assert_eq!(map.len(5), 1);
        assert_eq!(map.len(10), 0, "expired at 10");
        map.lock(&b, p.state_id())
            .insert(&b, p.state_id(), 0, 10, 'b');
        map.lock(&b, p.state_id()).remove(&b, p.state_id());
        assert_eq!(map.len(0), 0);
    }

    #[test]
    fn full_shards_evict_the_least_recently_used() {
        let map = Shards::new(8);
        let p = policy();
        let keys: Vec<Key> = (0..8).map(|i| Key::from(format!("k{i}"))).collect();
        for (t, key) in keys.iter().enumerate() {
            map.lock(key, p.state_id())
                .insert(key, p.state_id(), t as u64, u64::MAX, Pin(0));
        }
        // k0 is the oldest insertion but was used last.
        assert!(map
            .lock(&keys[0], p.state_id())
            .get(&keys[0], p.state_id(), 100)
            .is_some());
        let new = Key::from("new");
        map.lock(&new, p.state_id())
            .insert(&new, p.state_id(), 101, u64::MAX, Pin(0));
        assert_eq!(map.len(101), 8);
        assert!(map
            .lock(&keys[0], p.state_id())
            .get(&keys[0], p.state_id(), 102)
            .is_some());
        assert!(map
            .lock(&keys[1], p.state_id())
            .get(&keys[1], p.state_id(), 102)
            .is_none());
    }

    #[test]
    fn full_shards_evict_unpinned_entries_first_then_the_soonest_pin() {
        let map = Shards::new(4);
        let p = policy();
        let keys: Vec<Key> = (0..6).map(|i| Key::from(format!("k{i}"))).collect();
        let has = |key: &Key, now| {
            map.lock(key, p.state_id())
                .get(key, p.state_id(), now)
                .is_some()
        };
        // k0 and k1 pinned until 50 and 40 µs, k2 and k3 not.
        for (t, (key, pinned)) in keys.iter().zip([50, 40, 0, 0]).enumerate() {
            map.lock(key, p.state_id())
                .insert(key, p.state_id(), t as u64, u64::MAX, Pin(pinned));
        }
        // k0 and k1 are the least recently used, but pinned: k2 goes.
        map.lock(&keys[4], p.state_id())
            .insert(&keys[4], p.state_id(), 10, u64::MAX, Pin(60));
        assert!(!has(&keys[2], 11) && has(&keys[0], 11) && has(&keys[1], 11));
        // k3 is the last unpinned entry.
        map.lock(&keys[5], p.state_id())
            .insert(&keys[5], p.state_id(), 12, u64::MAX, Pin(70));
        assert!(!has(&keys[3], 13));
        // All pinned: the pin that ends soonest, k1's, goes, though k4 was used less lately.
        map.lock(&keys[2], p.state_id())
            .insert(&keys[2], p.state_id(), 14, u64::MAX, Pin(0));
        assert_eq!(map.len(14), 4);
        assert!(!has(&keys[1], 15) && has(&keys[0], 15) && has(&keys[4], 15));
        // Once a pin has ended, its entry is evicted as any unpinned one, by when it was used
        // (k2 at 14, k0 at 15).
        map.lock(&keys[3], p.state_id())
            .insert(&keys[3], p.state_id(), 55, u64::MAX, Pin(0));
        assert!(!has(&keys[2], 56) && has(&keys[0], 56));
        assert!(has(&keys[4], 56) && has(&keys[5], 56));
    }
}
