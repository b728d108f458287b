//! CPU readings shared by the load examples (`http_load`, `store_load`).

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
