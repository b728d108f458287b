-- Prelude of the plain tier (after exact.lua): gcra_plain.lua, or log_events.lua and then
-- sliding_log_plain.lua, is appended to it. A plain script decides what most requests are, a
-- look, an admission or a lease of a policy that uses none of the features below, and nothing
-- else, so that such a decision pays for no feature it does not use: it reads no hash of
-- overrides, and defines no penalty box, slot, attempt or line. The full scripts
-- (prelude.lua and the algorithm's file) decide everything, and the two tiers read and write
-- the same state byte for byte, so that a key may go from one to the other request by request
-- (src/store/redis/scripts/mod.rs, Tier).
--
-- KEYS[k]   the state of request k, as the algorithm's full script keeps it (its header says
--           the format); no slot operation's key
-- ARGV[1]   exactly as prelude.lua: for each request in turn, the eleven integers n, cost,
--           record, event time (-1: now), override id, penalty box, policy-wide and plan
--           fields, known, kind and attempt, then the mode's own arguments, the limits, and,
--           where kind is COUNTS, the override's counts (prelude.lua, ARGV[1])
-- ARGV[2..] as prelude.lua, and ignored: this tier reads no hash of overrides and takes no
--           slot operation
--
-- What it handles: LOOK, ADMIT and LEASE (a step of a metered body is sent as one of those),
-- at the event time given (-1: now), with no penalty box (0, or an event time, which no box
-- refuses), no attempt, and the override the arguments carry (kind NONE, BLOCK, or COUNTS with
-- their counts): `known` is not checked against the hash, which is the store's to follow
-- (the store sends a request here only while it knows the overrides that apply).
-- What it sends to the full tier: every other request (SETTLE, TAKE, RESERVE, a penalty box,
-- an attempt), and the cases each algorithm's plain file names, are answered FULL_PATH
-- (limit index -4: 0 FULL_PATH 0 0 -2 -1): not decided, nothing recorded; the store decides
-- such a request again with the full script (wire/reply.rs, FULL_PATH).
--
-- Reply: as prelude.lua, six integers per request, then Redis TIME in us and the generation
-- -2 ("not read": this tier read no hash, and the store learns nothing from the reply); no
-- slot operation's bytes and no override field.
--
-- Cost: as prelude.lua ("Cost"); everything a plain decision does not use is left out of the
-- script's top level, which every call runs whole: a full call's fixed work (closures, the
-- override generation's HLEN) costs about as much as a decision.

if redis.replicate_commands then
  redis.replicate_commands()
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local spack, sunpack = struct.pack, struct.unpack
-- The arguments, read from next_byte on, and the answers so far (one string per request).
local requests, next_byte = ARGV[1], 1
local reply = {}
-- The modes this tier decides (prelude.lua, "Modes"), and the number of arguments of each
-- mode of its own (those of the others are skipped).
local LOOK, ADMIT, LEASE = 0, 1, 2
local MODE_ARGS = {[0] = 2, [1] = 0, [2] = 2, [3] = 5, [4] = 7, [5] = 4}
-- The kinds of a known override (prelude.lua, "Overrides").
local BLOCK, COUNTS = -1, -2
-- The answers that no limit gives: a blocked request (as prelude.lua), a request without
-- rate limits (as prelude.lua), and one this tier does not decide (see the header).
local BLOCKED = spack('<llllll', 0, 0, 0, 0, -2, 0)
local NO_LIMITS = spack('<llllll', 1, 0, 0, 0, -1, -1)
local FULL_PATH = spack('<llllll', 0, -4, 0, 0, -2, -1)
-- The generation this tier replies: not read.
local NOT_READ = -2
-- The largest count and the longest window (prelude.lua).
local MAX_COUNT, MAX_WINDOW = 1125899906842624, 315360000000000
-- Whether the request at hand is decided by an override's counts, and the largest ratio of
-- an override's count to the policy's own, num / den, at least 1 (prelude.lua, `stretch_num`).
local overridden, stretch_num, stretch_den = false, 1, 1

-- Reads the limits of a request of n limits into counts, windows and scales (nil: not kept),
-- then, for an override's counts, puts them in their place (0: the window keeps its own).
local function read_limits(n, kind, counts, windows, scales)
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
  overridden, stretch_num, stretch_den = false, 1, 1
  if kind ~= COUNTS then
    return
  end
  overridden = true
  for i = 1, n do
    local count
    count, scale, next_byte = sunpack('<ll', requests, next_byte)
    if count > 0 then
      if count * stretch_den > stretch_num * counts[i] then
        stretch_num, stretch_den = count, counts[i]
      end
      counts[i] = count
      if scales then
        scales[i] = scale
      end
    end
  end
end

-- Reads the next request's arguments: returns its number of limits n, cost, mode, event time
-- (now for -1), want (the cost unless a lease or a look), headroom (0 for an admission), and
-- its answer when this tier does not decide it or an override blocks it (else false); puts
-- its limits in counts, windows and scales as `read_limits`.
local function next_plain(counts, windows, scales)
  local n, cost, record, t, box, kind, attempt, _
  n, cost, record, t, _, box, _, _, _, kind, attempt, next_byte =
    sunpack('<lllllllllll', requests, next_byte)
  local want, headroom = cost, 0
  local own = MODE_ARGS[record] or 0
  if record == LOOK or record == LEASE then
    want, headroom, next_byte = sunpack('<ll', requests, next_byte)
  else
    next_byte = next_byte + 8 * own
  end
  read_limits(n, kind, counts, windows, scales)
  local answer = false
  if record > LEASE or attempt > 0 or (box > 0 and t < 0) then
    answer = FULL_PATH
  elseif kind == BLOCK then
    answer = BLOCKED
  end
  if t < 0 then
    t = now
  end
  return n, cost, record, t, want, headroom, answer
end

-- Whether a refusal with `retry` (us; -2: no wait helps, the latest of all) is reported over
-- the one found so far, whose retry is `so_far` (nil: none yet); as prelude.lua.
local function later(retry, so_far)
  return so_far == nil or (so_far ~= -2 and (retry == -2 or retry > so_far))
end

-- The reply of the whole call: every request's answer, the time, and the generation not read.
local function finish()
  reply[#reply + 1] = spack('<ll', now, NOT_READ)
  return table.concat(reply)
end
