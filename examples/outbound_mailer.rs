//! Turns for work that is not an HTTP call: a mailer whose 3 workers, each with a store of its
//! own (as 3 processes of a fleet would have), share a mail provider's limit through Redis.
//! The provider, a stand-in in this process, accepts 20 recipients in any second and refuses
//! beyond; it also refuses its 10th message once, asking for a pause of 1 s.
//!
//! Each message waits for a turn of as many units as it has recipients
//! (`Turns::wait(key, cost)`), uses it with `Turn::go()` right before it goes out, and pauses
//! the key for every worker when the provider asks (`Turns::pause`). Worker 2 is shut down
//! after 1.5 s while it waits: its wait is dropped, and gives its place back, so that the
//! other workers' messages move up.
//!
//! ```text
//! cargo run --example outbound_mailer --features redis
//! ```
//!
//! Uses `REDIS_URL` if set; otherwise starts its own `redis-server` on a free loopback port.

#[path = "support/redis.rs"]
#[allow(dead_code)]
mod scratch;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_redis_ratelimit::client::{OutboundLayer, Turn, Turns};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = scratch::Scratch::start(0)?;
            (server.url(), Some(server))
        }
    };
    let provider = Provider::default();
    // The provider's limit, 20 recipients in any second; each message costs its recipients.
    let policy = Policy::new("mail", ["20/1s".parse()?])?.with_algorithm(Algorithm::SlidingLog);
    let start = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..3 {
        let layer = OutboundLayer::builder()
            .policy(policy.clone())
            .store(RedisStore::connect(&url).await?)
            .max_wait(Duration::from_secs(30))
            .build()?;
        let work = send_all(worker, layer.turns(), provider.clone(), start);
        workers.push(tokio::spawn(async move {
            match worker {
                // Shut down while it waits: the wait in progress is dropped.
                2 => match tokio::time::timeout(Duration::from_millis(1500), work).await {
                    Ok(sent) => sent,
                    Err(_) => {
                        println!("worker 2: shut down at 1.5 s, its wait given back");
                        Ok(())
                    }
                },
                _ => work.await,
            }
        }));
    }
    for worker in workers {
        if let Err(error) = worker.await? {
            eprintln!("a worker failed: {}", chain(error.as_ref()));
        }
    }
    provider.report(start);
    Ok(())
}

/// Sends a worker's 12 messages, of 1 to 3 recipients each, one at a time.
async fn send_all(
    worker: usize,
    turns: Turns<RedisStore>,
    provider: Provider,
    start: Instant,
) -> Result<(), Error> {
    let key = Key::from("mail-provider");
    for message in 0..12u32 {
        let recipients = 1 + (message + worker as u32) % 3;
        // Waits for its turn: the future gives its place back if dropped (worker 2).
        let turn: Turn<RedisStore> = turns.wait(key.clone(), recipients).await?;
        turn.go(); // right before the message goes out
        if let Err(pause) = provider.send(recipients).await {
            println!(
                "worker {worker}: message {message} refused at {:.2} s, pausing the mail for {pause:?}",
                start.elapsed().as_secs_f64()
            );
            turns.pause(&key, pause);
        }
    }
    println!(
        "worker {worker}: 12 messages in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The stand-in mail provider: when each message arrived, its recipients, and whether it was
/// refused.
#[derive(Clone, Default)]
struct Provider {
    seen: Arc<Mutex<Vec<(Instant, u32, bool)>>>,
}

impl Provider {
    /// Sends a message to `recipients`: refused (with the pause the provider asks for) beyond
    /// 20 recipients in any second, and once on its 10th message. Takes 20 ms, as a call to a
    /// provider does.
    async fn send(&self, recipients: u32) -> Result<(), Duration> {
        let refused = {
            let now = Instant::now();
            let mut seen = self.seen.lock().unwrap();
            let second = Duration::from_secs(1);
            let accepted = seen
                .iter()
                .filter(|&&(t, _, refused)| !refused && t + second > now);
            let used: u32 = accepted.map(|&(_, r, _)| r).sum();
            let refused = used + recipients > 20 || seen.len() + 1 == 10;
            seen.push((now, recipients, refused));
            refused
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        match refused {
            true => Err(Duration::from_secs(1)),
            false => Ok(()),
        }
    }

    /// What the provider saw in each second of the run, and the most it accepted in any second.
    fn report(&self, start: Instant) {
        let seen = self.seen.lock().unwrap();
        let last = seen
            .iter()
            .map(|&(t, ..)| t - start)
            .max()
            .unwrap_or_default();
        println!("\nsecond  recipients  refused messages");
        for s in 0..=last.as_secs() {
            let at = |&&(t, ..): &&(Instant, u32, bool)| (t - start).as_secs() == s;
            let accepted: u32 = seen.iter().filter(at).filter(|m| !m.2).map(|m| m.1).sum();
            let refused = seen.iter().filter(at).filter(|m| m.2).count();
            println!("{s:>6}  {accepted:>10}  {refused:>16}");
        }
        let fullest = seen
            .iter()
            .map(|&(t, ..)| {
                let window = |m: &&(Instant, u32, bool)| {
                    !m.2 && m.0 <= t && m.0 + Duration::from_secs(1) > t
                };
                seen.iter().filter(window).map(|m| m.1).sum::<u32>()
            })
            .max()
            .unwrap_or(0);
        println!(
            "\n{} messages, {} refused, at most {fullest} recipients in any second, {:.1} s in all",
            seen.len(),
            seen.iter().filter(|m| m.2).count(),
            last.as_secs_f64()
        );
    }
}

/// An error and its causes, one after the other.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}
