//! CPU and allocation readings shared by the load examples (`http_load`, `store_load`), their
//! key distributions (`keys`) and their Redis (`redis`).

pub mod keys;
pub mod redis;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// User and system CPU time of this process, from `/proc/self/stat` (Linux only).
pub fn process_cpu_seconds() -> Option<f64> {
    /// `sysconf(_SC_CLK_TCK)`, which is 100 on every Linux this runs on.
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; the fields after it don't.
    let after_name = &stat[stat.rfind(')')? + 2..];
    let mut fields = after_name.split(' ').skip(11); // utime is field 14, the 12th after the name
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((user + system) / TICKS_PER_SECOND)
}

/// Redis's user and system CPU seconds, from the text of `INFO cpu`.
pub fn redis_cpu_seconds(info: &str) -> f64 {
    info.lines()
        .filter_map(|line| line.trim().split_once(':'))
        .filter(|(name, _)| matches!(*name, "used_cpu_sys" | "used_cpu_user"))
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

/// The system allocator, counting the allocations (`alloc` and `realloc` calls) and the bytes
/// they ask for. Each thread counts in a slot of its own, on its own cache line: one shared
/// counter would have the load's threads contend for it on every allocation.
pub struct CountingAllocator;

const SLOTS: usize = 64;

#[repr(align(128))]
struct Slot {
    allocations: AtomicU64,
    bytes: AtomicU64,
}

static COUNTS: [Slot; SLOTS] = [const {
    Slot {
        allocations: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
    }
}; SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SLOT: usize = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS;
}

impl CountingAllocator {
    fn count(size: usize) {
        let slot = &COUNTS[SLOT.try_with(|slot| *slot).unwrap_or(0)];
        slot.allocations.fetch_add(1, Ordering::Relaxed);
        slot.bytes.fetch_add(size as u64, Ordering::Relaxed);
    }

    /// Allocations and bytes asked for so far, by every thread.
    pub fn totals() -> (u64, u64) {
        COUNTS.iter().fold((0, 0), |(n, b), slot| {
            let allocations = slot.allocations.load(Ordering::Relaxed);
            (n + allocations, b + slot.bytes.load(Ordering::Relaxed))
        })
    }
}

// SAFETY: every call is passed on to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::count(new_size);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
