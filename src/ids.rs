//! Ids that another process, or another store or layer of this one, is unlikely to share:
//! where concurrency slots, waiters and reservation tickets start counting.

/// A start for ids of concurrency slots or waiters that another process, or another store or
/// layer of this one, is unlikely to share: a hash of the process, the time and a fresh
/// allocation's address, in 52 bits (ids stay exact in the scripts' numbers).
pub(crate) fn random_start() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let here = Box::new(0u8);
    let mut hasher = blake3::Hasher::new();
    hasher.update(&std::process::id().to_le_bytes());
    hasher.update(&nanos.to_le_bytes());
    hasher.update(&(std::ptr::addr_of!(*here) as usize).to_le_bytes());
    let mut first = [0; 8];
    first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first) & ((1 << 52) - 1)
}
