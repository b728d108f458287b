-- The line of reservations of one key (src/store/reserve.rs, Reserve; src/model/line.rs is
-- the same in Rust, for the memory store, and says why the line exists). It decides nothing:
-- the algorithm's script records a reservation's units at its turn (RESERVE, prelude.lua,
-- where `join_line` puts it in line); this one looks it up, takes it out, and pauses the key.
--
-- KEYS[1]  the key's state key. Its line is the sorted set `<KEYS[1]>:turns`: one member per
--          reservation waiting, `<id>:<cost>:<notice>` (notice: us, it moves only into places
--          at least that far from the time of the move), scored by its turn (Redis time in
--          us); its
--          pause the string `<KEYS[1]>:pause`, the Redis time (us) the pause ends (same hash
--          slot: the key's hash tag)
-- ARGV[1]  the operation: 'look', 'leave', 'pause' or 'many'
-- ARGV[2]  look and leave: the reservation's member; pause: the pause's length (us, decimal);
--          many: the first of the reservations' members (ARGV[2..])
-- ARGV[3]  look: its late (us): how far ahead of now its turn may be to be taken out
--
-- look:  the reservation's turn; one whose turn is at most its late ahead of now leaves the
--        line, used (its caller sleeps the rest and goes).
-- many:  the turns of the reservations, taking none out.
-- leave: takes the reservation out. From its place on, each later reservation of its cost
--        moves up into the place the one before it left, while that place is at least the
--        mover's notice from now (its caller learns of the move at its next look, and must be
--        in time) and not before the pause's end; the place left at the end is
--        answered, for the store to give its units back (a refund of the algorithm's script,
--        at that time), where no reservation in line is at or after it.
-- pause: the key is paused until now + length, unless a longer pause holds; reservations
--        made meanwhile take turns after it (RESERVE reads it), those in line learn it when
--        they look.
--
-- Reply: {turn, past, paused, free, last}: turn, us from now until the reservation's turn (0
--        once it has come; for leave, where it stood), -1 when it is not in line (and for
--        pause); past, us from the turn to now (0 while it is ahead or not in line); paused, us until the key's pause ends (0: none); free, the Redis time (us) of the
--        place left at the end (leave only; -1 otherwise); last, 1 where no reservation in line
--        comes after that place (the store gives its units back on the sliding log, and on
--        GCRA only where it is the last: src/model/line.rs, Left).
--        many: {paused, turn, past, turn, past, ...}, a turn and past per member in order.

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
  return {-1, 0, math.max(pause - now, 0), -1, 0}
end

local paused = math.max(pause - now, 0)
if op == 'many' then
  local reply = {paused}
  for i = 2, #ARGV do
    local at = redis.call('ZSCORE', line, ARGV[i])
    if at then
      at = tonumber(at)
      reply[#reply + 1] = math.max(at - now, 0)
      reply[#reply + 1] = math.max(now - at, 0)
    else
      reply[#reply + 1] = -1
      reply[#reply + 1] = 0
    end
  end
  return reply
end
local at = redis.call('ZSCORE', line, arg)
if not at then
  return {-1, 0, paused, -1, 0}
end
at = tonumber(at)
if op == 'look' then
  if at <= now + tonumber(ARGV[3]) then
    redis.call('ZREM', line, arg)
  end
  return {math.max(at - now, 0), math.max(now - at, 0), paused, -1, 0}
end

redis.call('ZREM', line, arg)
local cost = string.match(arg, '^%d+:(%d+):')
local free = at
if free >= pause then
  local later = redis.call('ZRANGEBYSCORE', line, '(' .. digits(at), '+inf', 'WITHSCORES')
  for i = 1, #later, 2 do
    local member, turn = later[i], tonumber(later[i + 1])
    local c, notice = string.match(member, '^%d+:(%d+):(%d+)$')
    if c ~= cost or free < now + tonumber(notice) then
      break
    end
    redis.call('ZADD', line, digits(free), member)
    free = turn
  end
end
-- Whether a reservation in line comes after the place left (src/model/line.rs, Left: GCRA
-- gives back only the last place).
local last = 1
if redis.call('ZCOUNT', line, '(' .. digits(free), '+inf') > 0 then
  last = 0
end
return {math.max(at - now, 0), math.max(now - at, 0), paused, free, last}
