-- The line of reservations of one key (src/store/reserve.rs, Reserve; src/store/line.rs is
-- the same in Rust, for the memory store, and says why the line exists). It decides nothing:
-- the algorithm's script records a reservation's units at its turn (RESERVE, prelude.lua,
-- where `join_line` puts it in line); this one looks it up, takes it out, and pauses the key.
--
-- KEYS[1]  the key's state key. Its line is the sorted set `<KEYS[1]>:turns`: one member per
--          reservation waiting, `<id>:<cost>`, scored by its turn (Redis time in us); its
--          pause the string `<KEYS[1]>:pause`, the Redis time (us) the pause ends (same hash
--          slot: the key's hash tag)
-- ARGV[1]  the operation: 'look', 'leave' or 'pause'
-- ARGV[2]  look and leave: the reservation's member; pause: the pause's length (us, decimal)
-- ARGV[3]  leave: its notice (us, decimal): nobody moves into a place sooner than that from
--          now (the callers that move learn it at their next look, and must be in time)
--
-- look:  the reservation's turn; one whose turn has come leaves the line, used (its caller
--        goes now).
-- leave: takes the reservation out. From its place on, each later reservation of its cost
--        moves up into the place the one before it left, where that place is at least the
--        notice from now and not before the pause's end; the place left at the end is
--        answered, for the store to give its units back (a refund of the algorithm's script,
--        at that time), where no reservation in line is at or after it.
-- pause: the key is paused until now + length, unless a longer pause holds; reservations
--        made meanwhile take turns after it (RESERVE reads it), those in line learn it when
--        they look.
--
-- Reply: {turn, paused, free}: turn, us from now until the reservation's turn (0 once it has
--        come; for leave, where it stood), -1 when it is not in line (and for pause); paused,
--        us until the key's pause ends (0: none); free, the Redis time (us) of the place left
--        at the end to give back (leave only; -1 otherwise, and where it is not the last).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local line, pause_key = KEYS[1] .. ':turns', KEYS[1] .. ':pause'
local op, arg = ARGV[1], ARGV[2]
local pause = tonumber(redis.call('GET', pause_key) or '0')

local function digits(x)
  return string.format('%d', x)
end

if op == 'pause' then
  local ends = now + tonumber(arg)
  if ends > pause then
    redis.call('SET', pause_key, digits(ends), 'PX', digits(math.ceil(tonumber(arg) / 1000) + 1))
    pause = ends
  end
  return {-1, math.max(pause - now, 0), -1}
end

local paused = math.max(pause - now, 0)
local at = redis.call('ZSCORE', line, arg)
if not at then
  return {-1, paused, -1}
end
at = tonumber(at)
if op == 'look' then
  if at <= now then
    redis.call('ZREM', line, arg)
  end
  return {math.max(at - now, 0), paused, -1}
end

redis.call('ZREM', line, arg)
local cost = string.match(arg, ':(%d+)$')
local free = at
if free >= now + tonumber(ARGV[3]) and free >= pause then
  local later = redis.call('ZRANGEBYSCORE', line, '(' .. digits(at), '+inf', 'WITHSCORES')
  for i = 1, #later, 2 do
    local member, turn = later[i], tonumber(later[i + 1])
    if string.match(member, ':(%d+)$') ~= cost then
      break
    end
    redis.call('ZADD', line, digits(free), member)
    free = turn
  end
end
-- A place left with reservations after it stays recorded, unused: giving it back would let
-- GCRA place the next reservation at the time of one already made after it.
if redis.call('ZCOUNT', line, digits(free), '+inf') > 0 then
  free = -1
end
return {math.max(at - now, 0), paused, free}
