-- Prelude of every rate-limit script (after expiry.lua and exact.lua): the algorithm's file (gcra.lua,
-- sliding_log.lua), or common.lua's driver and then the algorithm's file (fixed and sliding
-- window), is appended to it. One call decides a batch of requests, one after the other,
-- exactly as if each were its own call, after its slot operations (give-backs and renewals of
-- concurrency slots, "Slot operations" below).
--
-- This header is the scripts' side of the wire format; src/store/redis/wire/ is the
-- store's, in the same order and with the same names (the modes, BOXED, SLOTS_FULL).
--
-- KEYS[k]   the state of request k (the algorithm's file says its format), then the state
--           key of each slot operation; in Redis Cluster all keys of one call are in one hash
--           slot
-- ARGV[1]   64-bit little-endian signed integers, for each request k in turn: n (its number
--           of limits), cost (units, >= 0), record (the request's mode, below), event time in
--           microseconds since the epoch or -1 for now (Redis TIME), the policy's override id
--           (of its identity: what count overrides must have been set for), its penalty box
--           (us; 0: none, Policy::block_for), its policy-wide override field and its plan's
--           (0: on no plan), known (the generation of the hash of overrides at which the store
--           knew the override that applies, -1: not known; see "Overrides") and the kind of
--           that override (0: none, BLOCK, COUNTS), the attempt the request is or settles (0:
--           none; see "Attempts"), the mode's own arguments, count, window
--           (microseconds) and scale (gcd of the two, GCRA's divisor) of limits 1..n,
--           shortest first, then, where the known kind is COUNTS, count and scale of limits
--           1..n. n is 0 for a policy without rate limits (a concurrency limit alone): its
--           limits admit every request and record nothing (NO_LIMITS), and each algorithm's
--           file answers so before it reads any state
-- ARGV[2]   the name of the hash of overrides of the call's hash slot
--           (src/store/redis/overrides/)
-- ARGV[3]   64-bit little-endian signed integers (wire/request.rs, Heads): for each request k in
--           turn, the length of its key's override field (the first bytes of KEYS[k]); then
--           the number of policy-wide and plan fields the requests name, and each of those once
--           (written in decimal in the hash: src/store/redis/overrides/place.rs)
-- ARGV[4..] two per slot operation j (state key KEYS[#KEYS - OPS + j]), in decimal: the
--           slot's id (a waiter's, to leave the queue), then its lifetime (us, > 0) to renew
--           it, 0 for the waiter to leave the queue, or -(held + 1) to give it back after it
--           was held `held` us (0: not known)
--
-- Modes (record; wire/request.rs, Mode), with the arguments that follow the first eleven:
--   LOOK   0  decide only, recording nothing; want (the cost) and headroom (us: how late a
--             leasing store may spend a unit after Redis recorded it; GCRA keeps that much
--             drain free in every bucket, the sliding log reads every window that much longer,
--             and a look reports against the same room; 0 for the counters and without leases)
--   ADMIT  1  decide, and record an admitted request
--   LEASE  2  decide, and record as many units as fit now (see Leases); want (the most units
--             to take, >= cost) and headroom
--   SETTLE 3  a settlement (see Settlements): refund (0: add `cost` units, 1: take them back),
--             the admission time (Redis time, us, of the request being settled; -1: not
--             known), the units that request recorded, headroom (the sliding log's, so
--             that its reply reads the windows a leasing store decides by; 0 otherwise), and
--             when its units start draining (-1: at admission; gcra.lua)
--   TAKE   4  decide as ADMIT, and take a concurrency slot when admitted (see Concurrency);
--             the key's cap of slots, the slot's id, its lifetime (us), the waiter's id (0:
--             the request does not wait), its wait (us), whether it is queued (0 or 1), and
--             headroom (the sliding log's; 0 otherwise)
--   RESERVE 5 the earliest turn at or after every reservation before and the key's pause,
--             within the most it may wait (us), recorded, and the reservation put in its key's
--             line (`join_line`); answered admitted with the turn (us from now) as
--             retry_after, or refused with the turn it would have had (GCRA and the sliding
--             log only; src/model/turn.rs); the wait, headroom (as for a look; read as the
--             longest late of the key's recent reservations, `longest_late`), and the
--             reservation's id and notice (us; line.lua)
--
-- Range: counts are at most 2^50, windows at most ten years, times below 2^53 us (the year
-- 2255), and every state saturates at MAX_UNITS (2^52) units, so that every number the
-- scripts compute stays below 2^53, where Lua's doubles are exact (src/policy/ checks the
-- limits; docs/operations.md, "Range").
--
-- Reply: one string of 64-bit little-endian signed integers, six per request in turn:
--        allowed (0 when refused; when admitted, 1 plus the units leased beyond the cost),
--        limit index (0-based), remaining, reset_after (us), retry_after (us; -1 when
--        admitted, -2 when no wait helps), and the count of the reported limit when an
--        override set it (0 for a block; -1: the request's own); then, once per call, Redis
--        TIME in us, and the generation of the hash of overrides (see "Overrides"); then one
--        byte per slot operation, '1' where the slot was held, else '0'. Two limit
--        indexes are no limit's: BOXED (-1), a request refused by its penalty box, answers
--        0 BOXED 0 left left count (left: us until the same request would be admitted, see
--        "Penalty box"; count: the first limit's when an override set it, else -1);
--        SLOTS_FULL (-2), a request refused for its concurrency slots, answers
--        0 SLOTS_FULL place left hold cap (place: the waiter's deadline in the queue, Redis
--        time in us, 0 for a request that does not wait; left: us until the first slot
--        expires; hold: the key's typical hold time in us, -1 while none is known). A
--        settlement's six are those of an admitted request: remaining and reset_after after
--        it (a refund on the sliding log answers 1 0 0 0 -1 -1). After the slot operations'
--        bytes, where the call read override fields: their number, then for each the length
--        of its name, the name, the length of its value (-1: absent) and the value (the
--        integers 64-bit little-endian); the generation (after TIME) is -1 where Redis
--        refused to read the hash
--
-- Overrides (src/store/overrides.rs, Scope): a request other than a settlement is decided by
-- the first of these fields that holds a block or counts set for its policy's identity: its
-- key's, its plan's, its policy-wide one; else by its own counts. All the call's fields are
-- read with one HMGET, when the first request needs them. The hash is in the hash slot of the
-- call's keys but is not one of them: while a hash slot migrates, Redis refuses (TRYAGAIN) a
-- call whose keys are not all on one node, and the hash usually does not exist at all. It is
-- read with pcall: where Redis refuses the read (the hash on the other node of a migration),
-- the call decides by the requests' own counts. An override's value (overrides/value.rs) is
-- 64-bit little-endian integers: its kind (BLOCK -1, COUNTS -2; other values, an earlier
-- version's, are skipped), the override id its counts were set for (0 for a block), m (0 for
-- a block), then count and scale of limits 1..m (the policy's windows; 0 and 0 for a window
-- the override leaves out, which keeps the request's own count): counts set for
-- another identity (another algorithm or other windows) or another m are skipped; a block
-- refuses the request, no wait helps. Settlements go by the counts decisions go by (an
-- override's where one applies, as the memory store's do), so that the answer of a charge,
-- and the penalty box it may set, say whether the key is full under those counts; a block
-- does not stop a settlement. GCRA state written under other counts is reweighed (exact.lua).
--
-- The hash's generation, its field '' (override_write.lua writes it with every change and
-- deletes the hash with its last override), is read first (HLEN, then HGET where the hash
-- exists): 0 where there is no hash. A hash without one (restored in part, or edited by hand)
-- is read in every call. A request whose `known` is
-- that generation carries the override that applies, which the store read in an earlier call
-- (src/store/redis/overrides/known.rs): the hash has not changed since, so it is used as it
-- comes and no field is read for it. Other requests read the fields as above, and the reply
-- returns every field read, so that the store knows them for the next requests.
--
-- Penalty box (Policy::block_for): a key that hits its limit is refused for at least the
-- box's length, and until its limits admit it again; the refusal's retry is the later of the
-- two. The box is the string `<KEYS[k]>:box` (same hash slot: the key's hash tag), whose
-- value is the Redis time (us) its length ends. A request refused by a limit (ADMIT or LEASE,
-- a wait that helps), or a charge that leaves the key no unit (SETTLE), sets it, in the same
-- call, only where there is none (SET NX): requests refused by the box, and charges, never
-- extend it. It is kept (PX) at least as long as the key's state, and holds until then:
--   before its end, a request (other than a settlement) is looked at (LOOK: the limits
--     decide it, recording nothing, and it takes no concurrency slot) and answered
--     0 BOXED 0 left left count, left = max(end - now, the limits' retry), or the limits'
--     refusal when no wait helps (-2);
--   after its end, requests are decided by the limits again; a refusal that a wait helps is
--     answered BOXED with the limits' retry, and sets no new box; the first admission that
--     records (ADMIT or LEASE) deletes it, and the key's next refusal sets a new one.
-- The refusal that sets it answers BOXED with left = max(the box's length, the limits'
-- retry). A LOOK never sets it nor deletes it. A box an earlier version set (value '1', no
-- end) lasts until it expires. Read only for policies with a box, with pcall: while an
-- operator migrates the key's hash slot, a box Redis refuses to read or write here is taken
-- as none.
--
-- Attempts (src/model/attempts.rs): a request of a policy that counts by outcome (count_when)
-- carries its attempt id; admitted (ADMIT, LEASE, TAKE), it is in flight until its outcome is
-- settled: the member `<id>:<cost>` of the sorted set `<KEYS[k]>:tries` (same hash slot),
-- scored by its admission time (Redis time, us); it counts as in flight ATTEMPT_KEPT, and the
-- set lives that long past its last. Refused by its limits (a wait helps) out of any box, it
-- is BUSY when it would be admitted were the attempts in flight given back as their refunds
-- would give them back (each algorithm's `fits_without`; src/model/key_state.rs,
-- `fits_without_attempts`): answered allowed -1, its retry at most BUSY_RETRY, and it sets
-- no penalty box. A SETTLE that carries
-- an attempt takes it out of the set; one of 0 units (its outcome counts, the units stay)
-- does nothing else and answers 1 0 0 0 -1 -1.
--
-- Settlements (Store::settle, `settle` in src/model/mod.rs) decide nothing: a charge
-- records `cost` units now as an admitted request would, past the limits if need be; a refund
-- takes up to `cost` units back from the state the settled request was counted in (each
-- algorithm's file says how).
--
-- Leases (src/store/redis/lease/): an admitted lease records as many units as fit in every
-- limit now, up to `want`, instead of `cost`, so that an instance can admit the extra units
-- itself later; the reply's remaining counts after them.
--
-- Limits combine as `decide` in src/model/mod.rs: a refused request reports the limit that
-- refuses with the latest retry (`later`), an admitted one the limit with the fewest units left
-- (the first of equals; limits come shortest first).
--
-- Cost: arguments and reply are binary because Redis would otherwise parse and convert every
-- number on its own, and numbers handed to redis.call go as text made once per call (`text`),
-- because Redis prints every Lua number it receives with "%.17g", which costs more than the
-- command itself.

if redis.replicate_commands then
  redis.replicate_commands()
end

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local spack, sunpack = struct.pack, struct.unpack
-- The arguments, read from next_byte on, and the answers so far (one string per request).
local requests, next_byte = ARGV[1], 1
local reply = {}
-- The modes of a request (the header's "Modes"; wire/request.rs, Mode).
local LOOK, ADMIT, LEASE, SETTLE, TAKE, RESERVE = 0, 1, 2, 3, 4, 5
-- The limit indexes of the refusals that no limit makes (the header's "Reply").
local BOXED, SLOTS_FULL = -1, -2

-- The call's slot operations (two arguments each after the requests' override fields) and
-- requests.
local OPS = math.max(0, math.floor((#ARGV - 3) / 2))
local REQUESTS = #KEYS - OPS
-- The hash of overrides of the call's hash slot and its generation (see "Overrides"; -1 where
-- Redis refused the read): its fields are read only where it holds overrides, so that a store
-- without overrides pays one HLEN per call.
local OVERRIDES = ARGV[2]
local generation, any_override = 0, false
-- One command where there is no hash (the store without overrides), two where there is.
local fields_held = OVERRIDES ~= nil and redis.pcall('HLEN', OVERRIDES)
if type(fields_held) == 'table' then
  generation = -1
elseif fields_held and fields_held > 0 then
  local got = redis.pcall('HGET', OVERRIDES, '')
  if type(got) == 'string' then
    generation = tonumber(got) or -1
    any_override = generation > 0
  elseif type(got) == 'table' then
    generation = -1
  else
    -- A hash without a generation (restored in part, or edited by hand): its fields are
    -- read in every call, and the reply teaches the store nothing.
    generation, any_override = -1, true
  end
end
-- Whether the request at hand is decided by an override's counts (the last of its six
-- integers is then the count of the reported limit, `counts[i]`; else -1).
local overridden = false
-- How much longer than its longest window a GCRA state decided under an override's counts is
-- kept (gcra.lua): the largest ratio of an override's count to the policy's own, num / den, at
-- least 1. A backlog holds units of cost, which weigh that much more once the override is
-- removed (src/model/key_state.rs, Stretch).
local stretch_num, stretch_den = 1, 1
-- The call's override fields and their values (false: none), read with one HMGET when the
-- first request needs them: request k's key's at k, then the policy-wide and plan fields,
-- whose index there `field_at` gives by their number.
local fields, found, field_at = {}, nil, {}
-- The kinds of an override's value, and of a known override when none applies (see
-- "Overrides").
local BLOCK, COUNTS, NONE = -1, -2, 0
-- The answer to a blocked request: refused at a limit of 0, no wait helps.
local BLOCKED = spack('<llllll', 0, 0, 0, 0, -2, 0)
-- The penalty box of the request at hand (see the header): its length in ms and in us (0:
-- the policy has none); the request's record and refund, which say whether its answer sets
-- the box; the end of the box it is in (Redis time, us; 0: none), or whether a box holds
-- past its end; and the count its BOXED answer reports (-1: the request's own).
local box_ms, box_us, box_record, box_refund = 0, 0, 0, 0
local box_end, box_held, box_count = 0, false, -1
-- The attempt the request at hand is or settles (see "Attempts"; 0: none) and its cost; how
-- long an attempt counts as in flight, and the longest a BUSY refusal's retry (us).
local attempt_id, attempt_cost = 0, 0
-- A SETTLE's time its units start draining (us; -1: at its admission), read by gcra.lua: a
-- single-limit GCRA attempt's units drain after those ahead of them in the bucket.
local drains_from = -1
local ATTEMPT_KEPT, BUSY_RETRY = 60000000, 1000000
-- Set by the algorithm's file for the request at hand, when it is an attempt: whether the
-- request fits every limit with the given attempts in flight ({at, units} each) given back
-- as refunds would give them back (see "Attempts").
local fits_without = nil
-- The answer to a settlement that changes no units (see "Attempts").
local SETTLED = spack('<llllll', 1, 0, 0, 0, -1, -1)
-- Whether the request at hand is decided at an event time of its own (not now).
local event_time = false

-- The largest count (2^50, Limit::MAX_COUNT) and the longest window (3650 days in us,
-- Limit::MAX_WINDOW): a request past those is an error, never decided inexactly. (The most
-- units a state holds, MAX_UNITS, is in exact.lua.)
local MAX_COUNT, MAX_WINDOW = 1125899906842624, 315360000000000

-- The override that governs request k, of a policy with override id `id`, n limits, and the
-- policy-wide field `all` and plan field `plan` (0: on no plan): its value and the byte its
-- counts start at (0 for a block), or false. The first request that asks reads the values of
-- every request's override fields (see "Overrides") with one HMGET: the keys' first, one per
-- request (field k), then the policy-wide and plan fields. One function, not three: each
-- function of the script is made anew by every call.
local function override_of(k, id, n, all, plan)
  if found == nil then
    local heads, ssub = ARGV[3], string.sub
    local ints = {sunpack('<' .. string.rep('l', REQUESTS + 1), heads)}
    for r = 1, REQUESTS do
      local key, keep = KEYS[r], ints[r]
      if keep < #key then
        key = ssub(key, 1, keep)
      end
      fields[r] = key
    end
    local at = ints[REQUESTS + 2]
    for j = REQUESTS + 1, REQUESTS + ints[REQUESTS + 1] do
      local field
      field, at = sunpack('<l', heads, at)
      fields[j], field_at[field] = text(field), j
    end
    local got = redis.pcall('HMGET', OVERRIDES, unpack(fields))
    if got.err ~= nil then
      fields, got = {}, {}
    end
    found = got
  end
  -- The key's field, the plan's, the policy-wide one: the first that holds a block, or counts
  -- set for this override id and number of limits.
  local i = k
  for level = 1, 3 do
    if level == 2 then
      i = plan ~= 0 and field_at[plan]
    elseif level == 3 then
      i = field_at[all]
    end
    local value = i and found[i]
    if value and #value >= 24 then
      local kind, set_for, m, at = sunpack('<lll', value)
      if kind == BLOCK then
        return value, 0
      end
      if kind == COUNTS and set_for == id and m == n then
        return value, at
      end
    end
  end
  return false
end

-- Concurrency (Policy::concurrency, src/model/slots.rs): the slots of request k's key are the
-- members of the sorted set `<KEYS[k]>:slots` (same hash slot), each scored by its expiry
-- (Redis time, us); an expired one counts no more and goes at the next look. The same set
-- holds the key's queue of waiters (requests that wait for a slot, `max_wait`): member 'w' and
-- the waiter's id, scored QUEUE plus its deadline, above every slot's score, so that the queue
-- sorts by deadline after the slots. A request is admitted only where the live slots and the
-- waiters ahead of it (all of them, for one not queued) leave a slot free, so that a slot
-- given back goes to the first waiter on any instance rather than to whoever asks first; a
-- waiter refused joins the queue, unless it asks as one in it (see slots_full), and leaves it
-- when admitted, or by a slot operation when it stops waiting; one past its deadline counts
-- no more. The key's typical hold time is the
-- string `<KEYS[k]>:held` (us): each give-back that says how long its slot was held moves it
-- an eighth of the way there (src/model/slots.rs, hold_average), kept an hour.
-- The request at hand's cap (0: it takes no slot), slot id and slot lifetime (us), and its
-- waiter's id (0: none), wait (us) and whether it is queued.
local slot_cap, slot_id, slot_ttl = 0, 0, 0
local waiter_id, waiter_wait, waiter_queued = 0, 0, 0
-- The request at hand's most wait for its turn, when a reservation (RESERVE; us), its id and
-- its notice (us).
local reserve_wait, reserve_id, reserve_notice = 0, 0, 0
local QUEUE = 4000000000000000
local HOLD_KEPT_MS = 3600000
-- The members (live or not) of the request's key's set when it was looked at, for `take_slot`.
local slot_held = 0
-- Makes the set of slots `skey` live at least `us` from now, never shorter: instances with
-- another lifetime (a rolling deploy) must not expire each other's. Extended to twice that
-- once less is left, so that most takes and renewals read the time left and write nothing.
local function keep_set(skey, fresh, us)
  local ms = math.ceil(us / 1000)
  local left = fresh and -1 or redis.pcall('PTTL', skey)
  if type(left) == 'number' and left < ms then
    redis.pcall('PEXPIRE', skey, text(2 * ms))
  end
end
-- The answer to a request refused for a slot: 0 -2 place left hold cap (see the header).
local function refused_slot(k, skey, live, place)
  local left = 1000
  if live > 0 then
    local first = redis.call('ZRANGE', skey, 0, 0, 'WITHSCORES')
    left = math.max(tonumber(first[2]) - now, 1)
  end
  local hold = tonumber(redis.pcall('GET', KEYS[k] .. ':held')) or -1
  return spack('<llllll', 0, SLOTS_FULL, place, left, hold, slot_cap)
end
-- The answer to request k when the key has no slot free for it (see above), else false. A
-- waiter refused joins the queue.
local function slots_full(k)
  local skey = KEYS[k] .. ':slots'
  -- With pcall, as the box: while the key's hash slot migrates, a set Redis refuses to read
  -- here cannot be counted, and the request is refused rather than admitted past the cap.
  local held = redis.pcall('ZCARD', skey)
  if type(held) ~= 'number' then
    return spack('<llllll', 0, SLOTS_FULL, 0, 1000000, -1, slot_cap)
  end
  -- Fewer members than the cap: a slot is free whatever the queue. Expired slots and waiters
  -- past their deadline still count in `held`: they are dropped only when they could matter.
  slot_held = held
  if held < slot_cap then
    return false
  end
  held = held - redis.call('ZREMRANGEBYSCORE', skey, '-inf', text(now))
  held = held - redis.call('ZREMRANGEBYSCORE', skey, text(QUEUE), text(QUEUE + now))
  slot_held = held
  if held < slot_cap then
    return false
  end
  local live = redis.call('ZCOUNT', skey, '-inf', '(' .. text(QUEUE))
  local ahead, member = held - live, nil
  if waiter_id > 0 then
    member = 'w' .. text(waiter_id)
    local rank = redis.call('ZRANK', skey, member)
    if rank then
      ahead = rank - live
    end
  end
  if live + ahead < slot_cap then
    return false
  end
  -- A waiter that asks as one queued and is not in the queue has left it (its client went away
  -- while this ask was on its way, and its leave ran first) or lost it (a restart): it is not
  -- put back, and its place of 0 tells its instance, which asks again as a newcomer if it
  -- still waits (src/admission/wait.rs).
  local place = 0
  if member then
    local score = redis.call('ZSCORE', skey, member)
    if score then
      place = tonumber(score) - QUEUE
    elseif waiter_queued == 0 then
      place = now + math.max(waiter_wait, 1)
      redis.call('ZADD', skey, text(QUEUE + place), member)
      keep_set(skey, false, math.max(slot_ttl, place - now))
    end
  end
  return refused_slot(k, skey, live, place)
end
-- Takes the slot of admitted request k: until now + its lifetime, the set living as long (a
-- set that held nothing is new: the last give-back deleted it, so it has no expiry to read).
-- A waiter queued leaves the queue.
local function take_slot(k)
  local skey = KEYS[k] .. ':slots'
  redis.pcall('ZADD', skey, text(now + slot_ttl), text(slot_id))
  if waiter_queued == 1 then
    redis.pcall('ZREM', skey, 'w' .. text(waiter_id))
  end
  keep_set(skey, slot_held == 0, slot_ttl)
end
-- Slot operations (give-backs, renewals, waiters leaving the queue): they decide nothing, so
-- they are not requests with a record and an answer of six, only two arguments each, used as
-- they come, and a byte of answer. They run before the requests: a slot given back in a call
-- is free for a request of the same call. A give-back removes the slot and counts how long it
-- was held towards the key's typical hold time; a renewal moves its expiry to now + lifetime,
-- but never takes an expired slot again (its holder was cut off from Redis longer than the
-- lifetime, or Redis lost its state): a give-back sent while the renewal was on its way may
-- have run first, and would then be undone.
local slots_kept = {}
for j = 1, OPS do
  local key = KEYS[REQUESTS + j]
  local skey = key .. ':slots'
  local member, what = ARGV[2 + 2 * j], tonumber(ARGV[3 + 2 * j])
  local kept = '0'
  if what <= 0 then
    if what == 0 then
      member = 'w' .. member
    end
    if redis.pcall('ZREM', skey, member) == 1 then
      kept = '1'
    end
    local held = -what - 1
    if held > 0 then
      local hkey = key .. ':held'
      local old = tonumber(redis.pcall('GET', hkey)) or 0
      if old > 0 then
        held = math.floor((old * 7 + held) / 8)
      end
      redis.pcall('SET', hkey, text(math.max(held, 1)), 'PX', HOLD_KEPT_MS)
    end
  else
    local score = redis.pcall('ZSCORE', skey, member)
    if type(score) == 'string' and tonumber(score) > now then
      kept = '1'
      slot_ttl = what
      redis.pcall('ZADD', skey, 'XX', text(now + what), member)
      keep_set(skey, false, what)
    end
  end
  slots_kept[j] = kept
end

-- When request k's penalty box ends (Redis time, us): -1 when the key has none; in the past
-- when its end has passed but it still holds (see the header). With pcall, as the overrides:
-- while its hash slot migrates, Redis refuses a key missing here.
local function box_end_of(k)
  local bkey = KEYS[k] .. ':box'
  local got = redis.pcall('GET', bkey)
  if type(got) ~= 'string' then
    return -1
  end
  local ends = tonumber(got)
  if ends == nil or ends < 2 then
    -- An earlier version's box ('1'): until it expires.
    local left = redis.pcall('PTTL', bkey)
    if type(left) ~= 'number' or left <= 0 then
      return -1
    end
    return now + left * 1000
  end
  return ends
end

-- Reads the next request's arguments, request k's: returns its number of limits n, cost, mode
-- (LOOK to SETTLE; TAKE is decided as ADMIT), event time (now for -1), want (the cost unless
-- a lease or a look), headroom (0 for an admission), refund (0 unless a settlement),
-- admission time (-1 unless a settlement), the units the settled request recorded, and its
-- answer when an override blocks it or the key is in its penalty box (else false); puts each
-- limit's count (an override's, if one applies), window and scale in `counts[i]`,
-- `windows[i]` and `scales[i]` (entries past n are left over from an earlier request and
-- never read; `scales` may be nil), and sets `overridden`.
-- The line of reservations (line.lua, whose header names its keys; src/model/line.rs): a
-- reservation joins its key's line at its end, as `<id>:<cost>` scored by the next sequence
-- number, and its turn `at` (Redis time, us) joins the places, labelled by that number (16
-- digits); its notice joins the notices, its cost the costs. Reservations whose places are
-- LINE_KEPT past go first, as does one of the same member already in line (with its own
-- place); the keys live that long past the last turn. A turn before the last place in line
-- (counts raised by an override, another `late`) is put off to it, so that the new place is
-- the last, as the new reservation's rank is: its units, recorded earlier, are used later,
-- which keeps every limit (src/model/line.rs, Line::join). Returns the turn (us), put off or
-- not.
local LINE_KEPT = 10000000
local function line_keys(key)
  return key .. ':line', key .. ':places', key .. ':notices', key .. ':costs'
end
-- Takes the reservations of ranks `from` to `to` out of the line of `key`, with their places.
local function line_out(key, from, to)
  local line, places, notices, costs = line_keys(key)
  local gone = redis.call('ZRANGE', line, from, to)
  redis.call('ZREMRANGEBYRANK', line, from, to)
  redis.call('ZREMRANGEBYRANK', places, from, to)
  for _, member in ipairs(gone) do
    local cost = string.match(member, ':(%d+)$')
    redis.call('ZREM', notices, member)
    if redis.call('HINCRBY', costs, cost, -1) <= 0 then
      redis.call('HDEL', costs, cost)
    end
  end
end
local function join_line(key, at, cost)
  local line, places, notices, costs = line_keys(key)
  local stale = redis.call('ZCOUNT', places, '-inf', text(now - LINE_KEPT))
  if stale > 0 then
    line_out(key, 0, stale - 1)
  end
  local member = text(reserve_id) .. ':' .. text(cost)
  local rank = redis.call('ZRANK', line, member)
  if rank then
    line_out(key, rank, rank)
  end
  local last = redis.call('ZRANGE', places, -1, -1, 'WITHSCORES')
  at = math.max(at, tonumber(last[2] or '0'))
  local newest = redis.call('ZRANGE', line, -1, -1, 'WITHSCORES')
  local seq = tonumber(newest[2] or '0') + 1
  redis.call('ZADD', line, text(seq), member)
  redis.call('ZADD', places, text(at), string.format('%016d', seq))
  redis.call('ZADD', notices, text(reserve_notice), member)
  redis.call('HINCRBY', costs, text(cost), 1)
  local ms = math.ceil((at - now + LINE_KEPT) / 1000)
  for _, kept in ipairs({line, places, notices, costs}) do
    if redis.call('PTTL', kept) < ms then
      redis.call('PEXPIRE', kept, text(ms))
    end
  end
  return at
end
-- How late (us) a reservation of key k with its own `late` (its headroom) reads the key's
-- windows: the longest late of the key's recent reservations, its own included
-- (src/model/line.rs, Line::late), kept in the string `<KEYS[k]>:late` (us). Its own is
-- written when it is at least the one kept, expiring `kept` (its wait plus the longest
-- window, us) plus its late from now, or later where the one kept expired later.
local function longest_late(k, late, kept)
  local key = KEYS[k] .. ':late'
  local longest = tonumber(redis.call('GET', key) or '0')
  if late >= longest and late > 0 then
    local ms = math.max(math.ceil((kept + late) / 1000), redis.call('PTTL', key))
    redis.call('SET', key, text(late), 'PX', text(ms))
  end
  return math.max(late, longest)
end
local function next_request(counts, windows, scales, k)
  local n, cost, record, t, id, box, all, plan, known, kind
  local want, headroom, refund, admitted, weight
  n, cost, record, t, id, box, all, plan, known, kind, attempt_id, next_byte =
    sunpack('<lllllllllll', requests, next_byte)
  attempt_cost = cost
  -- An event time (Store::check_at) is decided by the limits alone: no penalty box refuses
  -- it, and its refusal sets none (that box is the requests' of now).
  event_time = t >= 0
  if t < 0 then
    t = now
  elseif record ~= RESERVE then
    box = 0
  end
  want, headroom, refund, admitted, weight = cost, 0, 0, -1, 0
  slot_cap, waiter_id, waiter_queued, reserve_wait = 0, 0, 0, 0
  if record == LEASE or record == LOOK then
    want, headroom, next_byte = sunpack('<ll', requests, next_byte)
  elseif record == SETTLE then
    refund, admitted, weight, headroom, drains_from, next_byte =
      sunpack('<lllll', requests, next_byte)
    if attempt_id > 0 then
      redis.call('ZREM', KEYS[k] .. ':tries', text(attempt_id) .. ':' .. text(weight))
    end
  elseif record == TAKE then
    slot_cap, slot_id, slot_ttl, waiter_id, waiter_wait, waiter_queued, headroom, next_byte =
      sunpack('<lllllll', requests, next_byte)
  elseif record == RESERVE then
    reserve_wait, headroom, reserve_id, reserve_notice, next_byte =
      sunpack('<llll', requests, next_byte)
    -- Made as if asked at the end of the key's pause (line.lua), so that GCRA's bucket
    -- drains from there and the log places it after.
    local pause = redis.call('GET', KEYS[k] .. ':pause')
    if pause then
      t = math.max(t, tonumber(pause))
    end
  end
  local scale
  for i = 1, n do
    counts[i], windows[i], scale, next_byte = sunpack('<lll', requests, next_byte)
    if counts[i] > MAX_COUNT or windows[i] > MAX_WINDOW or counts[i] < 1 or windows[i] < 1 then
      error('limit out of range: ' .. counts[i] .. ' per ' .. windows[i] .. ' us')
    end
    if scales then
      scales[i] = scale
    end
  end
  if record == RESERVE then
    local longest = 0
    for i = 1, n do
      longest = math.max(longest, windows[i])
    end
    headroom = longest_late(k, headroom, reserve_wait + longest)
  end
  if record == TAKE then
    -- Decided as ADMIT; the slot is taken in `conclude` if the request is admitted.
    record = ADMIT
  end
  overridden, stretch_num, stretch_den = false, 1, 1
  local blocked = false
  box_ms, box_us, box_record, box_refund = 0, box, record, refund
  box_end, box_held, box_count = 0, false, -1
  if box > 0 then
    box_ms = math.ceil(box / 1000)
  end
  -- The override the store knew (see "Overrides"), used where the hash is at the generation
  -- it was read at; else the one the hash holds. `from` and `at`: where the override's counts
  -- are (the arguments, or the value read), if counts decide.
  local trusted, from, at = known >= 0 and known == generation, false, 0
  if kind == COUNTS then
    from, at = requests, next_byte
    next_byte = next_byte + 16 * n
  end
  if not trusted then
    kind, from = NONE, false
    if any_override then
      local value
      value, at = override_of(k, id, n, all, plan)
      if value and at == 0 then
        kind = BLOCK
      elseif value then
        kind, from = COUNTS, value
      end
    end
  end
  if kind == BLOCK then
    -- A settlement records what was used whatever the limits say, a block's included.
    if record ~= SETTLE then
      blocked = BLOCKED
    end
  elseif from then
    overridden = true
    stretch_num, stretch_den = 1, 1
    for i = 1, n do
      local count
      count, scale, at = sunpack('<ll', from, at)
      -- 0: a window the override leaves out, which keeps the request's own count.
      if count > 0 then
        if count * stretch_den > stretch_num * counts[i] then
          stretch_num, stretch_den = count, counts[i]
        end
        counts[i] = count
        if scales then
          scales[i] = scale
        end
      end
    end
  end
  -- The penalty box, after the overrides (a block answers as a block, and the box's look
  -- is decided by the override's counts), as the memory store.
  if box > 0 and record ~= SETTLE and not blocked then
    if overridden then
      box_count = counts[1]
    end
    local ends = box_end_of(k)
    if ends > now then
      -- In the box: looked at, never recorded, taking no slot (`penalize` answers it).
      box_end, record, slot_cap = ends, LOOK, 0
    elseif ends >= 0 then
      box_held = true
    end
  end
  -- The slots, last: a blocked or boxed key answers as such.
  if slot_cap > 0 and not blocked then
    blocked = slots_full(k)
  end
  -- An attempt's outcome that counts: taken out of those in flight above, nothing else.
  if record == SETTLE and attempt_id > 0 and cost == 0 then
    blocked = SETTLED
  end
  return n, cost, record, t, want, headroom, refund, admitted, weight, blocked
end

-- The answer to a request of a policy without rate limits (a concurrency limit alone): admitted
-- by its limits, having recorded nothing (the slot, if it takes one, is `conclude`'s).
local NO_LIMITS = spack('<llllll', 1, 0, 0, 0, -1, -1)

-- The answer to a request refused by its penalty box, `left` us before it would be admitted.
local function boxed(left)
  return spack('<llllll', 0, BOXED, 0, left, left, box_count)
end

-- Request k's `answer` under its penalty box (see the header): the box's refusal when the key
-- is in it, or when the answer puts the key in it; called only where the request's policy has
-- a box.
local function penalize(k, answer)
  local allowed, _, remaining, _, retry = sunpack('<lllll', answer)
  if box_end > 0 then
    -- Looked at in the box: refused until its end, and until the limits admit the request
    -- (retry -1 when they would now); a request that no wait helps gets their refusal.
    if allowed == 0 and retry == -2 then
      return answer
    end
    return boxed(math.max(box_end - now, retry))
  end
  local bkey = KEYS[k] .. ':box'
  local recorded = box_record == ADMIT or box_record == LEASE
  if box_held then
    -- Past its end: the first admission ends the box; until then a refusal is the box's.
    if allowed >= 1 and recorded then
      redis.pcall('DEL', bkey)
    elseif allowed == 0 and retry >= 0 then
      return boxed(retry)
    end
    return answer
  end
  local refused = allowed == 0 and retry ~= -2 and recorded
  local filled = box_record == SETTLE and box_refund == 0 and remaining == 0
  if not (refused or filled) then
    return answer
  end
  -- Kept as long as the key's state (1 ms more than its length: Redis expires keys on its
  -- own millisecond clock), and only where there is none.
  local ms = box_ms + 1
  local kept = redis.pcall('PTTL', KEYS[k])
  if type(kept) == 'number' and kept > ms then
    ms = kept
  end
  redis.pcall('SET', bkey, text(now + box_us), 'PX', text(ms), 'NX')
  if filled then
    return answer
  end
  return boxed(math.max(box_us, retry))
end

-- Request k's `answer` as an attempt (see "Attempts"), out of any penalty box: admitted, it is
-- in flight; refused by its limits while the units in flight cover what it lacks, BUSY.
-- Whether it is BUSY, and its answer.
local function as_attempt(k, answer)
  if box_end > 0 or box_held or (box_record ~= ADMIT and box_record ~= LEASE) then
    return false, answer
  end
  local allowed, index, remaining, reset, retry, count = sunpack('<llllll', answer)
  local tries = KEYS[k] .. ':tries'
  if allowed >= 1 then
    redis.call('ZADD', tries, text(now), text(attempt_id) .. ':' .. text(attempt_cost))
    redis.call('PEXPIRE', tries, text(ATTEMPT_KEPT / 1000 + 1))
    return false, answer
  end
  if retry < 0 then
    return false, answer
  end
  redis.call('ZREMRANGEBYSCORE', tries, '-inf', text(now - ATTEMPT_KEPT))
  local found = redis.call('ZRANGE', tries, 0, -1, 'WITHSCORES')
  local live = {}
  for j = 1, #found, 2 do
    local units = tonumber(string.match(found[j], ':(%d+)$')) or 0
    live[#live + 1] = {at = tonumber(found[j + 1]), units = units}
  end
  if #live == 0 or fits_without == nil or not fits_without(live) then
    return false, answer
  end
  return true, spack('<llllll', -1, index, remaining, reset, math.min(retry, BUSY_RETRY), count)
end

-- Request k's `answer` once decided: the penalty box's when it puts the key in it, the slot
-- taken when it admits a request that takes one, and its attempt's; called only where any
-- applies.
local function conclude(k, answer)
  local busy = false
  if attempt_id > 0 then
    busy, answer = as_attempt(k, answer)
  end
  if box_ms > 0 and not busy then
    answer = penalize(k, answer)
  end
  if slot_cap > 0 and sunpack('<l', answer) >= 1 then
    take_slot(k)
  end
  return answer
end

-- The reply of the whole call: every request's answer, the time, the generation of the hash
-- of overrides, the slot operations', then the override fields read, if any.
local function finish()
  reply[#reply + 1] = spack('<ll', now, generation)
  reply[#reply + 1] = table.concat(slots_kept)
  if found ~= nil and #fields > 0 then
    reply[#reply + 1] = spack('<l', #fields)
    for j = 1, #fields do
      local name, value = fields[j], found[j]
      if value then
        reply[#reply + 1] = spack('<l', #name) .. name .. spack('<l', #value) .. value
      else
        reply[#reply + 1] = spack('<l', #name) .. name .. spack('<l', -1)
      end
    end
  end
  return table.concat(reply)
end

-- Whether a refusal with `retry` (us; -2: no wait helps, the latest of all) is reported over
-- the one found so far, whose retry is `so_far` (nil: none yet).
local function later(retry, so_far)
  return so_far == nil or (so_far ~= -2 and (retry == -2 or retry > so_far))
end
