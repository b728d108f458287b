//! One call to Redis: the requests it carries laid out for a script (`wire/`, KEYS and
//! ARGV), sent within the time budget (again key by key when a hash slot's migration splits
//! its keys), and each request answered from the reply in its order.
//!
//! **Replies after the budget.** Redis runs a script however late its reply comes, so a
//! decision its requester stopped waiting for (the budget ran out, or the request went away)
//! may have recorded units that nobody accounts for. A request that asks for it ([`Late`])
//! has its reply read anyway: the call keeps waiting, up to [`LATE_PATIENCE`], in a task of
//! its own ([`Unread`]), and the reply goes to the request's `Late`, which gives back what it
//! recorded (`RedisStore::run`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::Pool;
use fred::error::{Error, ErrorKind};
use fred::types::config::Options;
use fred::types::{Key, Value};
use tokio::sync::{oneshot, OwnedSemaphorePermit};

use tokio::time::Instant;

use super::ask;
use super::nodes::{self, Nodes};
use crate::model::Algorithm;
use crate::store::redis::overrides::{Known, Limits};
use crate::store::redis::scripts::{Scripts, Tier};
use crate::store::redis::wire::{self, answer, check_length, Answered, Heads, SlotOp, HEAD};

/// Which script decides a request: its policy's algorithm's, of a tier. A call holds
/// requests of one script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScriptId {
    pub(crate) algorithm: Algorithm,
    pub(crate) tier: Tier,
}

impl ScriptId {
    /// `algorithm`'s full script, which decides every request and takes slot operations.
    pub(crate) fn full(algorithm: Algorithm) -> ScriptId {
        ScriptId {
            algorithm,
            tier: Tier::Full,
        }
    }
}

/// One request waiting for its answer.
pub(crate) struct Job {
    pub(crate) script: ScriptId,
    pub(crate) key: Key,
    pub(crate) work: Work,
    pub(crate) reply: Requester,
}

/// Who hears a request's answer.
pub(crate) enum Requester {
    /// A request awaiting it, and what reads its reply if it stops waiting.
    Waiting(oneshot::Sender<Answered>, Option<Late>),
    /// A slot operation nobody awaits: run with the answer in the task that sent the call, so
    /// that a give-back needs no task of its own.
    Then(Then),
}

/// What runs with the answer of a slot operation nobody awaits (see [`Batcher::keep_then`]).
pub(crate) type Then = Box<dyn FnOnce(Answered) + Send>;

/// What reads a decision's reply that its requester did not: the budget ran out first, or the
/// requester went away. Runs in the task that read the reply; never for a reply its requester
/// took.
pub(crate) type Late = Box<dyn FnOnce(Answered) + Send>;

/// How long a call's reply is waited for after the budget ran out, for the requests that read
/// it late ([`Late`]); a reply later than that is not read, and what it recorded stays.
pub(crate) const LATE_PATIENCE: Duration = Duration::from_secs(10);

impl Requester {
    pub(crate) fn answer(self, reply: Answered) {
        match self {
            // The requester may have given up (its own timeout): its `Late`, if any, reads it.
            Requester::Waiting(sender, late) => {
                if let (Err(reply), Some(late)) = (sender.send(reply), late) {
                    late(reply);
                }
            }
            Requester::Then(then) => then(reply),
        }
    }

    /// Takes what reads the request's reply late, for a call whose budget ran out: the
    /// requester is answered with the timeout, and the reply, when it comes, goes there.
    fn take_late(&mut self) -> Option<Late> {
        match self {
            Requester::Waiting(_, late) => late.take(),
            Requester::Then(_) => None,
        }
    }
}

/// What a request asks of a call.
#[derive(Debug, Clone)]
pub(crate) enum Work {
    /// A decision or a settlement: its override fields and arguments (see
    /// [`wire::encode_for`]); shared, so that a cluster call keeps them for a `TRYAGAIN`
    /// split without a copy.
    Decide(Bytes),
    /// A concurrency slot's give-back or renewal.
    Slot(SlotOp),
}

impl Work {
    pub(crate) fn is_slot(&self) -> bool {
        matches!(self, Work::Slot(_))
    }
}

/// Where the calls go.
pub(crate) enum Redis {
    /// A single Redis, or the primary that Sentinel names: fred's pool.
    Single(Pool),
    /// A Redis Cluster: the store's own routing, a pool per primary (see `nodes.rs`).
    Cluster(Arc<Nodes>),
}

