-- Sliding-window log: one or more limits over one sorted set, decided atomically.
-- The same procedure as src/algorithm/sliding_log.rs; read that file's header for the math.
--
-- KEYS[1]   sorted set; one member per admitted unit of cost, score = admission time in
--           microseconds from Redis TIME, member = "<time>:<n>" (n counts the units that share
--           that microsecond, so members never collide)
-- ARGV[1]   cost: units this request uses (integer >= 0)
-- ARGV[2k], ARGV[2k+1]  count and window (microseconds) of limit k (k = 1..n), sorted by
--           window, shortest first
--
-- Reply: { allowed (1 or 0), limit index (0-based), remaining, reset_after (us),
--          retry_after (us; -1 when admitted, -2 when the cost exceeds the limit itself) }
--
-- Only an admitted request writes: its cost is added as members and the key's expiry is set to
-- the longest window. Old members are trimmed on every call.

if redis.replicate_commands then
  redis.replicate_commands()
end

local key = KEYS[1]
local cost = tonumber(ARGV[1])
local n = (#ARGV - 1) / 2
local longest = tonumber(ARGV[#ARGV])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- Events at or before now - longest have left every window.
if now >= longest then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - longest)
end

-- Count each window (now - w, now] and find the limit that denies with the latest retry.
local used = {}
local denied, denied_retry = nil, nil
for i = 1, n do
  local count = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  local from = now - window + 1
  used[i] = redis.call('ZCOUNT', key, from, '+inf')
  if used[i] + cost > count then
    local retry = -2
    if cost <= count then
      local nth = redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT',
        used[i] + cost - count - 1, 1)
      retry = tonumber(nth[2]) + window - now
    end
    local later = denied == nil
      or (denied_retry ~= -2 and (retry == -2 or retry > denied_retry))
    if later then
      denied, denied_retry = i, retry
    end
  end
end

-- Remaining units of limit i, and when its oldest counted event leaves its window.
local function report(i)
  local count = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  local remaining = math.max(count - used[i], 0)
  local oldest = redis.call('ZRANGEBYSCORE', key, now - window + 1, '+inf', 'WITHSCORES',
    'LIMIT', 0, 1)
  local reset = 0
  if oldest[2] then
    reset = math.max(tonumber(oldest[2]) + window - now, 0)
  end
  return remaining, reset
end

if denied then
  local remaining, reset = report(denied)
  return { 0, denied - 1, remaining, reset, denied_retry }
end

-- Admit: add `cost` members at now, numbered after those already at this microsecond.
if cost > 0 then
  local at = string.format('%d', now)
  local seq = redis.call('ZCOUNT', key, now, now)
  local batch = {}
  for u = 1, cost do
    batch[#batch + 1] = now
    batch[#batch + 1] = at .. ':' .. (seq + u - 1)
    if #batch >= 1000 or u == cost then
      redis.call('ZADD', key, unpack(batch))
      batch = {}
    end
  end
  redis.call('PEXPIRE', key, math.ceil(longest / 1000))
end

local best, best_remaining, best_reset = 1, nil, 0
for i = 1, n do
  used[i] = used[i] + cost
  local remaining, reset = report(i)
  if best_remaining == nil or remaining < best_remaining then
    best, best_remaining, best_reset = i, remaining, reset
  end
end
return { 1, best - 1, best_remaining, best_reset, -1 }
