//! Decisions sent to Redis together: one script call decides every request that queued while
//! the previous calls were under way.
//!
//! Each `EVALSHA` costs Redis a fixed price (reading the command, setting up the script, one
//! `TIME`) and costs the client a command's round through fred, on top of the work per key.
//! Under load, many decisions wait at once; sending them as one call pays that price once.
//! At most `in_flight` calls are under way at a time; requests that arrive meanwhile queue
//! and leave together, up to `max_batch` per call, as soon as a call returns. A lone request
//! waits for nothing: with a call slot free, it leaves at once in a batch of one.
//!
//! The scripts decide the requests of a batch one after the other, each exactly as a call of
//! its own would, so a batch changes no decision. In Redis Cluster, a batch holds keys of one
//! hash slot only.

use std::sync::Arc;
use std::time::Duration;

use fred::clients::Pool;
use fred::error::{Error, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::scripts::Script;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::algorithm::Algorithm;

/// The reply of one request: five integers (see `scripts/common.lua`).
pub(super) type Reply = Result<[i64; 5], Error>;

/// One request waiting for its decision.
pub(super) struct Job {
    pub(super) algorithm: Algorithm,
    pub(super) key: String,
    /// The request's arguments: number of limits, cost, record, time, then count and window
    /// of each limit.
    pub(super) args: Vec<i64>,
    pub(super) reply: oneshot::Sender<Reply>,
}

/// The queue of jobs, drained by a task that sends the calls.
#[derive(Debug)]
pub(super) struct Batcher {
    queue: mpsc::UnboundedSender<Job>,
}

/// What the sending task needs.
pub(super) struct Settings {
    pub(super) pool: Pool,
    pub(super) scripts: Vec<(Algorithm, Script)>,
    pub(super) max_batch: usize,
    pub(super) in_flight: usize,
    /// How long one call may take before its requests are answered with a timeout.
    pub(super) timeout: Duration,
}

impl Batcher {
    /// Starts the sending task on the current tokio runtime; it ends when the last `Batcher`
    /// clone is dropped.
    pub(super) fn spawn(settings: Settings) -> Batcher {
        let (queue, jobs) = mpsc::unbounded_channel();
        tokio::spawn(dispatch(jobs, Arc::new(settings)));
        Batcher { queue }
    }

    /// Queues a job; gives it back if the sending task is gone (its runtime shut down).
    pub(super) fn submit(&self, job: Job) -> Result<(), Job> {
        self.queue.send(job).map_err(|e| e.0)
    }
}

async fn dispatch(mut jobs: mpsc::UnboundedReceiver<Job>, settings: Arc<Settings>) {
    let slots = Arc::new(Semaphore::new(settings.in_flight.max(1)));
    let clustered = settings.pool.next().is_clustered();
    loop {
        // Wait for a free call slot first, so that requests queue up while all are taken.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Some(first) = jobs.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < settings.max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let slot = Arc::new(slot);
        for group in groups(batch, clustered) {
            tokio::spawn(send(group, Arc::clone(&settings), Arc::clone(&slot)));
        }
    }
}

/// Splits a batch into calls: one per algorithm (each has its own script) and, in a cluster,
/// per hash slot.
fn groups(batch: Vec<Job>, clustered: bool) -> Vec<Vec<Job>> {
    let mut groups: Vec<(Algorithm, u16, Vec<Job>)> = Vec::new();
    for job in batch {
        let slot = if clustered {
            fred::util::redis_keyslot(job.key.as_bytes())
        } else {
            0
        };
        match groups
            .iter_mut()
            .find(|(a, s, _)| *a == job.algorithm && *s == slot)
        {
            Some((_, _, group)) => group.push(job),
            None => groups.push((job.algorithm, slot, vec![job])),
        }
    }
    groups.into_iter().map(|(_, _, group)| group).collect()
}

/// Sends one call and answers each of its requests.
async fn send(group: Vec<Job>, settings: Arc<Settings>, _slot: Arc<OwnedSemaphorePermit>) {
    let Some(algorithm) = group.first().map(|job| job.algorithm) else {
        return;
    };
    let Some((_, script)) = settings.scripts.iter().find(|(a, _)| *a == algorithm) else {
        let error = Error::new(ErrorKind::Unknown, "no script for this algorithm");
        return answer(group, Err(error));
    };
    let mut keys = Vec::with_capacity(group.len());
    let mut args = Vec::with_capacity(group.iter().map(|job| job.args.len()).sum());
    for job in &group {
        keys.push(job.key.clone());
        args.extend_from_slice(&job.args);
    }
    let client = settings.pool.next_connected();
    let call = script.evalsha_with_reload::<Vec<i64>, _, _>(client, keys, args);
    let reply = match tokio::time::timeout(settings.timeout, call).await {
        Ok(reply) => reply,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            "no reply within the time budget",
        )),
    };
    answer(group, reply);
}

/// Hands each request its five integers of the reply, or the error.
fn answer(group: Vec<Job>, reply: Result<Vec<i64>, Error>) {
    let reply = reply.and_then(|values| {
        if values.len() == 5 * group.len() {
            Ok(values)
        } else {
            let message = format!("{} values for {} requests", values.len(), group.len());
            Err(Error::new(ErrorKind::Parse, message))
        }
    });
    for (i, job) in group.into_iter().enumerate() {
        let result = match &reply {
            Ok(values) => {
                let mut five = [0; 5];
                five.copy_from_slice(&values[5 * i..5 * i + 5]);
                Ok(five)
            }
            Err(error) => Err(error.clone()),
        };
        // The requester may have given up (its own timeout); nothing to do then.
        let _ = job.reply.send(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(algorithm: Algorithm, key: &str) -> Job {
        Job {
            algorithm,
            key: key.to_owned(),
            args: vec![],
            reply: oneshot::channel().0,
        }
    }

    fn keys(groups: &[Vec<Job>]) -> Vec<Vec<&str>> {
        groups
            .iter()
            .map(|g| g.iter().map(|j| j.key.as_str()).collect())
            .collect()
    }

    #[test]
    fn one_call_per_algorithm_and_cluster_slot() {
        let batch = || {
            vec![
                job(Algorithm::Gcra, "p:{a}:gcra"),
                job(Algorithm::SlidingLog, "p:{a}:log"),
                job(Algorithm::Gcra, "p:{b}:gcra"),
                job(Algorithm::Gcra, "q:{a}:gcra"),
            ]
        };
        assert_eq!(
            keys(&groups(batch(), false)),
            [
                vec!["p:{a}:gcra", "p:{b}:gcra", "q:{a}:gcra"],
                vec!["p:{a}:log"]
            ]
        );
        // {a} and {b} hash to different slots; both {a} keys share one.
        assert_eq!(
            keys(&groups(batch(), true)),
            [
                vec!["p:{a}:gcra", "q:{a}:gcra"],
                vec!["p:{a}:log"],
                vec!["p:{b}:gcra"]
            ]
        );
    }
}
