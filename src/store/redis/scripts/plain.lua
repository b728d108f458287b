-- Prelude of the plain tier (after expiry.lua, and exact.lua for GCRA): gcra_plain.lua, or
-- log_events.lua and then sliding_log_plain.lua, is appended to it. A plain script decides what
-- most requests are, a look, an admission or a lease of a policy that uses none of the features
-- below, and nothing else, so that such a decision pays for no feature it does not use: it
-- reads no hash of overrides, and defines no penalty box, slot, attempt or line. The full
-- scripts (prelude.lua and the algorithm's file) decide everything, and the two tiers read and
-- write the same state byte for byte, so that a key may go from one to the other request by
-- request (src/store/redis/scripts/mod.rs, Tier).
--
-- KEYS[k]   the state of request k, as the algorithm's full script keeps it (its header says
--           the format); no slot operation's key
-- ARGV[1]   for each request in turn (src/store/redis/wire/plain.rs, which makes them from
--           the full scripts' arguments, prelude.lua's ARGV[1]): the five integers n, cost,
--           record, event time (-1: now) and kind, then a look's or a lease's want and
--           headroom, count, window and scale of each limit, and, where kind is COUNTS, the
--           override's count and scale of each limit. A request this tier must not decide
--           (see below) is an admission at now of n = -1 and kind 0: -1 0 1 -1 0.
-- ARGV[2]   the lane's confirmation (src/store/redis/overrides/known.rs, "The plain tier"):
--           two integers, the generation of the hash of overrides a full call read, which
--           every request sent here was resolved at (the store sends one resolved at another
--           as n = -1), and the Redis time in us until which they are decided here (-2 and 0:
--           none is; the store sends a call it has no confirmation for to the full script
--           instead, transport/call.rs, Settings::arguments)
-- ARGV[3..] as prelude.lua, and ignored: this tier reads no hash of overrides and takes no
--           slot operation
--
-- What it handles: LOOK, ADMIT and LEASE (a step of a metered body is sent as one of those),
-- at the event time given (-1: now), with no penalty box (0, or an event time, which no box
-- refuses), no attempt, and the override the arguments carry (kind NONE, BLOCK, or COUNTS with
-- their counts), resolved at the generation the confirmation ARGV[2] carries: not checked
-- against the hash, which is the store's to follow (the store sends a request here only while
-- it knows the overrides that apply), but decided only until the confirmation's time, so that
-- a call run late (held in a stalled connection) decides nothing by overrides that may have
-- changed since.
-- What it sends to the full tier: every other request (SETTLE, TAKE, RESERVE, a penalty box,
-- an attempt, a request resolved at another generation than the one confirmed: each sent as
-- n = -1), every request once Redis's time has reached the confirmation's, and the cases each
-- algorithm's plain file names, are answered FULL_PATH
-- (limit index -4: 0 FULL_PATH 0 0 -2 -1): not decided, nothing recorded; the store decides
-- such a request again with the full script (wire/reply.rs, FULL_PATH).
--
-- Reply: as prelude.lua, six integers per request, then Redis TIME in us and the generation
-- -2 ("not read": this tier read no hash, and the store learns nothing from the reply); no
-- slot operation's bytes and no override field.
--
-- Cost: as prelude.lua ("Cost"); besides, everything a plain decision does not use is left out
-- of the script's top level, which every call runs whole: each function is made anew by every
-- call, a function that captures the script's locals costs several times more to make than
-- one that captures none, and a constant packed at the top is packed in every call (struct.pack
-- costs about what a decision's arithmetic does). So the algorithm's file decides in one loop,
-- the functions here capture nothing, answers are packed where they are given, and what a
-- plain decision never calls is not in the script: log_lighten.lua's rewrites of the log
-- (refunds and give-backs are the full tier's), and, for the log, exact.lua's arithmetic past
-- 2^53 (GCRA's plain script reweighs a state written under other counts with it). Measured with
-- callgrind on redis-server 7.0 (examples/redis_costs.rs, docs/performance.md): GCRA 0.48 and
-- the log 0.53 of the full script's instructions at one request per call; eight per call, 0.63
-- and 0.76.

if redis.replicate_commands then
  redis.replicate_commands()
end

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local spack, sunpack = struct.pack, struct.unpack
-- Whether this call decides by the confirmation it carries: until its time (see the header).
local confirmed = false
if #ARGV[2] == 16 then
  local _, ends = sunpack('<ll', ARGV[2])
  confirmed = now < ends
end
-- The arguments, read from next_byte on, and the answers so far (one string per request).
local requests, next_byte = ARGV[1], 1
local reply = {}
-- The modes this tier decides (prelude.lua, "Modes").
local LOOK, ADMIT, LEASE = 0, 1, 2
-- The limit index of a request this tier does not decide (see the header), and the generation
-- it replies: not read.
local FULL_PATH, NOT_READ = -4, -2

-- The functions below capture nothing (their constants are their own locals): every call of
-- the script makes each of its functions anew, and a function that captures the script's
-- locals costs several times more to make than one that does not, about what a decision's
-- arithmetic costs. Answers are packed where they are given, for the same reason.

-- Reads the request whose arguments start at byte `at` of `requests`, in a call that decides
-- by its confirmation where `confirmed` (see the header): returns the byte after them, its
-- number of limits n, cost, mode, event time (-1: now), want (the cost unless a lease or a
-- look), headroom (0 for an admission), its answer when this tier does not decide it or an
-- override blocks it (else false), and whether an override's counts decide it with the
-- largest ratio of such a count to the policy's own, num / den, at least 1 (prelude.lua,
-- `stretch_num`); puts each limit's count (an override's, if one applies), window and scale
-- in `counts[i]`, `windows[i]` and `scales[i]` (`scales` may be nil).
local function next_plain(requests, at, confirmed, counts, windows, scales)
  local sunpack = struct.unpack
  local LOOK, LEASE = 0, 2
  local BLOCK, COUNTS = -1, -2
  -- The largest count and the longest window (prelude.lua).
  local MAX_COUNT, MAX_WINDOW = 1125899906842624, 315360000000000
  local n, cost, record, t, kind
  n, cost, record, t, kind, at = sunpack('<lllll', requests, at)
  local want, headroom = cost, 0
  if record == LOOK or record == LEASE then
    want, headroom, at = sunpack('<ll', requests, at)
  end
  local count, window, scale
  for i = 1, n do
    count, window, scale, at = sunpack('<lll', requests, at)
    if count > MAX_COUNT or window > MAX_WINDOW or count < 1 or window < 1 then
      error('limit out of range: ' .. count .. ' per ' .. window .. ' us')
    end
    counts[i], windows[i] = count, window
    if scales then
      scales[i] = scale
    end
  end
  -- An override's counts (0: the window keeps its own).
  local overridden, num, den = kind == COUNTS, 1, 1
  if overridden then
    for i = 1, n do
      count, scale, at = sunpack('<ll', requests, at)
      if count > 0 then
        if count * den > num * counts[i] then
          num, den = count, counts[i]
        end
        counts[i] = count
        if scales then
          scales[i] = scale
        end
      end
    end
  end
  local answer = false
  if n < 0 or not confirmed then
    -- FULL_PATH (see the header).
    answer = struct.pack('<llllll', 0, -4, 0, 0, -2, -1)
  elseif kind == BLOCK then
    -- As prelude.lua's BLOCKED: refused at a limit of 0, no wait helps.
    answer = struct.pack('<llllll', 0, 0, 0, 0, -2, 0)
  end
  return at, n, cost, record, t, want, headroom, answer, overridden, num, den
end

-- Whether a refusal with `retry` (us; -2: no wait helps, the latest of all) is reported over
-- the one found so far, whose retry is `so_far` (nil: none yet); as prelude.lua.
local function later(retry, so_far)
  return so_far == nil or (so_far ~= -2 and (retry == -2 or retry > so_far))
end
