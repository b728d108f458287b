-- Sliding-window log (appended to common.lua); src/algorithm/sliding_log.rs is the same
-- procedure and explains the math.
--
-- KEYS[k]   sorted set; one member per admitted unit of cost, score = event time in us,
--           member = "<time>:<n>" (n counts the units sharing that microsecond, so members
--           never collide)
-- ARGV      as common.lua; the event time may be any, past or future
-- Reply     as common.lua
--
-- Writes: members older than the longest window before min(now, t) are trimmed; an admitted
-- request adds `cost` members and sets the key to expire a longest window after its latest
-- event.

-- Events in (e - w, e].
local function count(e, w)
  return redis.call('ZCOUNT', key, text(e - w + 1), text(e))
end

-- The time of an event from its member "<time>:<n>" (nil for none). Reading it from the
-- member instead of asking for scores spares Redis printing a double and Lua parsing it.
local function event_time(member)
  if member == nil then
    return nil
  end
  return tonumber(string.sub(member, 1, string.find(member, ':', 1, true) - 1))
end

-- For the request at hand: the time of the newest event (nil: none), and per limit the events
-- in (t - w, t] and the most any window (a, a + w] containing t holds, computed once.
local newest, pasts, fullests

-- Whether the set holds exactly the events of limit i's window (t - w, t]: true for the
-- longest window when nothing is scheduled after t and the trim cut at t - w (t not after
-- now). Then counts and the oldest event come from ranks, the cheapest queries.
local function whole_set_is_window(i)
  return windows[i] == longest and t <= now and (newest == nil or newest <= t)
end

local function used(i)
  if pasts[i] == nil then
    local w = windows[i]
    local past
    if newest == nil then
      past = 0
    elseif whole_set_is_window(i) then
      past = redis.call('ZCARD', key)
    else
      past = count(t, w)
    end
    local fullest, last = past, nil
    -- Only events after t (scheduled ones) can make a later window fuller.
    if newest ~= nil and newest > t then
      local later = redis.call('ZRANGEBYSCORE', key, text(t + 1), text(t + w - 1))
      for j = 1, #later do
        local e = event_time(later[j])
        if e ~= last then
          fullest = math.max(fullest, count(e, w))
          last = e
        end
      end
    end
    pasts[i], fullests[i] = past, fullest
  end
  return pasts[i], fullests[i]
end

local function fits(i)
  local c, w = counts[i], windows[i]
  local past, fullest = used(i)
  if fullest + cost <= c then
    return nil
  end
  if cost > c or past + cost <= c then
    return -2
  end
  local nth = redis.call('ZRANGEBYSCORE', key, text(t - w + 1), '+inf', 'LIMIT',
    text(past + cost - c - 1), '1')
  return event_time(nth[1]) + w - t
end

local function apply()
  if cost == 0 then
    return
  end
  local at = text(t)
  local seq = 0
  if newest ~= nil and newest >= t then
    seq = redis.call('ZCOUNT', key, at, at)
  end
  local batch = {}
  for u = 1, cost do
    batch[#batch + 1] = at
    batch[#batch + 1] = at .. ':' .. text(seq + u - 1)
    if #batch >= 1000 or u == cost then
      redis.call('ZADD', key, unpack(batch))
      batch = {}
    end
  end
  -- Every window containing t now holds `cost` more.
  for i = 1, n do
    pasts[i], fullests[i] = pasts[i] + cost, fullests[i] + cost
  end
  newest = math.max(newest or t, t)
  redis.call('PEXPIREAT', key, text(math.ceil((math.max(newest, now) + longest) / 1000)))
end

local function report(i)
  local c, w = counts[i], windows[i]
  local _, fullest = used(i)
  local oldest
  if newest == nil then
    oldest = nil
  elseif whole_set_is_window(i) then
    oldest = redis.call('ZRANGE', key, '0', '0')[1]
  else
    oldest = redis.call('ZRANGEBYSCORE', key, text(t - w + 1), text(t), 'LIMIT', '0', '1')[1]
  end
  local reset = 0
  if oldest then
    reset = event_time(oldest) + w - t
  end
  return math.max(c - fullest, 0), reset
end

local function run()
  local cutoff = math.min(now, t) - longest
  if cutoff >= 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', text(cutoff))
  end
  newest = event_time(redis.call('ZRANGE', key, '-1', '-1')[1])
  pasts, fullests = {}, {}
  return decide(fits, apply, report)
end

return each_request(run)
