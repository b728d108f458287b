//! What a sliding-log key holds in Redis, read as the tests check it.

use fred::prelude::*;

/// A log's members as (score in µs, total, weight), oldest first.
pub type Log = Vec<(i64, u64, u64)>;

/// The members of the sliding-log key `rkey` (`<time>:<total>:<weight>`, `log_events.lua`).
pub async fn members(client: &Client, rkey: &str) -> Log {
    let raw: Vec<(String, f64)> = client
        .zrange(rkey, 0, -1, None, false, None, true)
        .await
        .unwrap();
    raw.into_iter()
        .map(|(m, score)| {
            let parts: Vec<&str> = m.split(':').collect();
            (
                score as i64,
                parts[1].parse().unwrap(),
                parts[2].parse().unwrap(),
            )
        })
        .collect()
}

/// The members whose total less weight is not the total of the member before (0 for the
/// first): a log on which window counts read wrong.
pub fn unsound(log: &[(i64, u64, u64)]) -> Vec<String> {
    let mut bad = Vec::new();
    for j in 1..log.len() {
        let (_, total, weight) = log[j];
        if total.wrapping_sub(weight) != log[j - 1].1 {
            bad.push(format!(
                "member {j}: total {total} - weight {weight} != {}",
                log[j - 1].1
            ));
        }
    }
    bad
}
