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
  return redis.call('ZCOUNT', key, e - w + 1, e)
end

-- For the request at hand: the time of the newest event (nil: none), and per limit the events
-- in (t - w, t] and the most any window (a, a + w] containing t holds, computed once.
local newest, pasts, fullests

local function used(i)
  if pasts[i] == nil then
    local w = windows[i]
    local past = count(t, w)
    local fullest, last = past, nil
    -- Only events after t (scheduled ones) can make a later window fuller.
    if newest ~= nil and newest > t then
      local later = redis.call('ZRANGEBYSCORE', key, t + 1, t + w - 1, 'WITHSCORES')
      for j = 2, #later, 2 do
        local e = tonumber(later[j])
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
  local nth = redis.call('ZRANGEBYSCORE', key, t - w + 1, '+inf', 'WITHSCORES', 'LIMIT',
    past + cost - c - 1, 1)
  return tonumber(nth[2]) + w - t
end

local function apply()
  if cost == 0 then
    return
  end
  local at = string.format('%d', t)
  local seq = 0
  if newest ~= nil and newest >= t then
    seq = redis.call('ZCOUNT', key, t, t)
  end
  local batch = {}
  for u = 1, cost do
    batch[#batch + 1] = t
    batch[#batch + 1] = at .. ':' .. (seq + u - 1)
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
  redis.call('PEXPIREAT', key, math.ceil((math.max(newest, now) + longest) / 1000))
end

local function report(i)
  local c, w = counts[i], windows[i]
  local _, fullest = used(i)
  local oldest = redis.call('ZRANGEBYSCORE', key, t - w + 1, t, 'WITHSCORES', 'LIMIT', 0, 1)
  local reset = 0
  if oldest[2] then
    reset = tonumber(oldest[2]) + w - t
  end
  return math.max(c - fullest, 0), reset
end

local function run()
  local cutoff = math.min(now, t) - longest
  if cutoff >= 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', cutoff)
  end
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  newest = tonumber(last[2])
  pasts, fullests = {}, {}
  return decide(fits, apply, report)
end

return each_request(run)
