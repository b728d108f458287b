-- Sliding-window log; src/model/sliding_log.rs is the same procedure and explains the math.
--
-- Like gcra.lua, appended to prelude.lua without common.lua's driver: a log decision runs five
-- sorted-set commands, and the driver (closures called per limit, tables per request) cost
-- more than those commands. It combines limits exactly as the driver's `decide` does.
--
-- KEYS[k]   sorted set of events (log_events.lua, which is appended before this file); an
--           admitted request's event weighs its cost, a lease's the units it took
-- ARGV[1]   as prelude.lua: 64-bit little-endian signed integers, for each request in turn n,
--           cost, record (LOOK, ADMIT, LEASE, SETTLE or TAKE), event time (-1: now; any other
--           time, past or future, is taken), override id, penalty box (us), policy-wide and
--           plan override fields, known and the kind of the override the store knew
--           (prelude.lua, "Overrides"), the mode's arguments (want and headroom for a look or
--           a lease; refund, the admission time of the request settled (us; -1: not known),
--           the units it recorded and headroom for a settlement), count and window (us) of
--           limits 1..n, shortest first, then for known counts the override's (prelude.lua);
--           ARGV[2] and after as prelude.lua
--
-- Reply     as prelude.lua: one string of 64-bit little-endian signed integers, six per
--           request: allowed (0 when refused; when admitted, 1 plus the units leased beyond
--           the cost), limit index (0-based), remaining, reset_after (us), retry_after (us;
--           -1 when admitted, -2 when no wait helps), the overriding count (-1: none); an
--           event time further back than the longest window less the headroom answers limit
--           index -3 (TOO_OLD) and records nothing; then
--           Redis TIME, the generation of the hash of overrides, a byte per slot operation,
--           and the override fields read (prelude.lua)
--
-- Leases (src/store/redis/lease/, docs/leases.md): a lease is one event of the units it takes
-- (as many as fit in every limit, up to want), at now; return.lua makes it lighter by what
-- was not spent. A leasing store spends a unit up to `headroom` after Redis logged it, so
-- every request of a log policy on a leasing store, leased or not (LOOK, ADMIT sent as a
-- LEASE of its cost, LEASE, SETTLE, TAKE), reads each window `headroom` longer:
-- (t - w - headroom, t]. Every span of that length then
-- holds at most the count at the times events were logged, so every window of length w holds
-- at most the count at the times units were spent. Trim and expiry follow the longer window.
--
-- Settlements: a charge is recorded as an admitted request of that cost, one event at now,
-- whatever the limits say. A refund takes up to the units the settled request recorded off
-- the events of its admission time (log_lighten.lua, `lighten`; a request admitted from a
-- lease was logged with it, at the lease's time). Nothing when they have aged out or the
-- admission time is not known. The key's expiry stays.
--
-- A set whose newest member is "<time>:<n>" (one member per unit, as earlier versions kept the
-- log) is deleted and counts as none, once. While versions run side by side in a rolling
-- upgrade and write one key together, an older member read elsewhere reads as total and
-- weight 0: that key's counts can be off until it ages out, within one longest window.
--
-- Event times: decided by the limits alone (prelude.lua passes no penalty box for them), at
-- most the longest window w less the headroom back (TOO_OLD further). A time t read in
-- windows of w + headroom then reads nothing before now - 2 w, which every store keeps
-- (members are trimmed at twice the longest window it reads, and a key expires twice that
-- after its newest event), headroom or not: a store without leases may write the same key,
-- and keeps no more than that. Without headroom, the bound is w.
--
-- Writes: members at or before twice the longest window before now are trimmed, after every
-- request of the call is decided (see `trims`); an admitted
-- request of positive cost adds one member after those at or before its time, adds its cost
-- to the totals of the members after it (scheduled events, or later ones than a past event
-- time: rewritten, which with a refund's are the only writes that grow with the set), and
-- sets the key to expire twice the longest window after its latest event (or now), rounded up
-- to an eighth of the policy's longest window (expiry.lua, `expires_at`), unless it keeps an
-- expiry at least that. Totals stay below 2^52, exact in Lua's doubles: a request that would
-- pass that first takes the total before the oldest member off every member.
--
-- Retry: the earliest time the request fits every limit at once, given every event, before
-- and after t (sliding_log.rs explains it): per limit, e + w for the first event e after
-- t - w, or later when (t - w, t] itself is too full, its events read oldest first, in pages,
-- until their weights cover the units that must leave (usually the window's first event, read
-- anyway); with events after t, decided afresh at the latest of those (`joint_retry`).

-- Per limit of the request at hand (entries past its n are left over and never read): count,
-- window, units in (t - w, t], the most any window (a, a + w] containing t holds, and the time
-- of the first event of (t - w, t] (false: none).
local counts, windows, pasts, fullests, firsts = {}, {}, {}, {}, {}
-- The request's longest window as its policy has it, without a leasing store's headroom: what
-- the key's expiry is rounded by (expiry.lua, `expires_at`).
local bare_longest = 0
-- The trims of the call, made once every request is decided: a key, then the score at or
-- before which its members go, for each request. A trim is a write Redis never refuses for
-- memory, and once a script has written, Redis lets its later writes past `maxmemory` too; so
-- the first write of a call is an event's `ZADD`, which Redis refuses when it is out of memory
-- at the call's start (`docs/operations.md`, "Memory"). Decisions read no member that old
-- (see "Event times"): one whose set holds only such members decides as on an empty set.
local trims = {}

-- The running total through the last event at or before `at` (a score) and after `kept` (a
-- score bound: '-inf', or '(' and the cutoff of `trims`), or false when there is none. A
-- member at or before the cutoff, left until the call's trims, may not fit the totals of the
-- ones after it (a rebase moved only those; a request of the call decided as on an empty set
-- restarted them), so a decision reads none.
local function total_through(key, at, kept)
  local last = call('ZREVRANGEBYSCORE', key, at, kept, 'LIMIT', '0', '1')[1]
  if last == nil then
    return false
  end
  local _, total = event(last)
  return total
end

-- When (t - w, t], which holds `past` units from the event `first_t` on (its total before it
-- `first_before`), has room for `cost` (at most c) as far as its own events go: once
-- `past + cost - c` units have left it, at e + w for the first event e, oldest first, whose
-- running total covers them; read in pages, usually the window's first event alone. t when
-- it has room (sliding_log.rs, `past_frees`).
local function past_frees(key, t, c, w, cost, past, first_t, first_total, first_before)
  if past + cost <= c then
    return t
  end
  local need = first_before + past + cost - c
  if first_total >= need then
    return first_t + w
  end
  local offset, size = 1, min(need - first_total, 32)
  while true do
    local page = call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT', text(offset),
      text(size))
    if #page == 0 then
      return t
    end
    for j = 1, #page do
      local time, total = event(page[j])
      if total >= need then
        return time + w
      end
    end
    offset, size = offset + #page, min(size * 2, 1024)
  end
end

-- Limit (c, w) at `t` for a request of `cost`: units in (t - w, t], the most any window
-- (a, a + w] containing t holds, the time of the first event of (t - w, t] (false: none), and
-- the earliest time the limit could admit the request (false when it does now, -2 when no
-- wait helps): e + w for the first event e after t - w, or later when (t - w, t] itself is
-- too full (sliding_log.rs, `fits`). `upto` is the total through the last event at or before
-- t when known (nil: not read yet, false: no such event); `newest_t` the newest event's time
-- (nil: none). Returns `upto` as read.
local function limit_at(key, t, c, w, cost, upto, newest_t)
  local at = text(t)
  local past, first_t, first_total, first_before = 0, false, 0, 0
  if newest_t ~= nil then
    local first = call('ZRANGEBYSCORE', key, text(t - w + 1), at, 'LIMIT', '0', '1')[1]
    if first then
      local weight
      first_t, first_total, weight = event(first)
      first_before = first_total - weight
      if upto == nil then
        -- `first` is after the cutoff: so is the last event at or before t.
        upto = total_through(key, at, '-inf')
      end
      past = upto - first_before
    end
  end
  local fullest = past
  -- Only events after t (scheduled ones) can make a later window fuller; the fullest ending
  -- at e ends with the last member of time e.
  local after = nil
  if newest_t ~= nil and newest_t > t then
    local scheduled = call('ZRANGEBYSCORE', key, text(t + 1), text(t + w - 1))
    if scheduled[1] then
      after = event(scheduled[1])
    end
    for j = 1, #scheduled do
      local e, total = event(scheduled[j])
      if scheduled[j + 1] == nil or event(scheduled[j + 1]) ~= e then
        local head = call('ZRANGEBYSCORE', key, text(e - w + 1), text(e), 'LIMIT', '0', '1')[1]
        local _, head_total, head_weight = event(head)
        fullest = max(fullest, total - head_total + head_weight)
      end
    end
  end
  if fullest + cost <= c then
    return past, fullest, first_t, false, upto
  end
  if cost > c then
    return past, fullest, first_t, -2, upto
  end
  -- The first event after t - w: the window's first, else the first after t.
  local leaves = t + w
  if first_t then
    leaves = first_t + w
  elseif after then
    leaves = after + w
  end
  local frees = past_frees(key, t, c, w, cost, past, first_t, first_total, first_before)
  return past, fullest, first_t, max(leaves, frees), upto
end

-- The wait after which a request of `cost` refused at t fits every limit at once, given
-- `retry`, the latest of the limits' own waits (sliding_log.rs, `joint_retry`): with events
-- after t, each candidate is decided afresh, the next one the latest of the refusing limits'
-- own answers there; after JOINT_STEPS candidates, the time the newest event has left every
-- window, at which the request always fits.
local JOINT_STEPS, JOINT_EVENTS = 32, 64
local function joint_retry(key, n, t, cost, retry, newest_t)
  if newest_t == nil or newest_t <= t then
    return retry
  end
  -- More events after t than JOINT_EVENTS: each candidate would read them all (sliding_log.rs,
  -- `JOINT_EVENTS`); the time the newest has left every window, where the request fits.
  if call('ZCOUNT', key, '(' .. text(t), '+inf') > JOINT_EVENTS then
    return max(newest_t + windows[n] - t, retry)
  end
  local at = t + retry
  for _ = 1, JOINT_STEPS do
    local next_at = false
    for i = 1, n do
      local _, _, _, lower = limit_at(key, at, counts[i], windows[i], cost, nil, newest_t)
      if lower == -2 then
        return retry
      end
      if lower and (not next_at or lower > next_at) then
        next_at = lower
      end
    end
    if not next_at then
      return at - t
    end
    at = next_at
  end
  return newest_t + windows[n] - t
end

-- Decides (LOOK, ADMIT or LEASE) or charges (SETTLE) a request of `cost` at `t`, taking up to
-- `want` units for a lease; returns its answer.
local function decide(key, n, cost, record, t, want)
  local longest = windows[n]
  local at = text(t)

  -- Events are kept twice the longest window: decisions are at times at most a longest window
  -- before now, and read windows reaching one further back. Trimmed once the call's requests
  -- are decided (`trims`).
  local cutoff = now - 2 * longest
  if cutoff >= 0 then
    trims[#trims + 1] = key
    trims[#trims + 1] = cutoff
  end
  local newest_t, newest_total
  local newest = call('ZRANGE', key, '-1', '-1')[1]
  if newest then
    -- A set of one member per unit ("<time>:<n>", as earlier versions kept it) counts as none.
    if not is_event(newest) then
      call('DEL', key)
    else
      newest_t, newest_total = event(newest)
      if cutoff >= 0 and newest_t <= cutoff then
        newest_t, newest_total = nil, nil
      end
    end
  end
  -- The total through the last event at or before t (nil: not read yet, false: no such event).
  local upto
  if newest_t ~= nil and newest_t <= t then
    upto = newest_total
  end

  -- Each limit's use, and the limit that refuses with the latest retry (-2, no wait helps,
  -- is the latest of all).
  local denied, denied_retry = nil, nil
  for i = 1, n do
    local past, fullest, first_t, lower
    past, fullest, first_t, lower, upto = limit_at(key, t, counts[i], windows[i], cost, upto,
      newest_t)
    pasts[i], fullests[i], firsts[i] = past, fullest, first_t
    if lower and record ~= SETTLE then
      local retry = -2
      if lower ~= -2 then
        retry = lower - t
      end
      if later(retry, denied_retry) then
        denied, denied_retry = i, retry
      end
    end
  end
  if denied ~= nil and denied_retry >= 0 then
    denied_retry = joint_retry(key, n, t, cost, denied_retry, newest_t)
  end

  -- Refused: report the refusing limit. Admitted: record, then report the limit with the
  -- fewest units left (the first of equals).
  local allowed, reported, retry = 0, denied, denied_retry
  if denied == nil then
    allowed, retry = 1, -1
    -- An event weighs at most one unit more than the largest count: no decision tells more
    -- from that (sliding_log.rs, `record`).
    if record == LEASE then
      -- A lease takes as many units as fit in every limit now, up to want (at least the
      -- cost, which fits), as one event.
      local take = want
      for i = 1, n do
        take = min(take, counts[i] - fullests[i])
      end
      allowed, cost = 1 + take - cost, take
    elseif record ~= LOOK then
      local largest = 0
      for i = 1, n do
        largest = max(largest, counts[i])
      end
      cost = min(cost, largest + 1)
    end
    -- What a write reads of the set: the members after `kept`, those the call's trims keep
    -- (see `total_through`).
    local kept = '-inf'
    if cutoff >= 0 and record ~= LOOK and cost > 0 and newest_t ~= nil then
      kept = '(' .. text(cutoff)
    end
    if record ~= LOOK and cost > 0 and newest_t ~= nil and newest_total + cost > MAX_UNITS then
      -- Totals restart from the oldest member kept; the log's units stay within MAX_UNITS
      -- (MAX_UNITS), the event weighing less if need be.
      local oldest = call('ZRANGEBYSCORE', key, kept, '+inf', 'LIMIT', '0', '1')[1]
      local _, total, weight = event(oldest)
      local base = total - weight
      shift(key, call('ZRANGEBYSCORE', key, kept, '+inf'), -base)
      newest_total = newest_total - base
      if upto then
        upto = upto - base
      end
      cost = min(cost, MAX_UNITS - newest_total)
    end
    if record ~= LOOK and cost > 0 then
      -- The total before the new event: through the last event at or before t, else before
      -- the oldest (all after t), else 0 (an empty set).
      local before = 0
      if newest_t ~= nil then
        if upto == nil then
          upto = total_through(key, at, kept)
        end
        if upto then
          before = upto
        else
          local oldest = call('ZRANGEBYSCORE', key, kept, '+inf', 'LIMIT', '0', '1')[1]
          local _, total, weight = event(oldest)
          before = total - weight
        end
        if newest_t > t then
          shift(key, call('ZRANGEBYSCORE', key, '(' .. at, '+inf'), cost)
        end
      end
      call('ZADD', key, at, member(t, before + cost, cost))
      -- Every window containing t now holds `cost` more, and starts at t if it was empty.
      for i = 1, n do
        pasts[i], fullests[i] = pasts[i] + cost, fullests[i] + cost
        if not firsts[i] then
          firsts[i] = t
        end
      end
      -- The expiry: twice the longest window after the newest event (or now), rounded up as
      -- expiry.lua's `expires_at` says, where the one the newest event before guarantees (at
      -- least twice the policy's longest window after it, so rounded) is sooner; else the key
      -- keeps its own (sliding_log_plain.lua, "Expiry").
      local before_t = newest_t
      newest_t = max(newest_t or t, t)
      local expires = expires_at(max(newest_t, now) + 2 * longest, bare_longest)
      if not before_t or expires > expires_at(before_t + 2 * bare_longest, bare_longest) then
        call('PEXPIREAT', key, text(expires))
      end
    end
    local least
    for i = 1, n do
      local remaining = max(counts[i] - fullests[i], 0)
      if least == nil or remaining < least then
        least, reported = remaining, i
      end
    end
  end

  -- The reported limit: units left, and when its oldest event in (t - w, t] leaves it.
  local c, w = counts[reported], windows[reported]
  local reset = 0
  if firsts[reported] then
    reset = firsts[reported] + w - t
  end
  return spack('<llllll', allowed, reported - 1, max(c - fullests[reported], 0), reset, retry,
    overridden and counts[reported] or -1)
end

-- A reservation (prelude.lua, RESERVE; src/model/turn.rs): the earliest `t` at or
-- after `from` (now, or the end of the key's pause) and the newest event (so that
-- reservations keep their order) at which every window containing `t` has room, stepping by
-- the latest retry; logged there within `wait`, put in the key's line, and answered admitted
-- with its turn (t - now) as the retry, else refused with that turn, logging nothing.
local function reserve(key, n, cost, wait, from)
  local t = from
  local newest = call('ZRANGE', key, '-1', '-1')[1]
  if newest and is_event(newest) then
    t = max(t, (event(newest)))
  end
  for _ = 1, 1024 do
    if t - now > wait then
      break
    end
    local looked = decide(key, n, cost, LOOK, t, cost)
    local allowed, _, _, _, retry = sunpack('<lllll', looked)
    if allowed >= 1 then
      local logged = decide(key, n, cost, ADMIT, t, cost)
      local a, index, remaining, reset, _, count = sunpack('<llllll', logged)
      t = join_line(key, t, cost)
      return spack('<llllll', a, index, remaining, reset, t - now, count)
    end
    if retry < 0 then
      return looked
    end
    t = t + max(retry, 1)
  end
  local looked = decide(key, n, cost, LOOK, now, cost)
  local _, index, remaining, reset, _, count = sunpack('<llllll', looked)
  return spack('<llllll', 0, index, remaining, reset, t - now, count)
end

-- The answer to an event time further back than the longest window less the headroom (its
-- index, TOO_OLD in wire/reply.rs).
local TOO_OLD = spack('<llllll', 0, -3, 0, 0, -2, -1)

for k = 1, REQUESTS do
  local key = KEYS[k]
  local n, cost, record, t, want, headroom, refund, admitted, recorded, blocked =
    next_request(counts, windows, nil, k)
  if blocked then
    reply[k] = blocked
  elseif n == 0 then
    reply[k] = conclude(k, NO_LIMITS)
  elseif event_time and t < now - windows[n] + headroom then
    -- Further back than w - headroom (see "Event times"): a window of w + headroom around
    -- it reaches before now - 2 w, which a store without leases writing this key lets go.
    reply[k] = TOO_OLD
  elseif record == SETTLE and refund == 1 then
    if admitted >= 0 then
      lighten(key, admitted, min(cost, recorded))
    end
    reply[k] = spack('<llllll', 1, 0, 0, 0, -1, -1)
  else
    -- A leasing store's units may be spent up to `headroom` after they were logged: every
    -- window is read that much longer (see "Leases").
    bare_longest = windows[n]
    for i = 1, n do
      windows[i] = windows[i] + headroom
    end
    if record == RESERVE then
      reply[k] = reserve(key, n, cost, reserve_wait, t)
    else
      reply[k] = decide(key, n, cost, record, t, want)
      if attempt_id > 0 then
        -- prelude.lua, "Attempts": each attempt's event, logged at its admission, lightened
        -- (a refund's), taken out of every window that holds it; with events after t in a
        -- window, no refusal is taken for busy.
        fits_without = function(tries)
          for i = 1, n do
            if fullests[i] > pasts[i] then
              return false
            end
            local held = 0
            for _, try in ipairs(tries) do
              if try.at > t - windows[i] and try.at <= t then
                held = held + try.units
              end
            end
            if pasts[i] - held + cost > counts[i] then
              return false
            end
          end
          return true
        end
      end
    end
    if box_ms > 0 or slot_cap > 0 or attempt_id > 0 then
      reply[k] = conclude(k, reply[k])
    end
  end
end

for j = 1, #trims, 2 do
  call('ZREMRANGEBYSCORE', trims[j], '-inf', text(trims[j + 1]))
end

return finish()
