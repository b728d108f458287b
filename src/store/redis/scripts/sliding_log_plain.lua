-- Sliding-window log on the plain tier (after expiry.lua, plain.lua and log_events.lua):
-- sliding_log.lua's decision of a look, an admission or a lease where no event is after its
-- time, and nothing else; src/model/sliding_log.rs is the same procedure and explains the math.
-- A change to sliding_log.lua's decisions is made here in the same change: the differential
-- test (src/store/redis/tests/differential.rs) runs both against the model.
--
-- KEYS[k]   request k's sorted set of events, exactly as sliding_log.lua keeps it
--           (log_events.lua spells the members), read and written alike
-- ARGV[1]   as plain.lua says (a plain request: what sliding_log.lua reads of one, and no
--           more)
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
-- MAX_UNITS, and an event time further back than the longest window less the headroom (which
-- sliding_log.lua answers TOO_OLD, "Event times"). It answers so before it writes anything.
--
-- Commands: the newest event first (ZRANGE -1 -1); where the set is empty, or its newest
-- event is older than every window, an admission is ZADD and PEXPIREAT alone. Else the first
-- event of each window that holds the newest (ZRANGEBYSCORE LIMIT 0 1), then ZADD, and
-- PEXPIREAT where the expiry moves (see "Expiry"): three or four on a warm key
-- (sliding_log.lua: four or five), three on a cold one.
-- Trim: sliding_log.lua trims events at or before twice the longest window L (with headroom)
-- before now for every decision, once the call's requests are decided. This tier trims the
-- same range once per span of L of Redis time, when the newest event is in an earlier span
-- than now, also after the call's decisions (`trims`), and decides as on an empty set where
-- the newest event itself is that old (the set holds nothing a decision reads). Windows are
-- read by score and never reach that far back, so the events left over change no decision,
-- and the totals of the members kept are the same either way; a busy key keeps up to 3 L of
-- events instead of 2 L.
-- Expiry: every admission sets the key to expire twice the longest window L after the event
-- (or now, where later), rounded up to an eighth of the policy's longest window W (L less a
-- leasing store's headroom; expiry.lua, `expires_at`), as sliding_log.lua does, so that a key
-- expires no sooner than expires_at(e + 2 W, W) for its newest event e, whichever store wrote
-- it, headroom or not. An admission whose expiry rounds to no later than that guarantee for
-- the newest event before it keeps the key's (no PEXPIREAT): on a key admitted again within
-- an eighth of its window, most admissions, one command fewer each.

-- The most units a state holds (exact.lua, which the plain log goes without).
local MAX_UNITS = 4503599627370496

-- Per limit of the request at hand (entries past its n are left over and never read): count,
-- window, the units in (t - w, t], and the time of the first event of (t - w, t] (false: none).
local counts, windows, pasts, firsts = {}, {}, {}, {}
-- The trims of the call, made once every request is decided (key, then the score at or before
-- which its members go), as sliding_log.lua's `trims`: so that the call's first write is an
-- event's `ZADD`, which Redis refuses when it is out of memory (a trim first would let every
-- later write of the call past `maxmemory`). Made by the first trim: most calls have none.
local trims

-- When (t - w, t], which holds `past` units from the event `first_t` on (its total before it
-- `first_before`), has room for `cost` (at most c), as far as its own events go: t when it
-- has room, else e + w for the first event e, oldest first, whose running total covers the
-- units that must leave, read in pages (sliding_log.lua, `past_frees`). It captures only
-- log_events.lua's `event` and expiry.lua's `text` (plain.lua says why).
local function past_frees(key, t, c, w, cost, past, first_t, first_total, first_before)
  if past + cost <= c then
    return t
  end
  local need = first_before + past + cost - c
  if first_total >= need then
    return first_t + w
  end
  local offset, size = 1, math.min(need - first_total, 32)
  while true do
    local page = redis.call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT',
      text(offset), text(size))
    if #page == 0 then
      return t
    end
    for j = 1, #page do
      local time, total = event(page[j])
      if total >= need then
        return time + w
      end
    end
    offset, size = offset + #page, math.min(size * 2, 1024)
  end
end

