-- Sliding-window log; src/algorithm/sliding_log.rs is the same procedure and explains the math.
--
-- Like gcra.lua, appended to prelude.lua without common.lua's driver: a log decision runs six
-- sorted-set commands, and the driver (closures called per limit, tables per request) cost
-- more than those commands. It combines limits exactly as the driver's `decide` does.
--
-- KEYS[k]   sorted set; one member per admitted unit of cost, score = event time in us,
--           member = "<time>:<n>" (n counts the units sharing that microsecond, so members
--           never collide)
-- ARGV[1]   as prelude.lua: 64-bit little-endian signed integers, for each request in turn n,
--           cost, record (1 or 0), event time (-1: now; any other time, past or future, is
--           taken), then count and window (us) of limits 1..n, shortest first
--
-- Reply     as prelude.lua: one string of 64-bit little-endian signed integers, five per
--           request: allowed (1 or 0), limit index (0-based), remaining, reset_after (us),
--           retry_after (us; -1 when admitted, -2 when no wait helps), then Redis TIME
--
-- The log is never leased (the store refuses it): record 2 is not sent here.
--
-- Writes: members older than the longest window before min(now, t) are trimmed; an admitted
-- request adds `cost` members and sets the key to expire a longest window after its latest
-- event.

local call = redis.call
local find, sub, max, min = string.find, string.sub, math.max, math.min
-- Per limit of the request at hand (entries past its n are left over and never read): count,
-- window, events in (t - w, t], and the most any window (a, a + w] containing t holds.
local counts, windows, pasts, fullests = {}, {}, {}, {}

-- The time of an event from its member "<time>:<n>" (nil for none). Reading it from the
-- member instead of asking for scores spares Redis printing a double and Lua parsing it.
local function event_time(member)
  if member == nil then
    return nil
  end
  return tonumber(sub(member, 1, find(member, ':', 1, true) - 1))
end

for k = 1, #KEYS do
  local key = KEYS[k]
  local n, cost, record, t = next_request(counts, windows)
  local longest = windows[n]

  local cutoff = min(now, t) - longest
  if cutoff >= 0 then
    call('ZREMRANGEBYSCORE', key, '-inf', text(cutoff))
  end
  local newest = event_time(call('ZRANGE', key, '-1', '-1')[1])
  -- The set holds exactly the events of the longest window (t - w, t] when nothing is
  -- scheduled after t and the trim cut at t - w (t not after now); then counts and the
  -- oldest event come from ranks, the cheapest queries.
  local whole = t <= now and (newest == nil or newest <= t)

  -- Each limit's use, and the limit that refuses with the latest retry (-2, no wait helps,
  -- is the latest of all).
  local denied, denied_retry = nil, nil
  for i = 1, n do
    local c, w = counts[i], windows[i]
    local past
    if newest == nil then
      past = 0
    elseif whole and w == longest then
      past = call('ZCARD', key)
    else
      past = call('ZCOUNT', key, text(t - w + 1), text(t))
    end
    local fullest = past
    -- Only events after t (scheduled ones) can make a later window fuller.
    if newest ~= nil and newest > t then
      local scheduled = call('ZRANGEBYSCORE', key, text(t + 1), text(t + w - 1))
      local last
      for j = 1, #scheduled do
        local e = event_time(scheduled[j])
        if e ~= last then
          fullest = max(fullest, call('ZCOUNT', key, text(e - w + 1), text(e)))
          last = e
        end
      end
    end
    pasts[i], fullests[i] = past, fullest
    if fullest + cost > c then
      local retry = -2
      if cost <= c and past + cost > c then
        local nth = call('ZRANGEBYSCORE', key, text(t - w + 1), '+inf', 'LIMIT',
          text(past + cost - c - 1), '1')
        retry = event_time(nth[1]) + w - t
      end
      if later(retry, denied_retry) then
        denied, denied_retry = i, retry
      end
    end
  end

  -- Refused: report the refusing limit. Admitted: record, then report the limit with the
  -- fewest units left (the first of equals).
  local allowed, reported, retry = 0, denied, denied_retry
  -- Whether this request's events are the only ones in the set.
  local fresh = false
  if denied == nil then
    allowed, retry = 1, -1
    if record == 1 and cost > 0 then
      fresh = newest == nil
      local at = text(t)
      local seq = 0
      if newest ~= nil and newest >= t then
        seq = call('ZCOUNT', key, at, at)
      end
      if cost == 1 then
        call('ZADD', key, at, at .. ':' .. text(seq))
      else
        local batch = {}
        for u = 1, cost do
          batch[#batch + 1] = at
          batch[#batch + 1] = at .. ':' .. text(seq + u - 1)
          if #batch >= 1000 or u == cost then
            call('ZADD', key, unpack(batch))
            batch = {}
          end
        end
      end
      -- Every window containing t now holds `cost` more.
      for i = 1, n do
        pasts[i], fullests[i] = pasts[i] + cost, fullests[i] + cost
      end
      newest = max(newest or t, t)
      call('PEXPIREAT', key, text(math.ceil((max(newest, now) + longest) / 1000)))
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
  local oldest
  if fresh then
    oldest = t
  elseif newest == nil then
    oldest = nil
  elseif t <= now and newest <= t and w == longest then
    oldest = event_time(call('ZRANGE', key, '0', '0')[1])
  else
    oldest = event_time(call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT', '0', '1')[1])
  end
  local reset = 0
  if oldest then
    reset = oldest + w - t
  end
  reply[k] = spack('<lllll', allowed, reported - 1, max(c - fullests[reported], 0), reset, retry)
end

return finish()