/// What the calls need.
pub(crate) struct Settings {
    pub(crate) redis: Redis,
    /// The name of each lane's hash of overrides (`overrides/`), its calls' second
    /// argument.
    pub(crate) overrides: Vec<Value>,
    pub(crate) scripts: Scripts,
    /// The override fields the calls read, which later decisions resolve by
    /// (`overrides/known.rs`).
    pub(crate) known: Known,
    /// What the store knows of the limits version (`overrides/version.rs`): a full call
    /// confirms its lane's overrides under the version's token when it was sent.
    pub(crate) limits: Arc<Limits>,
    /// Whether plain requests go to the plain tier (`RedisStoreBuilder::plain_scripts`).
    pub(crate) plain: bool,
    pub(crate) max_batch: usize,
    /// The call permits of each lane: how many of its calls may be under way at once.
    pub(crate) in_flight: usize,
    /// How many times a lane's task lets the runtime run other ready tasks before it sends a
    /// batch, while each pass brings more requests (see [`gather`]); 0 sends at once.
    pub(crate) gather: usize,
    /// How long one call may take before its requests are answered with a timeout.
    pub(crate) timeout: Duration,
}

impl Settings {
    /// The script a call of `script` to lane `lane` runs as it is sent, and its first two
    /// arguments, for the `decisions` requests `args` holds, encoded for the full tier
    /// ([`wire::encode_for`], less their heads). For the full tier, `args` as they are and the
    /// name of the lane's hash of overrides, which it reads. For the plain tier, which reads
    /// none, their plain arguments ([`wire::plain_args`]) and the lane's confirmation now
    /// ([`Known::confirmation`]): the generation it read, which each request sent there was
    /// resolved at (one resolved at another is sent to be answered `FULL_PATH`), and the Redis
    /// time until which the plain tier decides by it (`scripts/plain.lua`). A plain call whose
    /// lane is no longer confirmed when it is sent (its requests chose the tier before they
    /// queued for a call permit) runs the full script instead: the plain one would answer every
    /// request `FULL_PATH`, and each would be sent again.
    pub(crate) fn arguments(
        &self,
        lane: usize,
        script: ScriptId,
        args: Vec<u8>,
        decisions: usize,
    ) -> (ScriptId, Bytes, Value) {
        let confirmation = match script.tier {
            Tier::Full => None,
            Tier::Plain => self.known.confirmation(lane, self.limits.token()),
        };
        let Some((generation, until)) = confirmation else {
            let overrides = self.overrides[lane % self.overrides.len()].clone();
            return (
                ScriptId::full(script.algorithm),
                Bytes::from(args),
                overrides,
            );
        };
        let mut bytes = Vec::with_capacity(2 * 8);
        bytes.extend_from_slice(&generation.to_le_bytes());
        bytes.extend_from_slice(&until.to_le_bytes());
        // The counters' plain tier is their full script (`scripts::source`).
        let args = match Scripts::has_plain(script.algorithm) {
            true => wire::plain_args(&args, decisions, generation),
            false => args,
        };
        let confirmation = Value::Bytes(Bytes::from(bytes));
        (script, Bytes::from(args), confirmation)
    }

    /// Keeps what a whole reply `values` of a call to lane `lane` read of the lane's hash of
    /// overrides; `sent`, for a full call, when it was sent and the limits version's token
    /// then ([`sent_now`](Self::sent_now)), which confirm the lane for the plain tier.
    pub(crate) fn learn(
        &self,
        lane: usize,
        values: &[u8],
        (decisions, slot_ops): (usize, usize),
        sent: Option<(Instant, u64)>,
    ) {
        let (read, fields) = wire::read(values, decisions, slot_ops);
        self.known.learn(lane, read, fields.flatten(), sent);
    }

    /// The tier of a request of lane `lane` under `algorithm` encoded as `args`
    /// ([`wire::encode_for`]): the plain one where it decides such a request
    /// ([`wire::plain_generation`]) and the overrides the request was resolved by are
    /// confirmed (`overrides/known.rs`, "The plain tier"), else the full one.
    pub(crate) fn tier(&self, lane: usize, algorithm: Algorithm, args: &[u8]) -> Tier {
        let plain = self.plain
            && Scripts::has_plain(algorithm)
            && wire::plain_generation(args).is_some_and(|generation| {
                (self.known).plain_ok_at(lane, generation, self.limits.token())
            });
        match plain {
            true => Tier::Plain,
            false => Tier::Full,
        }
    }

