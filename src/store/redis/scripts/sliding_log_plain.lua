-- Sliding-window log on the plain tier (after exact.lua, plain.lua and log_events.lua):
-- sliding_log.lua's decision of a look, an admission or a lease where no event is after its
-- time, and nothing else; src/model/sliding_log.rs is the same procedure and explains the math.
-- A change to sliding_log.lua's decisions is made here in the same change: the differential
-- test (src/store/redis/tests/differential.rs) runs both against the model.
--
-- KEYS[k]   request k's sorted set of events, exactly as sliding_log.lua keeps it
--           (log_events.lua spells the members), read and written alike
-- ARGV[1]   as sliding_log.lua (plain.lua says what this tier reads of it)
--
-- Reply     as plain.lua: six integers per request (allowed, limit index, remaining,
--           reset_after, retry_after, the overriding count), then Redis TIME and -2
--
-- Handles: LOOK, ADMIT and LEASE at a time t (now, or an event time) no earlier than the
-- newest event, under the policy's counts or the override's the arguments carry, every window
-- read `headroom` longer as sliding_log.lua does (a leasing store's).
-- Sends to the full tier (FULL_PATH), besides what plain.lua sends: a set whose newest event
-- is after t (scheduled events: a reservation's, or an event time earlier than another), a
-- set of an earlier version's members ("<time>:<n>"), a record that would take the totals past
-- MAX_UNITS, and an event time further back than the longest window (which sliding_log.lua
-- answers TOO_OLD). It answers so before it writes anything.
--
-- Commands: the newest event first (ZRANGE -1 -1); none: the set is empty, and an admission
-- is ZADD and PEXPIREAT alone. Else the first event of each window (ZRANGEBYSCORE LIMIT 0 1),
-- then ZADD and PEXPIREAT: four on a warm key (sliding_log.lua: five).
-- Trim: sliding_log.lua trims events at or before twice the longest window L (with headroom)
-- before now in every decision. This tier trims the same range once per span of L of Redis
-- time, when the newest event is in an earlier span than now, and where the newest event
-- itself is that old (the set holds nothing a decision reads). Windows are read by score and
-- never reach that far back, so the events left over change no decision, and the totals of
-- the members kept are the same either way; a busy key keeps up to 3 L of events instead of
-- 2 L. The expiry is set on every admission, as sliding_log.lua does (an older writer's
-- expiry must not drop events that its reads need).

-- Per limit of the request at hand (entries past its n are left over and never read): count,
-- window, the units in (t - w, t], and the time of the first event of (t - w, t] (false: none).
local counts, windows, pasts, firsts = {}, {}, {}, {}

-- When (t - w, t], which holds `past` units from the event `first_t` on, has room for `cost`
-- (sliding_log.lua, `past_frees`).
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

-- Limit (c, w) at t for a request of `cost`, where no event is after t and `upto` is the total
-- through the newest event (nil: the set is empty): the units in (t - w, t], the time of its
-- first event (false: none), and the earliest time the limit could admit the request (false
-- when it does now, -2 when no wait helps), as sliding_log.lua's `limit_at`.
local function limit_at(key, t, c, w, cost, upto)
  local past, first_t, first_total, first_before = 0, false, 0, 0
  if upto ~= nil then
    local first = call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT', '0', '1')[1]
    if first then
      local weight
      first_t, first_total, weight = event(first)
      first_before = first_total - weight
      past = upto - first_before
    end
  end
  if past + cost <= c then
    return past, first_t, false
  end
  if cost > c then
    return past, first_t, -2
  end
  local leaves = t + w
  if first_t then
    leaves = first_t + w
  end
  local frees = past_frees(key, t, c, w, cost, past, first_t, first_total, first_before)
  return past, first_t, max(leaves, frees)
end

-- The newest event's time and total (nil, nil: an empty set), after the trim (see the
-- header); false when the set needs the full tier.
local function newest_of(key, t, longest)
  local newest = call('ZRANGE', key, '-1', '-1')[1]
  if newest == nil then
    return nil, nil
  end
  if not is_event(newest) then
    return false
  end
  local newest_t, newest_total = event(newest)
  if newest_t > t then
    return false
  end
  local cutoff = now - 2 * longest
  if cutoff >= 0 and math.floor(newest_t / longest) < math.floor(now / longest) then
    call('ZREMRANGEBYSCORE', key, '-inf', text(cutoff))
    if newest_t <= cutoff then
      return nil, nil
    end
  end
  return newest_t, newest_total
end

-- The units an admitted request records (a lease: as many as fit, up to want), and its
-- `allowed`.
local function recorded(n, cost, record, want)
  if record == LEASE then
    local take = want
    for i = 1, n do
      take = min(take, counts[i] - pasts[i])
    end
    return take, 1 + take - cost
  end
  local largest = 0
  for i = 1, n do
    largest = max(largest, counts[i])
  end
  return min(cost, largest + 1), 1
end

-- Decides a look, an admission or a lease of `cost` at t (up to `want` units for a lease);
-- returns its answer, or FULL_PATH.
local function decide(key, n, cost, record, t, want)
  local longest = windows[n]
  local newest_t, upto = newest_of(key, t, longest)
  if newest_t == false then
    return FULL_PATH
  end
  local denied, denied_retry = nil, nil
  for i = 1, n do
    local lower
    pasts[i], firsts[i], lower = limit_at(key, t, counts[i], windows[i], cost, upto)
    if lower then
      local retry = -2
      if lower ~= -2 then
        retry = lower - t
      end
      if later(retry, denied_retry) then
        denied, denied_retry = i, retry
      end
    end
  end
  local allowed, reported, retry = 0, denied, denied_retry
  if denied == nil then
    allowed, retry = 1, -1
    if record ~= LOOK then
      cost, allowed = recorded(n, cost, record, want)
    end
    if record ~= LOOK and cost > 0 then
      if upto ~= nil and upto + cost > MAX_UNITS then
        return FULL_PATH
      end
      call('ZADD', key, text(t), member(t, (upto or 0) + cost, cost))
      for i = 1, n do
        pasts[i] = pasts[i] + cost
        if not firsts[i] then
          firsts[i] = t
        end
      end
      call('PEXPIREAT', key, text(math.ceil((max(t, now) + 2 * longest) / 1000)))
    end
    local least
    for i = 1, n do
      local remaining = max(counts[i] - pasts[i], 0)
      if least == nil or remaining < least then
        least, reported = remaining, i
      end
    end
  end
  local c, w = counts[reported], windows[reported]
  local reset = 0
  if firsts[reported] then
    reset = firsts[reported] + w - t
  end
  return spack('<llllll', allowed, reported - 1, max(c - pasts[reported], 0), reset, retry,
    overridden and counts[reported] or -1)
end

for k = 1, #KEYS do
  local n, cost, record, t, want, headroom, answer = next_plain(counts, windows, nil)
  if answer then
    reply[k] = answer
  elseif n == 0 then
    reply[k] = NO_LIMITS
  elseif t < now - windows[n] - headroom then
    reply[k] = FULL_PATH
  else
    for i = 1, n do
      windows[i] = windows[i] + headroom
    end
    reply[k] = decide(KEYS[k], n, cost, record, t, want)
  end
end

return finish()
