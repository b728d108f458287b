//! Decisions sent to Redis together: one script call decides every request that queued while
//! the previous calls were under way.
//!
//! Each `EVALSHA` costs Redis a fixed price (reading the command, setting up the script, one
//! `TIME`) and costs the client a command's round through fred, on top of the work per key.
//! Under load, many decisions wait at once; sending them as one call pays that price once.
//! At most `in_flight` calls are under way at a time; requests that arrive meanwhile queue
//! and leave together, up to `max_batch` per call, as soon as a call returns. A lone request
//! waits for nothing: with a call permit free, it leaves at once in a batch of one.
//!
//! The scripts decide the requests of a batch one after the other, each exactly as a call of
//! its own would, so a batch changes no decision. In Redis Cluster, a call holds keys of one
//! hash slot only, so requests queue in one lane per hash tag (see `placement.rs`), each with
//! its own calls under way: a tag's requests wait only for that tag's calls, and its batches
//! are not split by the other tags' requests. A lane's share of the requests is small, so
//! before it sends, its task lets the requests already on their way join ([`gather`]).
//!
//! What a call's keys, arguments and reply hold is `protocol.rs`'s; this file decides which
//! requests go in which call, and when.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::error::{Error, ErrorKind};
use fred::types::config::Options;
use fred::types::scripts::Script;
use fred::types::{Key, Value};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::ask;
use super::nodes::{self, Nodes};
use super::overrides::Known;
use super::placement::Place;
use super::protocol::{self, answer, check_length, Answered, Heads, Scripts, SlotOp, HEAD};
use crate::algorithm::Algorithm;

/// One request waiting for its answer.
struct Job {
    algorithm: Algorithm,
    key: Key,
    work: Work,
    reply: Requester,
}

/// Who hears a request's answer.
enum Requester {
    /// A request awaiting it.
    Waiting(oneshot::Sender<Answered>),
    /// A slot operation nobody awaits: run with the answer in the task that sent the call, so
    /// that a give-back needs no task of its own.
    Then(Then),
}

/// What runs with the answer of a slot operation nobody awaits (see [`Batcher::keep_then`]).
pub(super) type Then = Box<dyn FnOnce(Answered) + Send>;

impl Requester {
    fn answer(self, reply: Answered) {
        match self {
            // The requester may have given up (its own timeout); nothing to do then.
            Requester::Waiting(sender) => drop(sender.send(reply)),
            Requester::Then(then) => then(reply),
        }
    }
}

/// What a request asks of a call.
#[derive(Debug, Clone)]
enum Work {
    /// A decision or a settlement: its override fields and arguments (see
    /// [`protocol::encode_for`]); shared, so that a cluster call keeps them for a `TRYAGAIN`
    /// split without a copy.
    Decide(Bytes),
    /// A concurrency slot's give-back or renewal.
    Slot(SlotOp),
}

impl Work {
    fn is_slot(&self) -> bool {
        matches!(self, Work::Slot(_))
    }
}

/// Sends decisions: at once while a call permit of the request's lane is free, else through
/// the lane's queue, which a task drains into batches as permits free up.
#[derive(Debug)]
pub(super) struct Batcher {
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

/// Where the calls go.
pub(super) enum Redis {
    /// A single Redis, or the primary that Sentinel names: fred's pool.
    Single(Pool),
    /// A Redis Cluster: the store's own routing, a pool per primary (see `nodes.rs`).
    Cluster(Arc<Nodes>),
}

/// What the calls need.
pub(super) struct Settings {
    pub(super) redis: Redis,
    /// The name of each lane's hash of overrides (`overrides.rs`), its calls' second
    /// argument.
    pub(super) overrides: Vec<Value>,
    pub(super) scripts: Scripts,
    /// The override fields the calls read, which later decisions resolve by
    /// (`overrides/known.rs`).
    pub(super) known: Known,
    pub(super) max_batch: usize,
    /// The call permits of each lane: how many of its calls may be under way at once.
    pub(super) in_flight: usize,
    /// How many times a lane's task lets the runtime run other ready tasks before it sends a
    /// batch, while each pass brings more requests (see [`gather`]); 0 sends at once.
    pub(super) gather: usize,
    /// How long one call may take before its requests are answered with a timeout.
    pub(super) timeout: Duration,
}

impl Settings {
    /// The name of lane `lane`'s hash of overrides, as its calls pass it.
    fn overrides_of(&self, lane: usize) -> Value {
        self.overrides[lane % self.overrides.len()].clone()
    }