    /// Now and the limits version's token now, taken as a full call is sent: what its reply
    /// confirms is no older ([`learn`](Self::learn)).
    pub(crate) fn sent_now(&self) -> (Instant, u64) {
        (Instant::now(), self.limits.token())
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

/// A call's requests laid out for a script (`wire/`, KEYS and ARGV): the keys of its
/// decisions, then those of its slot operations; the decisions' arguments one after the
/// other, and apart from them what finds their override fields ([`Heads`]); each slot
/// operation's two.
pub(crate) struct Laid {
    pub(crate) keys: Vec<Key>,
    pub(crate) args: Vec<u8>,
    pub(crate) heads: Heads,
    pub(crate) ops: Vec<Value>,
    pub(crate) decisions: usize,
}

impl Laid {
    /// One request's call.
    pub(crate) fn of(key: Key, work: Work) -> Laid {
        let mut laid = Laid::with_capacity(1, 0);
        laid.push(key, work);
        laid
    }

    pub(crate) fn with_capacity(requests: usize, bytes: usize) -> Laid {
        Laid {
            keys: Vec::with_capacity(requests),
            args: Vec::with_capacity(bytes),
            heads: Heads::with_capacity(requests),
            ops: Vec::new(),
            decisions: 0,
        }
    }

    /// Adds a request; every decision must come before the first slot operation.
    pub(crate) fn push(&mut self, key: Key, work: Work) {
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
    pub(crate) fn jobs(mut jobs: Vec<Job>) -> (Laid, Vec<Requester>) {
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
pub(crate) fn deliver(reply: Result<Bytes, Error>, decisions: usize, replies: Vec<Requester>) {
    for (i, requester) in replies.into_iter().enumerate() {
        let result = match &reply {
            Ok(values) => Ok(answer(values, decisions, i)),
            Err(error) => Err(error.clone()),
        };
        requester.answer(result);
    }
}

/// Sends one call and answers each of its requests.
pub(crate) async fn send(
    lane: usize,
    mut group: Vec<Job>,
    settings: Arc<Settings>,
    _permit: Arc<OwnedSemaphorePermit>,
) {
    let Some(script) = group.first().map(|job| job.script) else {
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
    let (laid, mut replies) = Laid::jobs(group);
    let decisions = laid.decisions;
    let reply = call_reading_late(&settings, lane, script, laid, &mut replies).await;
    if let Some(kept) = kept {
        let first = &kept[0].0;
        if reply.as_ref().is_err_and(is_split) && kept.iter().any(|(key, _)| key != first) {
            let jobs = kept
                .into_iter()
                .zip(replies)
                .map(|((key, work), reply)| Job {
                    script,
                    key,
                    work,
                    reply,
                })
                .collect();
            send_by_key(&settings, lane, script, jobs).await;
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
pub(crate) async fn send_by_key(
    settings: &Arc<Settings>,
    lane: usize,
    script: ScriptId,
    jobs: Vec<Job>,
) {
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
                let (laid, mut replies) = Laid::jobs(part);
                let decisions = laid.decisions;
                let reply = call_reading_late(&settings, lane, script, laid, &mut replies).await;
                deliver(reply, decisions, replies);
            })
        })
        .collect();
    // The batch's call permit stays taken until every call has returned.
    for call in calls {
        let _ = call.await;
    }
}

/// Runs `script` for the requests `laid` out for lane `lane`, within the time budget; the reply has six integers per decision, the time, then a byte per slot
/// operation. `replies` are the requests in the reply's order: when the budget runs out,
/// those that read their reply late ([`Late`]) get it from a task that waits on for the call.
pub(crate) async fn call_reading_late(
    settings: &Arc<Settings>,
    lane: usize,
    script: ScriptId,
    laid: Laid,
    replies: &mut [Requester],
) -> Result<Bytes, Error> {
    let decisions = laid.decisions;
    let mut unread = Unread::new(start(Arc::clone(settings), lane, script, laid), decisions);
    let reply = unread.within(settings).await;
    if reply.is_none() {
        let late = replies.iter_mut().enumerate();
        unread.late = late
            .filter_map(|(i, requester)| Some((i, requester.take_late()?)))
            .collect();
    }
    reply.unwrap_or_else(|| Err(out_of_time()))
}

/// A call under way, its reply's length checked and its override fields learnt.
pub(crate) type Pending = Pin<Box<dyn Future<Output = Result<Bytes, Error>> + Send>>;

/// A call whose reply is read even when nobody waits for it any more: dropped before the reply
/// came (its budget ran out, or the request that awaited it went away), it hands the call
/// to a task of its own, which waits up to [`LATE_PATIENCE`] and gives each decision's answer
/// to its [`Late`]. Boxed, because fred's call future takes kilobytes.
pub(crate) struct Unread {
    pending: Option<Pending>,
    decisions: usize,
    /// The requests, by their place in the reply, that read their reply late.
    pub(crate) late: Vec<(usize, Late)>,
}

impl Unread {
    pub(crate) fn new(pending: Pending, decisions: usize) -> Self {
        Unread {
            pending: Some(pending),
            decisions,
            late: Vec::new(),
        }
    }

    /// The reply, if it comes within the time budget; `None` when the budget ran out first
    /// (the call is then still under way, for [`late`](Self::late)).
    pub(crate) async fn within(&mut self, settings: &Settings) -> Option<Result<Bytes, Error>> {
        let pending = self.pending.as_mut()?;
        match tokio::time::timeout(settings.timeout, pending).await {
            Ok(reply) => {
                self.pending = None;
                Some(reply)
            }
            Err(_) => {
                // The hash slot's node may be gone, its hash slots failing over to a replica.
                if let Redis::Cluster(nodes) = &settings.redis {
                    nodes.refresh_soon();
                }
                None
            }
        }
    }
}

impl Drop for Unread {
    fn drop(&mut self) {
        let late = std::mem::take(&mut self.late);
        let (Some(pending), false) = (self.pending.take(), late.is_empty()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let decisions = self.decisions;
        runtime.spawn(async move {
            let reply = match tokio::time::timeout(LATE_PATIENCE, pending).await {
                Ok(Ok(values)) => values,
                // No reply to read: what the call recorded, if it ran, stays.
                Ok(Err(_)) | Err(_) => return,
            };
            for (i, late) in late {
                late(Ok(answer(&reply, decisions, i)));
            }
        });
    }
}

/// The error of a call whose reply did not come within the time budget.
pub(crate) fn out_of_time() -> Error {
    Error::new(ErrorKind::Timeout, "no reply within the time budget")
}

/// Starts `script` for the requests `laid` out for lane `lane`, waiting for its reply up to
/// [`LATE_PATIENCE`] (the time budget is the caller's: see [`Unread`]).
pub(crate) fn start(settings: Arc<Settings>, lane: usize, script: ScriptId, laid: Laid) -> Pending {
    Box::pin(async move { run(&settings, lane, script, laid).await })
}

/// [`start`]'s call. A full call's reply confirms the lane's overrides as of its send
/// (`overrides/known.rs`, "The plain tier"); a plain call's reads none.
async fn run(settings: &Settings, lane: usize, id: ScriptId, laid: Laid) -> Result<Bytes, Error> {
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
    let (id, args, overrides) = settings.arguments(lane, id, args, decisions);
    let script = settings.scripts.of(id.algorithm, id.tier);
    let sent = (id.tier == Tier::Full).then(|| settings.sent_now());
    let argv = wire::argv(args, overrides, heads.bytes(), ops);
    // Each command waits for its reply up to the patience of a late reply, not the pool's
    // budget, so that a reply after the budget is still read (see `Unread`).
    let options = Options {
        timeout: Some(LATE_PATIENCE),
        ..Options::default()
    };
    let call = async {
        let nodes = match &settings.redis {
            // No redirections outside a cluster: nothing to keep for a second try.
            Redis::Single(pool) => {
                let evalsha = nodes::evalsha_args(script, keys, argv);
                let client = pool.next_connected();
                return nodes::evalsha_on(client, &options, script, evalsha, false).await;
            }
            Redis::Cluster(nodes) => nodes,
        };
        loop {
            let patience = Some(LATE_PATIENCE);
            let reply = nodes
                .evalsha(script, keys.clone(), argv.clone(), patience)
                .await;
            match reply {
                // The keys are split between the two nodes of a hash slot's migration, or the hash
                // slot moved on more often than one call follows: try again shortly, within the
                // time budget (and past it, for a reply read late).
                Err(error) if is_transient(&error) && (one_key || !is_split(&error)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                reply => return reply,
            }
        }
    };
    // Bounded as a whole too: a hash slot that keeps moving stops being tried.
    let values: Bytes = match tokio::time::timeout(LATE_PATIENCE, call).await {
        Ok(reply) => reply?,
        Err(_) => return Err(out_of_time()),
    };
    check_length(&values, decisions, slot_ops)?;
    settings.learn(lane, &values, (decisions, slot_ops), sent);
    Ok(values)
}

/// Whether a call that failed with `error` may succeed if sent again shortly, while a Redis
/// Cluster moves a hash slot: `TRYAGAIN` (a call's keys are split between the two nodes), or a
/// redirection left when the hash slot moved on more often than one call follows.
pub(crate) fn is_transient(error: &Error) -> bool {
    is_split(error) || ask::is_redirection(error)
}

/// Whether a call was refused because its keys are split between the two nodes of a hash
/// slot's migration.
pub(crate) fn is_split(error: &Error) -> bool {
    error.details().starts_with("TRYAGAIN")
}
