-- Driver of the fixed-window and sliding-window scripts: appended to prelude.lua, and followed
-- by the algorithm's file, which ends with `return each_stored_request(fields, fits, apply,
-- report)`. gcra.lua and sliding_log.lua do without it, for speed (their headers say why).

-- The struct format of m 64-bit little-endian integers, made once per call.
local formats = {}
local function format(m)
  local f = formats[m]
  if f == nil then
    f = '<' .. string.rep('l', m)
    formats[m] = f
  end
  return f
end

-- The request being decided: its key, cost, mode (`record`: LOOK, ADMIT, LEASE or SETTLE; TAKE
-- reads as ADMIT), time, the most units a lease takes, limits, and for a settlement whether it
-- is a refund and the admission time (entries past n are left over from an earlier request and
-- never read). The counters take no headroom: a leased unit is spent in the window it was
-- counted in.
local key, cost, record, t, want, n, longest, refund, admitted, blocked
local counts, windows = {}, {}

-- Reads request k's arguments into the variables above.
local function load_request(k)
  key = KEYS[k]
  local _
  n, cost, record, t, want, _, refund, admitted, _, blocked = next_request(counts, windows, nil, k)
  longest = windows[n]
end

-- fits(i): nil if the request fits limit i, else the retry in us (-2: no wait helps).
-- apply(): records the request (`cost` units) against every limit.
-- report(i): units left in limit i and us until it resets.
-- give_back(): a refund of `cost` units of a request recorded at `admitted` (known: >= 0);
-- returns whether it changed the state.
local function decide(fits, apply, report, give_back)
  local denied, denied_retry = nil, nil
  if record == SETTLE then
    -- A settlement decides nothing: a charge records like an admitted request, whatever the
    -- limits say; the reply reports the state it leaves, as an admission's does.
    if cost > 0 then
      if refund == 1 then
        give_back()
      else
        apply()
      end
    end
  else
    for i = 1, n do
      local retry = fits(i)
      if retry ~= nil and later(retry, denied_retry) then
        denied, denied_retry = i, retry
      end
    end
  end
  if denied then
    local remaining, reset = report(denied)
    return 0, denied - 1, remaining, reset, denied_retry
  end
  local allowed = 1
  if record == LEASE then
    -- A lease takes as many units as fit in every limit now, up to want (at least the cost,
    -- which fits).
    local take = want
    for i = 1, n do
      take = math.min(take, (report(i)))
    end
    allowed, cost = 1 + take - cost, take
  end
  if record == ADMIT or record == LEASE then
    apply()
  end
  local best, best_remaining, best_reset = 1, nil, 0
  for i = 1, n do
    local remaining, reset = report(i)
    if best_remaining == nil or remaining < best_remaining then
      best, best_remaining, best_reset = i, remaining, reset
    end
  end
  return allowed, best - 1, best_remaining, best_reset, -1
end

-- The start of the fixed window of length w holding time x (math.fmod is exact).
local function window_start(x, w)
  return x - math.fmod(x, w)
end

-- The state of every limit, kept as one string of 64-bit little-endian integers: the m values
-- of limit 1, then those of limit 2, and so on, then the state's header: the Redis time (us)
-- it was created at, and the last time a lease was taken from it (0: never). return.lua gives
-- a lease back only to state created no later than the lease and holding it (see there).
-- Returns the values as one flat list (value j of limit i at (i - 1) * m + j) and sets `born`
-- and `leased`; the list is empty (and `born` nil) when there is no state, or state of
-- another shape, which counts as none.
local born, leased
local function load_fields(m)
  local raw = redis.call('GET', key)
  born, leased = nil, 0
  if raw and #raw == 8 * (m * n + 2) then
    local values = { sunpack(format(m * n + 2), raw) }
    values[#values] = nil -- the position after the last value, which struct.unpack adds
    leased = table.remove(values)
    born = table.remove(values)
    return values
  end
  return {}
end

-- Stores a flat list of integers as load_fields reads it, with the header (a lease taken now
-- moves `leased` to now), to expire after `ttl` microseconds (nil: keep the key's expiry).
local function store_fields(values, ttl)
  if record == LEASE then
    leased = now
  end
  local m = #values
  values[m + 1], values[m + 2] = born or now, leased
  local value = spack(format(m + 2), unpack(values))
  values[m + 1], values[m + 2] = nil, nil
  if ttl == nil then
    redis.call('SET', key, value, 'KEEPTTL')
  else
    redis.call('PSETEX', key, text(math.ceil(ttl / 1000)), value)
  end
end

-- The state of the request at hand, for algorithms that keep one string of integers: a flat
-- list as load_fields reads it (the algorithm's file says its layout).
local state

-- The request at hand's `fits_without` (prelude.lua, "Attempts"): on a copy of its state, each
-- attempt in flight given back as `give_back` refunds (to state created no later than it),
-- then every limit asked with `fits`.
local function attempts_given_back(fits, give_back)
  return function(tries)
    local saved, cost_at_hand, admitted_at_hand = state, cost, admitted
    local copy = {}
    for j = 1, #state do
      copy[j] = state[j]
    end
    state = copy
    for _, try in ipairs(tries) do
      if born ~= nil and born <= try.at then
        cost, admitted = try.units, try.at
        give_back()
      end
    end
    cost = cost_at_hand
    local fit = true
    for i = 1, n do
      if fits(i) ~= nil then
        fit = false
        break
      end
    end
    state, admitted = saved, admitted_at_hand
    return fit
  end
end

-- Decides every request of the call: loads its state of `fields` integers per limit, then
-- combines fits, apply and report (or settles, with apply or give_back); the reply
-- concatenates the answers.
local function each_stored_request(fields, fits, apply, report, give_back)
  -- A refund needs the admission time, and writes only where a window still held the request
  -- and the state is the one it was recorded in (created no later than the admission: a
  -- reset or a restart since turns it into a no-op); the key keeps its expiry.
  local function refund_units()
    if admitted >= 0 and born ~= nil and born <= admitted and give_back() then
      store_fields(state, nil)
    end
  end
  for k = 1, REQUESTS do
    load_request(k)
    if blocked then
      reply[k] = blocked
    elseif n == 0 then
      reply[k] = conclude(k, NO_LIMITS)
    else
      state = load_fields(fields)
      local allowed, index, remaining, reset, retry = decide(fits, apply, report, refund_units)
      if attempt_id > 0 and allowed == 0 then
        fits_without = attempts_given_back(fits, give_back)
      end
      local shown = overridden and counts[index + 1] or -1
      reply[k] = spack('<llllll', allowed, index, remaining, reset, retry, shown)
      if box_ms > 0 or slot_cap > 0 or attempt_id > 0 then
        reply[k] = conclude(k, reply[k])
      end
    end
  end
  return finish()
end
