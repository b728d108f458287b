//! Decisions sent to Redis together: one script call decides every request that queued while
//! the previous calls were under way.
//!
//! Each `EVALSHA` costs Redis a fixed price (reading the command, setting up the script, one
//! `TIME`) and costs the client a command's round through fred, on top of the work per key.
//! Under load, many decisions wait at once; sending them as one call pays that price once.
//! At most `in_flight` calls are under way at a time; requests that arrive meanwhile queue
//! and leave together, up to `max_batch` decisions per call (and as many concurrency slots'
//! give-backs or renewals, see [`Batch`]), as soon as a call returns. A lone request waits for
//! nothing: with a call permit free, it leaves at once in a batch of one.
//!
//! The scripts decide the requests of a batch one after the other, each exactly as a call of
//! its own would, so a batch changes no decision. In Redis Cluster, a call holds keys of one
//! hash slot only, so requests queue in one lane per hash tag (see `placement.rs`), each with
//! its own calls under way: a tag's requests wait only for that tag's calls, and its batches
//! are not split by the other tags' requests. A lane's share of the requests is small, so
//! before it sends, its task lets the requests already on their way join ([`gather`]).
//!
//! What a call's keys, arguments and reply hold is `wire/`'s; how one call is sent and
//! answered, `call.rs`'s; this file decides which requests go in which call, and when.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::types::config::Options;
use fred::types::scripts::Script;
use fred::types::{Key, Value};
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::call::{
    out_of_time, send, start, Job, Laid, Late, Redis, Requester, ScriptId, Settings, Then, Unread,
    Work,
};
use super::nodes::{self};
use crate::model::Algorithm;
use crate::store::redis::overrides::Known;
use crate::store::redis::placement::Place;
use crate::store::redis::scripts::Tier;
use crate::store::redis::wire::{self, answer, check_length, Answered, Heads, SlotOp, HEAD};

/// Sends decisions: at once while a call permit of the request's lane is free, else through
/// the lane's queue, which a task drains into batches as permits free up.
#[derive(Debug)]
pub(crate) struct Batcher {
    lanes: Vec<Lane>,
    settings: Arc<Settings>,
}

/// The queue and call permits of one hash tag (of all keys, on a single Redis): a call holds
/// one of `in_flight` permits while it is under way.
#[derive(Debug)]
struct Lane {
    queue: mpsc::UnboundedSender<Job>,
    permits: Arc<Semaphore>,
}

impl Batcher {
    /// Starts the task of each of `lanes` queues on the current tokio runtime; they end when
    /// the `Batcher` is dropped.
    pub(crate) fn spawn(lanes: usize, settings: Settings) -> Batcher {
        let settings = Arc::new(settings);
        let lanes = (0..lanes.max(1))
            .map(|lane| {
                let (queue, jobs) = mpsc::unbounded_channel();
                let permits = Arc::new(Semaphore::new(settings.in_flight.max(1)));
                tokio::spawn(dispatch(
                    lane,
                    jobs,
                    Arc::clone(&permits),
                    Arc::clone(&settings),
                ));
                Lane { queue, permits }
            })
            .collect();
        Batcher { lanes, settings }
    }

