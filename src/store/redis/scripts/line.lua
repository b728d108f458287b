-- The line of reservations of one key (src/store/reserve.rs, Reserve; src/model/line.rs is
-- the same in Rust, for the memory store, and says why the line exists). It decides nothing:
-- the algorithm's script records a reservation's units at its turn (RESERVE, prelude.lua,
-- where `join_line` puts it in line); this one looks it up, takes it out, and pauses the key.
--
-- The places and the reservations are kept apart, so that moving everyone behind a leaver up
-- one place is one removal (of the last place), and every operation is a constant number of
-- commands, each O(log n): a reservation's turn is the place of its rank.
--
-- KEYS[1]  the key's state key. Beside it (same hash slot: the key's hash tag):
--          `<KEYS[1]>:line`    sorted set, the reservations in the order they joined: member
--                              `<id>:<cost>`, scored by its join's sequence number
--          `<KEYS[1]>:places`  sorted set, the places (turns recorded): scored by their Redis
--                              time (us), member the sequence number of the reservation that
--                              joined with it, 16 digits (one instant's places sort by join);
--                              the reservation of rank r in the line has the place of rank r
--          `<KEYS[1]>:notices` sorted set, member `<id>:<cost>` scored by its notice (us: it
--                              moves only into places at least that far from the time of the
--                              move); the line's notice is the longest
--          `<KEYS[1]>:costs`   hash, cost -> how many reservations of that cost are in line
--          `<KEYS[1]>:pause`   string, the Redis time (us) the key's pause ends
-- ARGV[1]  the operation: 'look', 'leave', 'pause' or 'many'
-- ARGV[2]  look and leave: the reservation's member; pause: the pause's length (us, decimal);
--          many: the first of the reservations' members (ARGV[2..])
-- ARGV[3]  look: its late (us)
--
-- look:  the reservation's turn; one whose turn is at most its late ahead of now, and not
--        before the pause's end, leaves the line, used, with its own place (its caller sleeps
--        the rest and goes; one whose turn the pause covers reserves again, and leaves).
-- many:  the turns of the reservations, taking none out.
-- leave: takes the reservation out, and either the last place (those behind it move up one
--        place each) where its own place is at least the line's notice (the longest notice of
--        the reservations left in line) from now, not before the pause's end, and every
--        reservation left in line is of its cost; or else its own place (nobody moves). The
--        place that went is answered, for the store to give its units back (a refund of the
--        algorithm's script, at that time).
-- pause: the key is paused until now + length, unless a longer pause holds; reservations
--        made meanwhile take turns after it (RESERVE reads it), those in line learn it when
--        they look.
--
-- Reply: {turn, past, paused, free, last}: turn, us from now until the reservation's turn (0
--        once it has come; for leave, where it stood), -1 when it is not in line (and for
--        pause); past, us from the turn to now (0 while it is ahead or not in line); paused,
--        us until the key's pause ends (0: none); free, the Redis time (us) of the place that
--        went (leave only; -1 otherwise); last, 1 where no place in line is after it (the
--        store gives its units back on the sliding log, and on GCRA only where it is the last:
--        src/model/line.rs, Left).
--        many: {paused, turn, past, turn, past, ...}, a turn and past per member in order.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local line, places = KEYS[1] .. ':line', KEYS[1] .. ':places'
local notices, costs = KEYS[1] .. ':notices', KEYS[1] .. ':costs'
local pause_key = KEYS[1] .. ':pause'
local op, arg = ARGV[1], ARGV[2]
local pause = tonumber(redis.call('GET', pause_key) or '0')

local function digits(x)
  return string.format('%d', x)
end

-- The rank of `member` in line and its place (time, label), or nil.
local function placed(member)
  local rank = redis.call('ZRANK', line, member)
  if not rank then
    return nil
  end
  local place = redis.call('ZRANGE', places, rank, rank, 'WITHSCORES')
  return rank, tonumber(place[2]), place[1]
end

-- Takes `member` (of `cost`) out of the line, not its place.
local function out_of_line(member, cost)
  redis.call('ZREM', line, member)
  redis.call('ZREM', notices, member)
  if redis.call('HINCRBY', costs, cost, -1) <= 0 then
    redis.call('HDEL', costs, cost)
  end
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
    local _, at = placed(ARGV[i])
    if at then
      reply[#reply + 1] = math.max(at - now, 0)
      reply[#reply + 1] = math.max(now - at, 0)
    else
      reply[#reply + 1] = -1
      reply[#reply + 1] = 0
    end
  end
  return reply
end

local rank, at, label = placed(arg)
if not rank then
  return {-1, 0, paused, -1, 0}
end
local cost = string.match(arg, '^%d+:(%d+)$')
local stood = {math.max(at - now, 0), math.max(now - at, 0), paused}
if op == 'look' then
  if at <= now + tonumber(ARGV[3]) and at >= pause then
    out_of_line(arg, cost)
    redis.call('ZREM', places, label)
  end
  return {stood[1], stood[2], stood[3], -1, 0}
end

out_of_line(arg, cost)
local longest = redis.call('ZRANGE', notices, -1, -1, 'WITHSCORES')
local notice = tonumber(longest[2] or '0')
local kinds = redis.call('HLEN', costs)
local one_cost = kinds == 0 or (kinds == 1 and redis.call('HEXISTS', costs, cost) == 1)
local free = at
if at >= pause and at >= now + notice and one_cost then
  local last_place = redis.call('ZRANGE', places, -1, -1, 'WITHSCORES')
  free, label = tonumber(last_place[2]), last_place[1]
end
redis.call('ZREM', places, label)
local last = 1
if redis.call('ZCOUNT', places, '(' .. digits(free), '+inf') > 0 then
  last = 0
end
return {stood[1], stood[2], stood[3], free, last}
