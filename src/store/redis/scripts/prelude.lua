-- Prelude of every rate-limit script: the algorithm's file (gcra.lua, sliding_log.lua), or
-- common.lua's driver and then the algorithm's file (fixed and sliding window), is appended to
-- it. One call decides a batch of requests, one after the other, exactly as if each were its
-- own call.
--
-- KEYS[k]   the state of request k (the algorithm's file says its format); in Redis Cluster
--           all keys of one call are in one hash slot
-- ARGV[1]   64-bit little-endian signed integers, for each request k in turn: n (its number
--           of limits), cost (units, >= 0), record (1 to record an admitted request, 0 to
--           only look, 2 for a lease, 3 for a settlement), event time in microseconds since
--           the epoch or -1 for now (Redis TIME); for a lease and a look (record 0), want
--           (the most units to take, >= cost) and headroom (us; GCRA keeps that much drain
--           free in every bucket, and a look reports against the same room); for a
--           settlement only, refund (0: add `cost` units, 1: take them back), the
--           admission time (Redis time, us, of the request being settled; -1: not known) and
--           the units that request recorded; then count, window (microseconds) and scale
--           (gcd of the two, GCRA's divisor) of limits 1..n, shortest first
--
-- Range: counts are at most 2^50, windows at most ten years, times below 2^53 us (the year
-- 2255), and every state saturates at MAX_UNITS (2^52) units, so that every number the
-- scripts compute stays below 2^53, where Lua's doubles are exact (src/policy.rs checks the
-- limits; docs/operations.md, "Range").
--
-- Reply: one string of 64-bit little-endian signed integers, five per request in turn:
--        allowed (0 when refused; when admitted, 1 plus the units leased beyond the cost),
--        limit index (0-based), remaining, reset_after (us), retry_after (us; -1 when
--        admitted, -2 when no wait helps); then, once per call, Redis TIME in us. A
--        settlement's five are those of an admitted request: remaining and reset_after
--        after it (a refund on the sliding log answers 1 0 0 0 -1)
--
-- Settlements (Store::settle, `settle` in src/algorithm/mod.rs) decide nothing: a charge
-- records `cost` units now as an admitted request would, past the limits if need be; a refund
-- takes up to `cost` units back from the state the settled request was counted in (each
-- algorithm's file says how).
--
-- Leases (src/store/redis/lease/): an admitted lease records as many units as fit in every
-- limit now, up to `want`, instead of `cost`, so that an instance can admit the extra units
-- itself later; the reply's remaining counts after them.
--
-- Limits combine as `decide` in src/algorithm/mod.rs: a refused request reports the limit that
-- refuses with the latest retry (`later`), an admitted one the limit with the fewest units left
-- (the first of equals; limits come shortest first).
--
-- Cost: arguments and reply are binary because Redis would otherwise parse and convert every
-- number on its own, and numbers handed to redis.call go as text made once per call (`text`),
-- because Redis prints every Lua number it receives with "%.17g", which costs more than the
-- command itself.

if redis.replicate_commands then
  redis.replicate_commands()
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local spack, sunpack = struct.pack, struct.unpack
-- The arguments, read from next_byte on, and the answers so far (one string per request).
local requests, next_byte = ARGV[1], 1
local reply = {}

-- The decimal text of the integer x, made once per call.
local texts = {}
local function text(x)
  local s = texts[x]
  if s == nil then
    s = string.format('%d', x)
    texts[x] = s
  end
  return s
end

-- The most units a state holds (2^52; src/algorithm/mod.rs), the largest count (2^50,
-- Limit::MAX_COUNT) and the longest window (3650 days in us, Limit::MAX_WINDOW): a request
-- past those is an error, never decided inexactly.
local MAX_UNITS = 4503599627370496
local MAX_COUNT, MAX_WINDOW = 1125899906842624, 315360000000000

-- Reads the next request's arguments: returns its number of limits n, cost, record (0 to 3),
-- event time (now for -1), want and headroom (cost and 0 unless a lease or a look), refund (0
-- unless a settlement), admission time (-1 unless a settlement) and the units the settled
-- request recorded, and puts each limit's count, window and scale in `counts[i]`,
-- `windows[i]` and `scales[i]` (entries past n are left over from an earlier request and
-- never read; `scales` may be nil).
local function next_request(counts, windows, scales)
  local n, cost, record, t, want, headroom, refund, admitted, weight
  n, cost, record, t, next_byte = sunpack('<llll', requests, next_byte)
  if t < 0 then
    t = now
  end
  want, headroom, refund, admitted, weight = cost, 0, 0, -1, 0
  if record == 2 or record == 0 then
    want, headroom, next_byte = sunpack('<ll', requests, next_byte)
  elseif record == 3 then
    refund, admitted, weight, next_byte = sunpack('<lll', requests, next_byte)
  end
  local scale
  for i = 1, n do
    counts[i], windows[i], scale, next_byte = sunpack('<lll', requests, next_byte)
    if counts[i] > MAX_COUNT or windows[i] > MAX_WINDOW or counts[i] < 1 or windows[i] < 1 then
      error('limit out of range: ' .. counts[i] .. ' per ' .. windows[i] .. ' us')
    end
    if scales then
      scales[i] = scale
    end
  end
  return n, cost, record, t, want, headroom, refund, admitted, weight
end

-- The reply of the whole call: every request's answer, then the time.
local function finish()
  reply[#reply + 1] = spack('<l', now)
  return table.concat(reply)
end

-- Whether a refusal with `retry` (us; -2: no wait helps, the latest of all) is reported over
-- the one found so far, whose retry is `so_far` (nil: none yet).
local function later(retry, so_far)
  return so_far == nil or (so_far ~= -2 and (retry == -2 or retry > so_far))
end
