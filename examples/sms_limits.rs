//! SMS limits changed at run time, the classic recipe: at most 1 per minute, 5 per hour and 10
//! per day per phone number, kept in Redis and shared by two instances, while an operator
//! raises the hourly limit for everybody and gives one VIP number far more, without a restart.
//!
//! ```text
//! cargo run --all-features --example sms_limits
//! ```
//!
//! It starts its own `redis-server` on a free loopback port (`$REDIS_SERVER` or
//! `redis-server` from `PATH`). Two phones ask to send one message every five minutes for a
//! day, as scheduled sends (`Store::check_at`, event times from now on), alternating between
//! the two instances. Two hours in, the operator sets `8/1h` for every phone and
//! `1/1m + 50/1h + 100/1d` for the VIP; the usage so far counts under the new limits. The
//! example prints what each phone sent per hour, and checks that the ordinary phone stayed
//! within `10/1d` and the VIP within what its override grants.

#[allow(dead_code)]
#[path = "support/redis.rs"]
mod scratch;

use std::time::{Duration, SystemTime};

use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::{Key, Limit, Policy, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> Result<(), Error> {
    let redis = scratch::Scratch::start(0)?;
    // Two instances of the SMS service, one Redis.
    let instances = [
        RedisStore::connect(&redis.url()).await?,
        RedisStore::connect(&redis.url()).await?,
    ];
    let limit = |text: &str| text.parse::<Limit>();
    let sms = Policy::new("sms", [limit("1/1m")?, limit("5/1h")?, limit("10/1d")?])?;
    let (ordinary, vip) = (Key::from("+447700900001"), Key::from("+447700900002"));

    let start = SystemTime::now();
    let mut sent = [[0u32; 24]; 2];
    for step in 0..24 * 12 {
        let at = start + 5 * MINUTE * step;
        let hour = (step / 12) as usize;
        if step == 24 {
            // Two hours in: the operator's change, made through one instance, read by both.
            let overrides = instances[0].overrides();
            let everybody = Override::Limits(vec![limit("1/1m")?, limit("8/1h")?, limit("10/1d")?]);
            overrides.set(&sms, &Scope::All, &everybody).await?;
            let generous =
                Override::Limits(vec![limit("1/1m")?, limit("50/1h")?, limit("100/1d")?]);
            overrides
                .set(&sms, &Scope::Key(vip.clone()), &generous)
                .await?;
            println!(
                "hour 2: the operator sets 8/1h for every phone, 1/1m + 50/1h + 100/1d for the VIP"
            );
        }
        let store = &instances[step as usize % 2];
        for (phone, key) in [&ordinary, &vip].into_iter().enumerate() {
            if store.check_at(key, &sms, 1, at).await?.is_allowed() {
                sent[phone][hour] += 1;
            }
        }
    }

    for (name, hours) in [("ordinary", sent[0]), ("VIP", sent[1])] {
        let total: u32 = hours.iter().sum();
        println!("{name:>8}: {total:>3} sent in the day, per hour {hours:?}");
    }
    let (ordinary_total, vip_total): (u32, u32) = (sent[0].iter().sum(), sent[1].iter().sum());
    assert!(ordinary_total <= 10, "the ordinary phone went past 10/1d");
    assert!(vip_total <= 100, "the VIP went past its override's 100/1d");
    let listed = instances[1].overrides().list(&sms).await?;
    println!("overrides in force, as the other instance lists them: {listed:?}");
    Ok(())
}
