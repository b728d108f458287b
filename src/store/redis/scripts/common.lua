-- Shared prelude of every rate-limit script; each algorithm's file is appended to it.
-- It reads the arguments, takes the time from Redis, and combines the per-limit answers
-- exactly as `decide` in src/algorithm/mod.rs does.
--
-- KEYS[1]   the key's state (the algorithm's file says its type)
-- ARGV[1]   cost: units this request uses (integer >= 0)
-- ARGV[2]   1 to record an admitted request, 0 to only look (peek)
-- ARGV[3]   event time in microseconds since the epoch, or -1 for now (Redis TIME)
-- ARGV[2k+2], ARGV[2k+3]  count and window (microseconds) of limit k = 1..n, shortest first
--
-- Reply: { allowed (1 or 0), limit index (0-based), remaining, reset_after (us),
--          retry_after (us; -1 when admitted, -2 when no wait helps) }

if redis.replicate_commands then
  redis.replicate_commands()
end

local key = KEYS[1]
local cost = tonumber(ARGV[1])
local record = ARGV[2] == '1'
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local t = tonumber(ARGV[3])
if t < 0 then
  t = now
end
local n = (#ARGV - 3) / 2
local counts, windows = {}, {}
for i = 1, n do
  counts[i] = tonumber(ARGV[2 * i + 2])
  windows[i] = tonumber(ARGV[2 * i + 3])
end
local longest = windows[n]

-- fits(i): nil if the request fits limit i, else the retry in us (-2: no wait helps).
-- apply(): records the request against every limit.
-- report(i): units left in limit i and us until it resets.
local function decide(fits, apply, report)
  local denied, denied_retry = nil, nil
  for i = 1, n do
    local retry = fits(i)
    if retry ~= nil then
      local later = denied == nil
        or (denied_retry ~= -2 and (retry == -2 or retry > denied_retry))
      if later then
        denied, denied_retry = i, retry
      end
    end
  end
  if denied then
    local remaining, reset = report(denied)
    return { 0, denied - 1, remaining, reset, denied_retry }
  end
  if record then
    apply()
  end
  local best, best_remaining, best_reset = 1, nil, 0
  for i = 1, n do
    local remaining, reset = report(i)
    if best_remaining == nil or remaining < best_remaining then
      best, best_remaining, best_reset = i, remaining, reset
    end
  end
  return { 1, best - 1, best_remaining, best_reset, -1 }
end

-- The start of the fixed window of length w holding time x (math.fmod is exact).
local function window_start(x, w)
  return x - math.fmod(x, w)
end

-- HMGET of fields "<i><suffix>" for every limit and suffix: values[i][suffix] (numbers or nil).
local function load_fields(suffixes)
  local names = {}
  for i = 1, n do
    for _, s in ipairs(suffixes) do
      names[#names + 1] = i .. s
    end
  end
  local raw = redis.call('HMGET', key, unpack(names))
  local values, j = {}, 1
  for i = 1, n do
    values[i] = {}
    for _, s in ipairs(suffixes) do
      values[i][s] = tonumber(raw[j])
      j = j + 1
    end
  end
  return values
end

-- HSET of values[i][suffix] for every limit, then an expiry of `ttl` microseconds.
local function store_fields(values, suffixes, ttl)
  local args = {}
  for i = 1, n do
    for _, s in ipairs(suffixes) do
      args[#args + 1] = i .. s
      args[#args + 1] = string.format('%d', values[i][s])
    end
  end
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, math.ceil(ttl / 1000))
end
