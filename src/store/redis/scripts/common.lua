-- Shared prelude of every rate-limit script; each algorithm's file is appended to it.
-- One call decides a batch of requests, one after the other, exactly as if each were its own
-- call: the algorithm's file defines `run()` for the request at hand and ends with
-- `return each_request(run)`. Per-limit answers are combined exactly as `decide` in
-- src/algorithm/mod.rs does.
--
-- KEYS[k]   the state of request k (the algorithm's file says its format); in Redis Cluster
--           all keys of one call are in one hash slot
-- ARGV      for each request k in turn: n (its number of limits), cost (units, integer >= 0),
--           record (1 to record an admitted request, 0 to only look), event time in
--           microseconds since the epoch or -1 for now (Redis TIME), then count and window
--           (microseconds) of limits 1..n, shortest first
--
-- Reply: for each request in turn, five integers: allowed (1 or 0), limit index (0-based),
--        remaining, reset_after (us), retry_after (us; -1 when admitted, -2 when no wait
--        helps)

if redis.replicate_commands then
  redis.replicate_commands()
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- The request being decided: its key, cost, record flag, time and limits.
local key, cost, record, t, n, longest
local counts, windows = {}, {}
local next_arg = 1

-- Reads request k's arguments into the variables above.
local function load_request(k)
  key = KEYS[k]
  n = tonumber(ARGV[next_arg])
  cost = tonumber(ARGV[next_arg + 1])
  record = ARGV[next_arg + 2] == '1'
  t = tonumber(ARGV[next_arg + 3])
  if t < 0 then
    t = now
  end
  counts, windows = {}, {}
  for i = 1, n do
    counts[i] = tonumber(ARGV[next_arg + 2 * i + 2])
    windows[i] = tonumber(ARGV[next_arg + 2 * i + 3])
  end
  longest = windows[n]
  next_arg = next_arg + 4 + 2 * n
end

-- Decides every request of the call with `run`, and concatenates the answers.
local function each_request(run)
  local reply = {}
  for k = 1, #KEYS do
    load_request(k)
    local answer = run()
    for j = 1, 5 do
      reply[#reply + 1] = answer[j]
    end
  end
  return reply
end

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

-- The state of every limit, kept as one string of integers "v1 v2 ...", limit by limit and
-- in the order of `suffixes` within a limit: values[i][suffix] (numbers, or nil when absent).
local function load_fields(suffixes)
  local raw = redis.call('GET', key)
  local numbers = {}
  if raw then
    for v in string.gmatch(raw, '%S+') do
      numbers[#numbers + 1] = tonumber(v)
    end
  end
  local values, j = {}, 1
  for i = 1, n do
    values[i] = {}
    for _, s in ipairs(suffixes) do
      values[i][s] = numbers[j]
      j = j + 1
    end
  end
  return values
end

-- Stores values[i][suffix] for every limit, to expire after `ttl` microseconds.
local function store_fields(values, suffixes, ttl)
  local parts = {}
  for i = 1, n do
    for _, s in ipairs(suffixes) do
      parts[#parts + 1] = string.format('%d', values[i][s])
    end
  end
  redis.call('SET', key, table.concat(parts, ' '), 'PX', math.ceil(ttl / 1000))
end
