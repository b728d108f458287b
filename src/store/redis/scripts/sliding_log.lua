-- Sliding-window log; src/algorithm/sliding_log.rs is the same procedure and explains the math.
--
-- Like gcra.lua, appended to prelude.lua without common.lua's driver: a log decision runs five
-- sorted-set commands, and the driver (closures called per limit, tables per request) cost
-- more than those commands. It combines limits exactly as the driver's `decide` does.
--
-- KEYS[k]   sorted set; one member per admitted request, score = event time in us, member =
--           "<time>:<total>:<weight>": weight is the request's cost (>= 1), total the running
--           total of the weights of the set's events up to and including this one, in time
--           order (events of one microsecond in the order they were added), written as 16
--           zero-padded digits so that the members of one microsecond sort in that order and
--           never collide. The units in a score range are the total of its last member minus
--           the total before its first (total - weight): two members, however many units.
-- ARGV[1]   as prelude.lua: 64-bit little-endian signed integers, for each request in turn n,
--           cost, record (ADMIT, LOOK, SETTLE or TAKE), event time (-1: now; any other time,
--           past or future, is taken), override id, penalty box (us), policy-wide and plan
--           override fields, known and the kind of the override the store knew
--           (prelude.lua, "Overrides"), for a settlement refund (0 or 1) and the admission
--           time of the request settled (us; -1: not known), count and window (us) of limits
--           1..n, shortest first, then for known counts the override's (prelude.lua); ARGV[2]
--           and after as prelude.lua
--
-- Reply     as prelude.lua: one string of 64-bit little-endian signed integers, six per
--           request: allowed (1 or 0), limit index (0-based), remaining, reset_after (us),
--           retry_after (us; -1 when admitted, -2 when no wait helps), the overriding count
--           (-1: none), then Redis TIME, the generation of the hash of overrides, a byte per
--           slot operation, and the override fields read (prelude.lua)
--
-- The log is never leased (the store refuses it): LEASE is not sent here.
--
-- Settlements: a charge is recorded as an admitted request of that cost, one member at now,
-- whatever the limits say. A refund finds the settled request's own member, the last one at
-- its admission time (members of one microsecond weigh the same in every window), and takes
-- up to its units off its weight, and as much off the totals of the members after it
-- (rewritten, as for a past event time); a member left weighing nothing is removed. Nothing
-- when that member has aged out or the admission time is not known. The key's expiry stays.
--
-- A set whose newest member is "<time>:<n>" (one member per unit, as earlier versions kept the
-- log) is deleted and counts as none, once. While versions run side by side in a rolling
-- upgrade and write one key together, an older member read elsewhere reads as total and
-- weight 0: that key's counts can be off until it ages out, within one longest window.
--
-- Writes: members older than the longest window before min(now, t) are trimmed; an admitted
-- request of positive cost adds one member after those at or before its time, adds its cost
-- to the totals of the members after it (scheduled events, or later ones than a past event
-- time: rewritten, which with a refund's are the only writes that grow with the set), and
-- sets the key to expire a
-- longest window after its latest event. Totals stay below 2^52, exact in Lua's doubles: a
-- request that would pass that first takes the total before the oldest member off every
-- member.
--
-- Retry: the events of the window are read oldest first, in pages, until their weights cover
-- the units that must leave; usually the window's first event, which is read anyway.

local call = redis.call
local find, sub, max, min, format = string.find, string.sub, math.max, math.min, string.format
-- Per limit of the request at hand (entries past its n are left over and never read): count,
-- window, units in (t - w, t], the most any window (a, a + w] containing t holds, and the time
-- of the first event of (t - w, t] (false: none).
local counts, windows, pasts, fullests, firsts = {}, {}, {}, {}, {}
local TOTAL_LIMIT = MAX_UNITS

-- Time, total and weight of the member "<time>:<total>:<weight>". Reading them from the
-- member instead of asking for scores spares Redis printing a double and Lua parsing it.
local function event(member)
  local a = find(member, ':', 1, true)
  return tonumber(sub(member, 1, a - 1)), tonumber(sub(member, a + 1, a + 16)) or 0,
    tonumber(sub(member, a + 18)) or 0
end

-- The running total through the last event at or before `at` (a score), or false when
-- there is none.
local function total_through(key, at)
  local last = call('ZREVRANGEBYSCORE', key, at, '-inf', 'LIMIT', '0', '1')[1]
  if last == nil then
    return false
  end
  local _, total = event(last)
  return total
end

local function member(time, total, weight)
  return text(time) .. ':' .. format('%016d', total) .. ':' .. text(weight)
end

-- Moves the totals of `members` by delta: all are removed before any is added back, since a
-- moved member may spell one not moved yet.
local function shift(key, members, delta)
  for j = 1, #members, 1000 do
    call('ZREM', key, unpack(members, j, min(j + 999, #members)))
  end
  local batch = {}
  for j = 1, #members do
    local e, total, weight = event(members[j])
    batch[#batch + 1] = text(e)
    batch[#batch + 1] = member(e, total + delta, weight)
    if #batch >= 2000 or j == #members then
      call('ZADD', key, unpack(batch))
      batch = {}
    end
  end
end

-- A refund of `units` of the request that recorded `recorded` units at `admitted` (see the
-- header): its own member is one of that time and weight (the last such; members of one
-- microsecond and one weight are alike in every window).
local function give_back(key, units, admitted, recorded)
  if admitted >= 0 then
    local at = text(admitted)
    local same = call('ZRANGEBYSCORE', key, at, at)
    for j = #same, 1, -1 do
      local own = same[j]
      -- A member of the earlier one-per-unit layout ("<time>:<n>") is left alone.
      if #own >= find(own, ':', 1, true) + 18 then
        local e, total, weight = event(own)
        if weight == recorded then
          local take = min(units, weight)
          if take > 0 then
            -- Every member after it carries `take` less: those of the same microsecond that
            -- sort after it, and all later ones.
            local after = { unpack(same, j + 1) }
            local later = call('ZRANGEBYSCORE', key, '(' .. at, '+inf')
            for m = 1, #later do
              after[#after + 1] = later[m]
            end
            call('ZREM', key, own)
            shift(key, after, -take)
            if take < weight then
              call('ZADD', key, at, member(e, total - take, weight - take))
            end
          end
          break
        end
      end
    end
  end
  return spack('<llllll', 1, 0, 0, 0, -1, -1)
end

-- Decides (LOOK or ADMIT) or charges (SETTLE) a request of `cost` at `t`; returns its answer.
local function decide(key, n, cost, record, t)
  local longest = windows[n]
  local at = text(t)

  local cutoff = min(now, t) - longest
  if cutoff >= 0 then
    call('ZREMRANGEBYSCORE', key, '-inf', text(cutoff))
  end
  local newest_t, newest_total
  local newest = call('ZRANGE', key, '-1', '-1')[1]
  if newest then
    -- A set of one member per unit ("<time>:<n>", as earlier versions kept it) counts as none.
    if #newest < find(newest, ':', 1, true) + 18 then
      call('DEL', key)
    else
      newest_t, newest_total = event(newest)
    end
  end
  -- The set holds exactly the events of the longest window (t - w, t] when nothing is
  -- scheduled after t and the trim cut at t - w (t not after now); then its first event is
  -- found by rank, the cheapest query.
  local whole = t <= now and (newest_t == nil or newest_t <= t)
  -- The total through the last event at or before t (nil: not read yet, false: no such event).
  local upto
  if newest_t ~= nil and newest_t <= t then
    upto = newest_total
  end

  -- Each limit's use, and the limit that refuses with the latest retry (-2, no wait helps,
  -- is the latest of all).
  local denied, denied_retry = nil, nil
  for i = 1, n do
    local c, w = counts[i], windows[i]
    local past, first_t, first_total, first_before = 0, false, nil, nil
    if newest_t ~= nil then
      local first
      if whole and w == longest then
        first = call('ZRANGE', key, '0', '0')[1]
      else
        first = call('ZRANGEBYSCORE', key, text(t - w + 1), at, 'LIMIT', '0', '1')[1]
      end
      if first then
        local weight
        first_t, first_total, weight = event(first)
        first_before = first_total - weight
        if upto == nil then
          upto = total_through(key, at)
        end
        past = upto - first_before
      end
    end
    local fullest = past
    -- Only events after t (scheduled ones) can make a later window fuller; the fullest ending
    -- at e ends with the last member of time e.
    if newest_t ~= nil and newest_t > t then
      local scheduled = call('ZRANGEBYSCORE', key, text(t + 1), text(t + w - 1))
      for j = 1, #scheduled do
        local e, total = event(scheduled[j])
        if scheduled[j + 1] == nil or event(scheduled[j + 1]) ~= e then
          local head = call('ZRANGEBYSCORE', key, text(e - w + 1), text(e), 'LIMIT', '0', '1')[1]
          local _, head_total, head_weight = event(head)
          fullest = max(fullest, total - head_total + head_weight)
        end
      end
    end
    pasts[i], fullests[i], firsts[i] = past, fullest, first_t
    if fullest + cost > c and record ~= SETTLE then
      local retry = -2
      if cost <= c and past + cost > c then
        -- The first event of (t - w, t], oldest first, whose total frees the excess.
        local need = first_before + past + cost - c
        local e = nil
        if first_total >= need then
          e = first_t
        else
          local offset, size = 1, min(need - first_total, 32)
          while e == nil do
            local page = call('ZRANGEBYSCORE', key, text(t - w + 1), at, 'LIMIT', text(offset),
              text(size))
            if #page == 0 then
              break
            end
            for j = 1, #page do
              local time, total = event(page[j])
              if total >= need then
                e = time
                break
              end
            end
            offset, size = offset + #page, min(size * 2, 1024)
          end
        end
        if e ~= nil then
          retry = e + w - t
        end
      end
      if later(retry, denied_retry) then
        denied, denied_retry = i, retry
      end
    end
  end

  -- Refused: report the refusing limit. Admitted: record, then report the limit with the
  -- fewest units left (the first of equals).
  local allowed, reported, retry = 0, denied, denied_retry
  if denied == nil then
    allowed, retry = 1, -1
    -- An event weighs at most one unit more than the largest count: no decision tells more
    -- from that (sliding_log.rs, `record`).
    if record ~= LOOK then
      local largest = 0
      for i = 1, n do
        largest = max(largest, counts[i])
      end
      cost = min(cost, largest + 1)
    end
    if record ~= LOOK and cost > 0 and newest_t ~= nil and newest_total + cost > TOTAL_LIMIT then
      -- Totals restart from the oldest member; the log's units stay within TOTAL_LIMIT
      -- (MAX_UNITS), the event weighing less if need be.
      local _, total, weight = event(call('ZRANGE', key, '0', '0')[1])
      local base = total - weight
      shift(key, call('ZRANGE', key, '0', '-1'), -base)
      newest_total = newest_total - base
      if upto then
        upto = upto - base
      end
      cost = min(cost, TOTAL_LIMIT - newest_total)
    end
    if record ~= LOOK and cost > 0 then
      -- The total before the new event: through the last event at or before t, else before
      -- the oldest (all after t), else 0 (an empty set).
      local before = 0
      if newest_t ~= nil then
        if upto == nil then
          upto = total_through(key, at)
        end
        if upto then
          before = upto
        else
          local _, total, weight = event(call('ZRANGE', key, '0', '0')[1])
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
      newest_t = max(newest_t or t, t)
      call('PEXPIREAT', key, text(math.ceil((max(newest_t, now) + longest) / 1000)))
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

for k = 1, REQUESTS do
  local key = KEYS[k]
  local n, cost, record, t, _, _, refund, admitted, recorded, blocked =
    next_request(counts, windows, nil, k)
  if blocked then
    reply[k] = blocked
  elseif record == SETTLE and refund == 1 then
    reply[k] = give_back(key, cost, admitted, recorded)
  else
    reply[k] = decide(key, n, cost, record, t)
    if box_ms > 0 or slot_cap > 0 then
      reply[k] = conclude(k, reply[k])
    end
  end
end

return finish()