    /// Decides one request of `key` in lane `lane` with `script`: `args` encoded by
    /// [`wire::encode_for`]. When the request stops waiting before the reply comes (the budget
    /// ran out, or it went away), `late` reads the reply (see `call.rs`, "Replies after the
    /// budget"). fred's key type shares the text, so copies of it (a retry's, a second
    /// call's) cost no copy of it.
    pub(crate) async fn decide(
        &self,
        lane: usize,
        key: Key,
        script: ScriptId,
        args: Bytes,
        late: Option<Late>,
    ) -> Answered {
        let work = Work::Decide(args);
        let index = lane % self.lanes.len();
        let lane = &self.lanes[index];
        // A free permit means nothing is waiting: no batch to join, so go at once.
        if let Ok(permit) = Arc::clone(&lane.permits).try_acquire_owned() {
            // Boxed (`start`) because fred's call future takes kilobytes: inline, it would
            // make every decision's future that large, including the queued ones that never
            // send.
            let call = start(
                Arc::clone(&self.settings),
                index,
                script,
                Laid::of(key, work),
            );
            let mut unread = Unread::new(call, 1);
            // Dropped with the budget run out, or with this future, `unread` reads the reply
            // for `late`.
            unread.late.extend(late.map(|late| (0, late)));
            let reply = unread.within(&self.settings).await;
            drop(permit);
            let reply = reply.unwrap_or_else(|| Err(out_of_time()));
            return reply.map(|values| answer(&values, 1, 0));
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            script,
            key,
            work,
            reply: Requester::Waiting(reply, late),
        };
        if lane.queue.send(job).is_err() {
            return Err(Error::new(
                ErrorKind::Canceled,
                "the batching task has stopped",
            ));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Error::new(ErrorKind::Canceled, "batch dropped")))
    }

    /// Gives back or renews a concurrency slot of the key at `place`, in the calls of the
    /// policy's `algorithm` (any script takes slot operations), without a future to await:
    /// the operation joins the next call of its lane, and `then` runs with its answer in the
    /// task that sent the call (at once, with an error, if the lane's task has stopped).
    pub(crate) fn keep_then(&self, place: Place, algorithm: Algorithm, op: SlotOp, then: Then) {
        let lane = &self.lanes[place.lane % self.lanes.len()];
        let job = Job {
            script: ScriptId::full(algorithm),
            key: Key::from(place.key),
            work: Work::Slot(op),
            reply: Requester::Then(then),
        };
        if let Err(mpsc::error::SendError(job)) = lane.queue.send(job) {
            let error = Error::new(ErrorKind::Canceled, "the batching task has stopped");
            job.reply.answer(Err(error));
        }
    }
}

impl Batcher {
    /// Runs `scripts/return.lua` once for `keys` (`args`: theirs, encoded one after the other by
    /// [`wire::encode_return`]), waiting for the reply up to `patience`; in a cluster the keys
    /// must share a hash slot. A give-back whose reply is not read cannot be sent again safely (it
    /// may have run), so it is waited for as long as a lease is.
    pub(crate) async fn return_units(
        &self,
        keys: Vec<String>,
        args: Vec<u8>,
        patience: Duration,
    ) -> Result<i64, Error> {
        let keys = keys.into_iter().map(Key::from).collect();
        let argv = vec![Value::Bytes(Bytes::from(args))];
        self.evalsha_patiently(&self.settings.scripts.returns, keys, argv, patience)
            .await
    }

    /// Runs `scripts/line.lua` for the line of reservations of `key` (`args`: the operation
    /// and its arguments), waiting for the reply up to `patience`.
    pub(crate) async fn line(
        &self,
        key: String,
        args: Vec<String>,
        patience: Duration,
    ) -> Result<Vec<i64>, Error> {
        let argv = args.into_iter().map(Value::from).collect();
        self.evalsha_patiently(
            &self.settings.scripts.line,
            vec![Key::from(key)],
            argv,
            patience,
        )
        .await
    }

    /// Decides one request at `place` in a call of its own, outside the batches, and waits
    /// for Redis's reply for up to `patience` instead of the time budget. For a lease: Redis
    /// counts its units when the script runs, so its reply is worth reading however late it
    /// comes (see `lease/`). In a cluster, redirections are followed as a few at most; a
    /// hash slot that keeps moving, or keys split by a migration (`TRYAGAIN`), fail the call
    /// (nothing ran).
    ///
    /// A look, admission or lease that the plain tier decides goes there while the lane's
    /// overrides are confirmed ([`Settings::tier`]), and again to the full tier where the
    /// plain one answers [`FULL_PATH`](wire::FULL_PATH).
    pub(crate) async fn decide_patiently(
        &self,
        place: Place,
        algorithm: Algorithm,
        args: Vec<u8>,
        patience: Duration,
    ) -> Answered {
        let tier = self.settings.tier(place.lane, algorithm, &args);
        let key = Key::from(place.key);
        let (head, args) = args.split_at(HEAD.min(args.len()));
        let mut heads = Heads::with_capacity(1);
        heads.push(head, args);
        let heads = heads.bytes();
        let call = |tier| {
            let script = ScriptId { algorithm, tier };
            let (script, args, overrides) =
                (self.settings).arguments(place.lane, script, args.to_vec(), 1);
            let argv = wire::argv(args, overrides, heads.clone(), Vec::new());
            self.call_patiently(place.lane, key.clone(), script, argv, patience)
        };
        let answer = call(tier).await?;
        match tier == Tier::Plain && answer.ints[1] == wire::FULL_PATH {
            true => call(Tier::Full).await,
            false => Ok(answer),
        }
    }