-- One loop, no other function of its own: see plain.lua (functions are made anew by every
-- call). Each request: the newest event and the trim, then each limit (sliding_log.lua's
-- `limit_at` where no event is after t), then the record and the answer.
for k = 1, #KEYS do
  local key = KEYS[k]
  local n, cost, record, t, want, headroom, answer, overridden
  next_byte, n, cost, record, t, want, headroom, answer, overridden =
    next_plain(requests, next_byte, confirmed, counts, windows, nil)
  if answer then
    reply[k] = answer
  elseif n == 0 then
    -- As prelude.lua's NO_LIMITS: admitted, nothing recorded.
    reply[k] = spack('<llllll', 1, 0, 0, 0, -1, -1)
  elseif t >= 0 and t < now - windows[n] + headroom then
    -- Further back than the longest window less the headroom (sliding_log.lua's TOO_OLD).
    reply[k] = spack('<llllll', 0, FULL_PATH, 0, 0, -2, -1)
  else
    if t < 0 then
      t = now
    end
    -- A leasing store's windows, read `headroom` longer (sliding_log.lua, "Leases"); the
    -- policy's own longest rounds the expiry (see the header).
    local bare_longest = windows[n]
    for i = 1, n do
      windows[i] = windows[i] + headroom
    end
    local longest = windows[n]
    -- The newest event's time and total (nil: an empty set); `full` where the set needs the
    -- full tier (see the header).
    local newest_t, upto, full = nil, nil, false
    local newest = call('ZRANGE', key, '-1', '-1')[1]
    if newest then
      full = not is_event(newest)
      if not full then
        newest_t, upto = event(newest)
        full = newest_t > t
      end
    end
    local cutoff = now - 2 * longest
    if newest_t and not full and cutoff >= 0
      and math.floor(newest_t / longest) < math.floor(now / longest) then
      trims = trims or {}
      trims[#trims + 1] = key
      trims[#trims + 1] = cutoff
      if newest_t <= cutoff then
        newest_t, upto = nil, nil
      end
    end

    -- Each limit: the units in (t - w, t] and its first event; the limit that refuses with
    -- the latest retry (-2, no wait helps, the latest of all).
    local denied, denied_retry = nil, nil
    for i = 1, full and 0 or n do
      local c, w = counts[i], windows[i]
      local past, first_t, first_total, first_before = 0, false, 0, 0
      -- Read only where the newest event is in the window: else it holds none.
      if newest_t and newest_t > t - w then
        local first = call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT', '0', '1')[1]
        if first then
          local weight
          first_t, first_total, weight = event(first)
          first_before = first_total - weight
          past = upto - first_before
        end
      end
      pasts[i], firsts[i] = past, first_t
      if past + cost > c then
        local retry = -2
        if cost <= c then
          local frees = past_frees(key, t, c, w, cost, past, first_t, first_total, first_before)
          retry = max(first_t and first_t + w or t + w, frees) - t
        end
        if later(retry, denied_retry) then
          denied, denied_retry = i, retry
        end
      end
    end

    -- Admitted: the units it records (a lease: as many as fit in every limit, up to want; an
    -- admission: at most one more than the largest count, sliding_log.lua), unless that takes
    -- the totals past MAX_UNITS; then the limit with the fewest units left.
    local allowed, reported, retry = 0, denied, denied_retry
    if not full and denied == nil then
      allowed, retry = 1, -1
      if record == LEASE then
        local take = want
        for i = 1, n do
          take = min(take, counts[i] - pasts[i])
        end
        allowed, cost = 1 + take - cost, take
      elseif record ~= LOOK then
        local largest = 0
        for i = 1, n do
          largest = max(largest, counts[i])
        end
        cost = min(cost, largest + 1)
      end
      if record ~= LOOK and cost > 0 then
        full = upto ~= nil and upto + cost > MAX_UNITS
      end
      if record ~= LOOK and cost > 0 and not full then
        local at = text(t)
        call('ZADD', key, at, member(t, (upto or 0) + cost, cost))
        for i = 1, n do
          pasts[i] = pasts[i] + cost
          if not firsts[i] then
            firsts[i] = t
          end
        end
        -- expiry.lua's `expires_at`, inline (a call of a Lua function costs Redis more than
        -- this whole expiry), for the time the write needs and for the one the newest event
        -- before it guarantees (see the header).
        local quantum = (bare_longest - bare_longest % 8000) / 8
        if quantum < 1000 then
          quantum = 1000
        end
        local expires = max(t, now) + 2 * longest + quantum - 1
        expires = expires - expires % quantum
        local kept = newest_t and newest_t + 2 * bare_longest + quantum - 1
        if not kept or expires > kept - kept % quantum then
          call('PEXPIREAT', key, text(expires / 1000))
        end
      end
      local least
      for i = 1, n do
        local remaining = max(counts[i] - pasts[i], 0)
        if least == nil or remaining < least then
          least, reported = remaining, i
        end
      end
    end

    if full then
      reply[k] = spack('<llllll', 0, FULL_PATH, 0, 0, -2, -1)
    else
      local c, w, first = counts[reported], windows[reported], firsts[reported]
      local reset = first and first + w - t or 0
      reply[k] = spack('<llllll', allowed, reported - 1, max(c - pasts[reported], 0), reset,
        retry, overridden and c or -1)
    end
  end
end

for j = 1, trims and #trims or 0, 2 do
  call('ZREMRANGEBYSCORE', trims[j], '-inf', text(trims[j + 1]))
end

reply[#reply + 1] = spack('<ll', now, NOT_READ)
return table.concat(reply)
