//! What Redis ran, as `redis-cli monitor` saw it: the tests that replay a store's own calls
//! read their arguments from there.

use std::time::Duration;

/// Reads a `redis-cli monitor` line's quoted arguments (redis-cli's escapes: `\\`, `\"`, `\n`,
/// `\r`, `\t`, `\a`, `\b`, `\xHH`).
pub fn monitor_args(line: &str) -> Vec<Vec<u8>> {
    let bytes = line.as_bytes();
    let start = line.find("] ").map_or(0, |i| i + 2);
    let (mut args, mut i) = (Vec::new(), start);
    while i < bytes.len() {
        if bytes[i] != b'"' {
            i += 1;
            continue;
        }
        i += 1;
        let mut arg = Vec::new();
        while i < bytes.len() && bytes[i] != b'"' {
            if bytes[i] == b'\\' {
                i += 1;
                match bytes[i] {
                    b'x' => {
                        let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                        arg.push(u8::from_str_radix(hex, 16).unwrap());
                        i += 2;
                    }
                    b'n' => arg.push(b'\n'),
                    b'r' => arg.push(b'\r'),
                    b't' => arg.push(b'\t'),
                    b'a' => arg.push(7),
                    b'b' => arg.push(8),
                    other => arg.push(other),
                }
            } else {
                arg.push(bytes[i]);
            }
            i += 1;
        }
        args.push(arg);
        i += 1;
    }
    args
}

/// The `EVALSHA` calls Redis ran while `work` ran, as their arguments (from `MONITOR`).
pub async fn evalsha_seen<F: std::future::Future<Output = ()>>(
    port: u16,
    work: F,
) -> Vec<Vec<Vec<u8>>> {
    evalsha_seen_at(port, work)
        .await
        .into_iter()
        .map(|(_, args)| args)
        .collect()
}

/// As [`evalsha_seen`], each call with the Redis time (µs since the epoch) at which Redis ran
/// it, as `MONITOR` stamps it.
pub async fn evalsha_seen_at<F: std::future::Future<Output = ()>>(
    port: u16,
    work: F,
) -> Vec<(i64, Vec<Vec<u8>>)> {
    let file = std::env::temp_dir().join(format!("monitor-{}-{port}", std::process::id()));
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "monitor"])
        .stdout(std::fs::File::create(&file).unwrap())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    work.await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = monitor.kill();
    let _ = monitor.wait();
    let text = std::fs::read_to_string(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    text.lines()
        .filter(|l| l.contains("] \"EVALSHA\""))
        .map(|l| (monitor_time(l), monitor_args(l)))
        .collect()
}

/// A `MONITOR` line's time stamp (`1700000000.123456 [0 ...`) in µs; -1 if it has none.
fn monitor_time(line: &str) -> i64 {
    let stamp = line.split_whitespace().next().unwrap_or("");
    let (seconds, micros) = stamp.split_once('.').unwrap_or((stamp, "0"));
    match (seconds.parse::<i64>(), micros.parse::<i64>()) {
        (Ok(s), Ok(us)) => s * 1_000_000 + us,
        _ => -1,
    }
}