    /// One call of `script` for the request of `key` in lane `lane`, with arguments `argv`,
    /// waiting up to `patience` ([`decide_patiently`](Self::decide_patiently)).
    async fn call_patiently(
        &self,
        lane: usize,
        key: Key,
        script: ScriptId,
        argv: Vec<Value>,
        patience: Duration,
    ) -> Answered {
        let sent = (script.tier == Tier::Full).then(|| self.settings.sent_now());
        let lua = self.settings.scripts.of(script.algorithm, script.tier);
        let values: Bytes = self
            .evalsha_patiently(lua, vec![key], argv, patience)
            .await?;
        check_length(&values, 1, 0)?;
        self.settings.learn(lane, &values, (1, 0), sent);
        Ok(answer(&values, 1, 0))
    }

    /// Whether plain requests go to the plain tier (`RedisStoreBuilder::plain_scripts`).
    pub(crate) fn plain(&self) -> bool {
        self.settings.plain
    }

    /// The override fields this store's calls have read (`overrides/known.rs`).
    pub(crate) fn known(&self) -> &Known {
        &self.settings.known
    }

    /// `EVALSHA` of `script` over `keys` (one hash slot) with arguments `argv`, waiting for
    /// the reply up to `patience` rather than the pool's time budget; loads the script and
    /// sends it again once if Redis lost it.
    async fn evalsha_patiently<R: fred::types::FromValue>(
        &self,
        script: &Script,
        keys: Vec<Key>,
        argv: Vec<Value>,
        patience: Duration,
    ) -> Result<R, Error> {
        let pool = match &self.settings.redis {
            Redis::Cluster(nodes) => {
                return nodes.evalsha(script, keys, argv, Some(patience)).await;
            }
            Redis::Single(pool) => pool,
        };
        let options = Options {
            timeout: Some(patience),
            ..Options::default()
        };
        let evalsha = nodes::evalsha_args(script, keys, argv);
        nodes::evalsha_on(pool.next_connected(), &options, script, evalsha, false).await
    }

    /// Runs `command`, one command on `key` (or keys of its hash slot), on the Redis that
    /// holds it: in a cluster the primary of its hash slot, following `MOVED`.
    pub(crate) async fn on<R, F, Fut>(&self, key: &str, command: F) -> Result<R, Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<R, Error>>,
    {
        match &self.settings.redis {
            Redis::Single(pool) => command(pool.next().clone()).await,
            Redis::Cluster(nodes) => {
                let hash_slot = fred::util::redis_keyslot(key.as_bytes());
                nodes.on_owner(hash_slot, command).await
            }
        }
    }

    /// Whether the calls go to a Redis Cluster.
    pub(crate) fn is_clustered(&self) -> bool {
        matches!(self.settings.redis, Redis::Cluster(_))
    }
}