    /// Keeps what a whole reply `values` of a call to lane `lane` read of the lane's hash of
    /// overrides.
    fn learn(&self, lane: usize, values: &[u8], decisions: usize, slot_ops: usize) {
        let (generation, fields) = protocol::read(values, decisions, slot_ops);
        self.known.learn(lane, generation, fields.flatten());
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("max_batch", &self.max_batch)
            .field("in_flight", &self.in_flight)
            .field("gather", &self.gather)
            .finish_non_exhaustive()
    }
}

impl Batcher {
    /// Starts the task of each of `lanes` queues on the current tokio runtime; they end when
    /// the `Batcher` is dropped.
    pub(super) fn spawn(lanes: usize, settings: Settings) -> Batcher {
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

    /// Decides one request at `place`: `args` encoded by [`protocol::encode_for`].
    pub(super) async fn decide(
        &self,
        place: Place,
        algorithm: Algorithm,
        args: Vec<u8>,
    ) -> Answered {
        let work = Work::Decide(Bytes::from(args));
        let index = place.lane % self.lanes.len();
        let lane = &self.lanes[index];
        // fred's key type shares the text, so copies of it (a retry's) cost no copy of it.
        let key = Key::from(place.key);
        // A free permit means nothing is waiting: no batch to join, so go at once.
        if let Ok(permit) = Arc::clone(&lane.permits).try_acquire_owned() {
            // Boxed because fred's call future takes kilobytes: inline, it would make every
            // decision's future that large, including the queued ones that never send.
            let call = call(&self.settings, index, algorithm, Laid::of(key, work));
            let reply = Box::pin(call).await;
            drop(permit);
            return reply.map(|values| answer(&values, 1, 0));
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            algorithm,
            key,
            work,
            reply: Requester::Waiting(reply),
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
    pub(super) fn keep_then(&self, place: Place, algorithm: Algorithm, op: SlotOp, then: Then) {
        let lane = &self.lanes[place.lane % self.lanes.len()];
        let job = Job {
            algorithm,
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
    /// Runs `scripts/release.lua` once for `keys` (`args`: theirs, encoded one after the other by
    /// [`protocol::encode_release`]), waiting for the reply up to `patience`; in a cluster the keys
    /// must share a hash slot. A give-back whose reply is not read cannot be sent again safely (it
    /// may have run), so it is waited for as long as a lease is.
    pub(super) async fn release(
        &self,
        keys: Vec<String>,
        args: Vec<u8>,
        patience: Duration,
    ) -> Result<i64, Error> {
        let keys = keys.into_iter().map(Key::from).collect();
        let argv = vec![Value::Bytes(Bytes::from(args))];
        self.evalsha_patiently(&self.settings.scripts.release, keys, argv, patience)
            .await
    }

    /// Runs `scripts/line.lua` for the line of reservations of `key` (`args`: the operation
    /// and its argument), waiting for the reply up to `patience`.
    pub(super) async fn line(
        &self,
        key: String,
        args: [String; 3],
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
    pub(super) async fn decide_patiently(
        &self,
        place: Place,
        algorithm: Algorithm,
        args: Vec<u8>,
        patience: Duration,
    ) -> Answered {
        let script = self.settings.scripts.of(algorithm);
        let keys = vec![Key::from(place.key)];
        let overrides = self.settings.overrides_of(place.lane);
        let (head, args) = args.split_at(HEAD.min(args.len()));
        let mut heads = Heads::with_capacity(1);
        heads.push(head, args);
        let args = Bytes::copy_from_slice(args);
        let argv = protocol::argv(args, overrides, heads.bytes(), Vec::new());
        let values: Bytes = self.evalsha_patiently(script, keys, argv, patience).await?;
        check_length(&values, 1, 0)?;
        self.settings.learn(place.lane, &values, 1, 0);
        Ok(answer(&values, 1, 0))
    }

    /// The override fields this store's calls have read (`overrides/known.rs`).
    pub(super) fn known(&self) -> &Known {
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
    pub(super) async fn on<R, F, Fut>(&self, key: &str, command: F) -> Result<R, Error>
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
    pub(super) fn is_clustered(&self) -> bool {
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
    loop {
        // Wait for a free call permit first, so that requests queue up while all are taken.
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        let Some(first) = jobs.recv().await else {
            return;
        };
        gather(&jobs, settings.gather, settings.max_batch).await;
        let mut batch = Vec::with_capacity(settings.max_batch.min(jobs.len() + 1));
        batch.push(first);
        while batch.len() < settings.max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let permit = Arc::new(permit);
        for group in groups(batch, clustered) {
            tokio::spawn(send(
                lane,
                group,
                Arc::clone(&settings),
                Arc::clone(&permit),
            ));
        }
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

/// Splits a batch into calls: one per algorithm (each has its own script) and, in a cluster,
/// per hash slot.
fn groups(batch: Vec<Job>, clustered: bool) -> Vec<Vec<Job>> {
    let hash_slot = |job: &Job| match clustered {
        true => fred::util::redis_keyslot(job.key.as_bytes()),
        false => 0,
    };
    // Usually one call takes the whole batch, which then needs no sorting out.
    if let Some(first) = batch.first() {
        let (algorithm, first_slot) = (first.algorithm, hash_slot(first));
        if batch
            .iter()
            .all(|job| job.algorithm == algorithm && hash_slot(job) == first_slot)
        {
            return vec![batch];
        }
    }
    let mut groups: Vec<(Algorithm, u16, Vec<Job>)> = Vec::new();
    for job in batch {
        let hash_slot = hash_slot(&job);
        match groups
            .iter_mut()
            .find(|(a, s, _)| *a == job.algorithm && *s == hash_slot)
        {
            Some((_, _, group)) => group.push(job),
            None => groups.push((job.algorithm, hash_slot, vec![job])),
        }
    }
    groups.into_iter().map(|(_, _, group)| group).collect()
}

/// A call's requests laid out for a script (`protocol.rs`, KEYS and ARGV): the keys of its
/// decisions, then those of its slot operations; the decisions' arguments one after the
/// other, and apart from them what finds their override fields ([`Heads`]); each slot
/// operation's two.
struct Laid {
    keys: Vec<Key>,
    args: Vec<u8>,
    heads: Heads,
    ops: Vec<Value>,
    decisions: usize,
}

impl Laid {
    /// One request's call.
    fn of(key: Key, work: Work) -> Laid {
        let mut laid = Laid::with_capacity(1, 0);
        laid.push(key, work);
        laid
    }

    fn with_capacity(requests: usize, bytes: usize) -> Laid {
        Laid {
            keys: Vec::with_capacity(requests),
            args: Vec::with_capacity(bytes),
            heads: Heads::with_capacity(requests),
            ops: Vec::new(),
            decisions: 0,
        }
    }

    /// Adds a request; every decision must come before the first slot operation.
    fn push(&mut self, key: Key, work: Work) {
        self.keys.push(key);
        match work {
            Work::Decide(args) => {
                debug_assert!(self.ops.is_empty(), "a decision after a slot operation");
                let (head, args) = args.split_at(HEAD.min(args.len()));
                self.heads.push(head, args);
                self.args.extend_from_slice(args);
                self.decisions += 1;
            }
            Work::Slot(op) => self.ops.extend(op.args()),
        }
    }

    /// Lays out `jobs`, decisions first (each kind in its order); returns the requesters in
    /// the order of the reply.
    fn jobs(mut jobs: Vec<Job>) -> (Laid, Vec<Requester>) {
        // Stable: requests of one key keep their order among their kind.
        jobs.sort_by_key(|job| job.work.is_slot());
        let bytes = jobs
            .iter()
            .map(|job| match &job.work {
                Work::Decide(args) => args.len().saturating_sub(HEAD),
                Work::Slot(_) => 0,
            })
            .sum();
        let mut laid = Laid::with_capacity(jobs.len(), bytes);
        let mut replies = Vec::with_capacity(jobs.len());
        for job in jobs {
            laid.push(job.key, job.work);
            replies.push(job.reply);
        }
        (laid, replies)
    }
}

/// Answers each requester, in the order of the reply, from a call's `reply`.
fn deliver(reply: Result<Bytes, Error>, decisions: usize, replies: Vec<Requester>) {
    for (i, requester) in replies.into_iter().enumerate() {
        let result = match &reply {
            Ok(values) => Ok(answer(values, decisions, i)),
            Err(error) => Err(error.clone()),
        };
        requester.answer(result);
    }
}

/// Sends one call and answers each of its requests.
async fn send(
    lane: usize,
    mut group: Vec<Job>,
    settings: Arc<Settings>,
    _permit: Arc<OwnedSemaphorePermit>,
) {
    let Some(algorithm) = group.first().map(|job| job.algorithm) else {
        return;
    };
    // In the reply's order (`Laid::jobs`), so that the requests kept below line up with it.
    group.sort_by_key(|job| job.work.is_slot());
    // Only a cluster answers `TRYAGAIN`, which needs the requests again.
    let kept: Option<Vec<(Key, Work)>> = match settings.redis {
        Redis::Cluster(_) => Some(
            group
                .iter()
                .map(|job| (job.key.clone(), job.work.clone()))
                .collect(),
        ),
        Redis::Single(_) => None,
    };
    let (laid, replies) = Laid::jobs(group);
    let decisions = laid.decisions;
    let reply = call(&settings, lane, algorithm, laid).await;
    if let Some(kept) = kept {
        let first = &kept[0].0;
        if reply.as_ref().is_err_and(is_split) && kept.iter().any(|(key, _)| key != first) {
            let jobs = kept
                .into_iter()
                .zip(replies)
                .map(|((key, work), reply)| Job {
                    algorithm,
                    key,
                    work,
                    reply,
                })
                .collect();
            send_by_key(&settings, lane, algorithm, jobs).await;
            return;
        }
    }
    deliver(reply, decisions, replies);
}

/// Decides a call's requests again with one call per key, all under way at once, after the
/// call was refused because its keys are split between the two nodes of a hash slot's migration
/// (`TRYAGAIN`): each key is then on one node or the other, and a call of one key is never
/// refused so. Requests of different keys do not affect one another, and each key's requests
/// keep their order, so the decisions are those the whole call would have made.
async fn send_by_key(settings: &Arc<Settings>, lane: usize, algorithm: Algorithm, jobs: Vec<Job>) {
    let mut parts: Vec<Vec<Job>> = Vec::new();
    for job in jobs {
        match parts.iter_mut().find(|part| part[0].key == job.key) {
            Some(part) => part.push(job),
            None => parts.push(vec![job]),
        }
    }
    let calls: Vec<_> = parts
        .into_iter()
        .map(|part| {
            let settings = Arc::clone(settings);
            tokio::spawn(async move {
                let (laid, replies) = Laid::jobs(part);
                let decisions = laid.decisions;
                let reply = call(&settings, lane, algorithm, laid).await;
                deliver(reply, decisions, replies);
            })
        })
        .collect();
    // The batch's call permit stays taken until every call has returned.
    for call in calls {
        let _ = call.await;
    }
}

/// Runs the algorithm's script for the requests `laid` out for lane `lane`, within the time
/// budget; the reply has six integers per decision, the time, then a byte per slot
/// operation.
async fn call(
    settings: &Settings,
    lane: usize,
    algorithm: Algorithm,
    laid: Laid,
) -> Result<Bytes, Error> {
    let script = settings.scripts.of(algorithm);
    let Laid {
        keys,
        args,
        heads,
        ops,
        decisions,
    } = laid;
    let slot_ops = ops.len() / 2;
    // A call of several keys that `TRYAGAIN` refuses is split by key instead (see `send`).
    let one_key = keys.iter().all(|key| *key == keys[0]);
    let (args, heads) = (Bytes::from(args), heads.bytes());
    let argv = protocol::argv(args, settings.overrides_of(lane), heads, ops);
    let call = async {
        let nodes = match &settings.redis {
            // No redirections outside a cluster: nothing to keep for a second try.
            Redis::Single(pool) => {
                return script
                    .evalsha_with_reload(pool.next_connected(), keys, argv)
                    .await
            }
            Redis::Cluster(nodes) => nodes,
        };
        loop {
            let reply = nodes
                .evalsha(script, keys.clone(), argv.clone(), None)
                .await;
            match reply {
                // The keys are split between the two nodes of a hash slot's migration, or the hash
                // slot moved on more often than one call follows: try again shortly, within the
                // time budget.
                Err(error) if is_transient(&error) && (one_key || !is_split(&error)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                reply => return reply,
            }
        }
    };
    let values: Bytes = match tokio::time::timeout(settings.timeout, call).await {
        Ok(reply) => reply?,
        Err(_) => {
            // The hash slot's node may be gone, its hash slots failing over to a replica.
            if let Redis::Cluster(nodes) = &settings.redis {
                nodes.refresh_soon();
            }
            let error = Error::new(ErrorKind::Timeout, "no reply within the time budget");
            return Err(error);
        }
    };
    check_length(&values, decisions, slot_ops)?;
    settings.learn(lane, &values, decisions, slot_ops);
    Ok(values)
}

/// Whether a call that failed with `error` may succeed if sent again shortly, while a Redis
/// Cluster moves a hash slot: `TRYAGAIN` (a call's keys are split between the two nodes), or a
/// redirection left when the hash slot moved on more often than one call follows.
fn is_transient(error: &Error) -> bool {
    is_split(error) || ask::is_redirection(error)
}

/// Whether a call was refused because its keys are split between the two nodes of a hash
/// slot's migration.
fn is_split(error: &Error) -> bool {
    error.details().starts_with("TRYAGAIN")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::protocol::INT;

    fn job(algorithm: Algorithm, key: &str) -> Job {
        Job {
            algorithm,
            key: Key::from(key),
            work: Work::Decide(Bytes::new()),
            reply: Requester::Waiting(oneshot::channel().0),
        }
    }

    fn keys(groups: &[Vec<Job>]) -> Vec<Vec<&str>> {
        groups
            .iter()
            .map(|g| g.iter().map(|j| j.key.as_str().unwrap_or("")).collect())
            .collect()
    }

    #[test]
    fn slot_operations_follow_the_decisions_and_answer_a_byte_each() {
        let job = |key: &str, work| Job {
            algorithm: Algorithm::Gcra,
            key: Key::from(key),
            work,
            reply: Requester::Waiting(oneshot::channel().0),
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
            op("a", SlotOp::GiveBack { id: 7, held: 40 }),
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
        let (generation, fields) = protocol::read(&read, 2, 2);
        let fields: Vec<_> = fields.collect();
        let expected = [
            Some((&b"k"[..], Some(&b"v1"[..]))),
            Some((&b"123"[..], None)),
        ];
        assert_eq!((generation, fields), (5, expected.to_vec()));
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