async fn dispatch(
    lane: usize,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    permits: Arc<Semaphore>,
    settings: Arc<Settings>,
) {
    let clustered = matches!(settings.redis, Redis::Cluster(_));
    // A request taken from the queue that did not fit the last batch: the next one's first.
    let mut left = None;
    loop {
        // Wait for a free call permit first, so that requests queue up while all are taken.
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        let first = match left.take() {
            Some(job) => job,
            None => match jobs.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        gather(&jobs, settings.gather, settings.max_batch).await;
        let mut batch = Batch::new(settings.max_batch, jobs.len() + 1);
        batch.push(first);
        while !batch.is_full() {
            match jobs.try_recv() {
                Ok(job) if batch.fits(&job) => batch.push(job),
                Ok(job) => {
                    left = Some(job);
                    break;
                }
                Err(_) => break,
            }
        }
        let permit = Arc::new(permit);
        for group in groups(batch.jobs, clustered) {
            tokio::spawn(send(
                lane,
                group,
                Arc::clone(&settings),
                Arc::clone(&permit),
            ));
        }
    }
}

/// The requests of one call being gathered: up to `max_batch` decisions, and up to as many
/// slot operations riding with them. A give-back or renewal of a concurrency slot is a
/// command or two in Redis, a fraction of a decision; counted as a decision, the give-backs a
/// layer sends after each response would take half of every call and double the calls.
struct Batch {
    jobs: Vec<Job>,
    decisions: usize,
    slot_ops: usize,
    max_batch: usize,
}

impl Batch {
    fn new(max_batch: usize, queued: usize) -> Batch {
        Batch {
            jobs: Vec::with_capacity((2 * max_batch).min(queued)),
            decisions: 0,
            slot_ops: 0,
            max_batch,
        }
    }

    fn fits(&self, job: &Job) -> bool {
        match job.work.is_slot() {
            true => self.slot_ops < self.max_batch,
            false => self.decisions < self.max_batch,
        }
    }

    fn push(&mut self, job: Job) {
        match job.work.is_slot() {
            true => self.slot_ops += 1,
            false => self.decisions += 1,
        }
        self.jobs.push(job);
    }

    fn is_full(&self) -> bool {
        self.decisions >= self.max_batch && self.slot_ops >= self.max_batch
    }
}

/// Lets the runtime run the tasks that are ready, up to `passes` times while each pass queues
/// more requests and the batch (with the request taken already) is not full, so that a batch
/// takes the requests already on their way rather than leaving them to the next call. In a
/// Redis Cluster, each lane sees only its tags' share of the requests and has one call under
/// way, so batches are small; a call's fixed cost to Redis and to this process is then paid
/// for fewer requests. A pass lasts as long as the runtime takes to run the other ready tasks
/// (at most a few dozen polls), which counts against the decisions' time budget; with nothing
/// else ready it returns at once and ends the wait. A lone request on a free call permit never
/// comes here.
async fn gather(jobs: &mpsc::UnboundedReceiver<Job>, passes: usize, max_batch: usize) {
    for _ in 0..passes {
        let queued = jobs.len();
        if queued + 1 >= max_batch {
            return;
        }
        tokio::task::yield_now().await;
        if jobs.len() == queued {
            return;
        }
    }
}

/// Splits a batch into calls: one per script (each algorithm's of each tier) and, in a
/// cluster, per hash slot.
fn groups(batch: Vec<Job>, clustered: bool) -> Vec<Vec<Job>> {
    let hash_slot = |job: &Job| match clustered {
        true => fred::util::redis_keyslot(job.key.as_bytes()),
        false => 0,
    };
    // Usually one call takes the whole batch, which then needs no sorting out.
    if let Some(first) = batch.first() {
        let (script, first_slot) = (first.script, hash_slot(first));
        if batch
            .iter()
            .all(|job| job.script == script && hash_slot(job) == first_slot)
        {
            return vec![batch];
        }
    }
    let mut groups: Vec<(ScriptId, u16, Vec<Job>)> = Vec::new();
    for job in batch {
        let hash_slot = hash_slot(&job);
        match groups
            .iter_mut()
            .find(|(a, s, _)| *a == job.script && *s == hash_slot)
        {
            Some((_, _, group)) => group.push(job),
            None => groups.push((job.script, hash_slot, vec![job])),
        }
    }
    groups.into_iter().map(|(_, _, group)| group).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::wire::INT;

    fn job(algorithm: Algorithm, key: &str) -> Job {
        Job {
            script: ScriptId::full(algorithm),
            key: Key::from(key),
            work: Work::Decide(Bytes::new()),
            reply: Requester::Waiting(oneshot::channel().0, None),
        }
    }

    fn keys(groups: &[Vec<Job>]) -> Vec<Vec<&str>> {
        groups
            .iter()
            .map(|g| g.iter().map(|j| j.key.as_str().unwrap_or("")).collect())
            .collect()
    }

    #[test]
    fn slot_operations_ride_with_a_full_batch_of_decisions() {
        let op = |key: &str| Job {
            work: Work::Slot(SlotOp::Release { id: 1, held: 0 }),
            ..job(Algorithm::Gcra, key)
        };
        let mut batch = Batch::new(2, 10);
        for key in ["a", "b"] {
            assert!(batch.fits(&job(Algorithm::Gcra, key)));
            batch.push(job(Algorithm::Gcra, key));
        }
        // Two decisions fill it for decisions, not for give-backs.
        assert!(!batch.fits(&job(Algorithm::Gcra, "c")));
        assert!(!batch.is_full());
        for key in ["a", "b"] {
            assert!(batch.fits(&op(key)));
            batch.push(op(key));
        }
        assert!(!batch.fits(&op("c")));
        assert!(batch.is_full());
        assert_eq!(batch.jobs.len(), 4);
    }

    #[test]
    fn slot_operations_follow_the_decisions_and_answer_a_byte_each() {
        let job = |key: &str, work| Job {
            script: ScriptId::full(Algorithm::Gcra),
            key: Key::from(key),
            work,
            reply: Requester::Waiting(oneshot::channel().0, None),
        };
        let op = |key, op| job(key, Work::Slot(op));
        // Each decision's key field length, then its arguments: six integers, the policy-wide
        // field and the plan's (none).
        let decision = |key, byte: u8| {
            let fields = [7i64, 0].map(i64::to_le_bytes).concat();
            let args = [vec![byte + 10; HEAD], vec![byte; 6 * INT], fields].concat();
            job(key, Work::Decide(Bytes::from(args)))
        };
        let batch = vec![
            op("a", SlotOp::Release { id: 7, held: 40 }),
            decision("b", 1),
            op(
                "c",
                SlotOp::Renew {
                    id: 9,
                    lifetime: 500,
                },
            ),
            decision("d", 2),
        ];
        let (laid, replies) = Laid::jobs(batch);
        let keys: Vec<_> = laid.keys.iter().map(|k| k.as_str().unwrap()).collect();
        assert_eq!(keys, ["b", "d", "a", "c"]);
        let fields = [7i64, 0].map(i64::to_le_bytes).concat();
        let args = |byte| [vec![byte; 6 * INT], fields.clone()].concat();
        assert_eq!(laid.args, [args(1), args(2)].concat());
        // The two key fields' lengths, then the one policy-wide field, once.
        let heads = [
            vec![11; HEAD],
            vec![12; HEAD],
            [1i64, 7].map(i64::to_le_bytes).concat(),
        ];
        assert_eq!(laid.heads.bytes(), heads.concat());
        let ops = [7, -41, 9, 500].map(Value::Integer);
        assert_eq!(laid.ops, ops);
        assert_eq!((laid.decisions, replies.len()), (2, 4));

        // Two decisions' six integers, the time, the generation of the hash of overrides,
        // then one byte per slot operation.
        let mut values: Vec<u8> = (0..12i64).flat_map(i64::to_le_bytes).collect();
        values.extend([42i64, 5].map(i64::to_le_bytes).concat());
        values.extend(b"10");
        assert!(check_length(&values, 2, 2).is_ok());
        assert!(check_length(&values, 2, 1).is_err());
        assert!(check_length(&values, 3, 0).is_err());
        // Then the fields the call read: their number, each name and value (-1: absent).
        let mut read = values.clone();
        let int = |i: i64| i.to_le_bytes().to_vec();
        let tail = [int(2), int(1), b"k".to_vec(), int(2), b"v1".to_vec()];
        read.extend([tail.concat(), int(3), b"123".to_vec(), int(-1)].concat());
        assert!(check_length(&read, 2, 2).is_ok());
        assert!(check_length(&read[..read.len() - 1], 2, 2).is_err());
        let (generation, fields) = wire::read(&read, 2, 2);
        let fields: Vec<_> = fields.collect();
        let expected = [
            Some((&b"k"[..], Some(&b"v1"[..]))),
            Some((&b"123"[..], None)),
        ];
        assert_eq!((generation, fields), ((5, 42), expected.to_vec()));
        assert_eq!(answer(&read, 2, 2).ints[0], 1);
        let decided = answer(&values, 2, 1);
        assert_eq!((decided.ints, decided.time), ([6, 7, 8, 9, 10, 11], 42));
        let kept = answer(&values, 2, 2);
        assert_eq!((kept.ints, kept.time), ([1, 0, 0, 0, -1, -1], 42));
        assert_eq!(answer(&values, 2, 3).ints[0], 0);
    }

    #[test]
    fn a_batch_of_one_algorithm_and_hash_slot_is_one_call_in_order() {
        let batch = || {
            vec![
                job(Algorithm::Gcra, "p:{a}:gcra"),
                job(Algorithm::Gcra, "q:{a}:gcra"),
                job(Algorithm::Gcra, "p:{a}:gcra"),
            ]
        };
        let one = vec![vec!["p:{a}:gcra", "q:{a}:gcra", "p:{a}:gcra"]];
        assert_eq!(keys(&groups(batch(), false)), one);
        assert_eq!(keys(&groups(batch(), true)), one);
    }

    #[test]
    fn one_call_per_algorithm_and_hash_slot() {
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
        // {a} and {b} hash to different hash slots; both {a} keys share one.
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
