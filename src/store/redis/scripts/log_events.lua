-- The sliding log's events: how a member of its sorted set spells one, and how events are made
-- lighter. Shared by sliding_log.lua (after prelude.lua) and return.lua (which gives leased
-- units back), so that both read and rewrite the set alike; decides nothing.
--
-- A key  a sorted set; one member per admitted request (or lease), score = event time in us,
--        member = "<time>:<total>:<weight>": weight is the event's units (>= 1), total the
--        running total of the weights of the set's events up to and including this one, in
--        time order (events of one microsecond in the order they were added), written as 16
--        zero-padded digits so that the members of one microsecond sort in that order and
--        never collide. The units in a score range are the total of its last member minus
--        the total before its first (total - weight): two members, however many units.

local call = redis.call
local find, sub, max, min, format = string.find, string.sub, math.max, math.min, string.format

-- Time, total and weight of the member "<time>:<total>:<weight>". Reading them from the
-- member instead of asking for scores spares Redis printing a double and Lua parsing it. The
-- digits of an event are made numbers by arithmetic (`+ 0`), which costs Lua less than half
-- what `tonumber` does (a global call that checks its base); an earlier version's member
-- ("<time>:<n>", see `is_event`) reads as 0 where a field is missing.
local function event(member)
  local a = find(member, ':', 1, true)
  if #member >= a + 18 then
    return sub(member, 1, a - 1) + 0, sub(member, a + 1, a + 16) + 0, sub(member, a + 18) + 0
  end
  return sub(member, 1, a - 1) + 0, tonumber(sub(member, a + 1, a + 16)) or 0, 0
end

-- Whether `member` spells an event as above (an earlier version kept "<time>:<n>", one
-- member per unit).
local function is_event(member)
  return #member >= find(member, ':', 1, true) + 18
end

local function member(time, total, weight)
  return text(time) .. ':' .. format('%016d', total) .. ':' .. text(weight)
end

-- Moves the totals of `members` by delta: all are removed before any is added back, since a
-- moved member may spell one not moved yet.
local function shift(key, members, delta)
  for j = 1, #members, 1000 do
    call('ZREM', key, unpack(members, j, min(j + 999, #members)))
  end
  local batch = {}
  for j = 1, #members do
    local e, total, weight = event(members[j])
    batch[#batch + 1] = text(e)
    batch[#batch + 1] = member(e, total + delta, weight)
    if #batch >= 2000 or j == #members then
      call('ZADD', key, unpack(batch))
      batch = {}
    end
  end
end

-- Takes up to `units` off the events of time `at` (us), the last added first, and as much off
-- the totals of every member after them; an event left weighing nothing is removed. Units of
-- one microsecond weigh alike in every window, so which of its events gives them does not
-- matter. Returns the units taken (0 when no event has that time: it has aged out, or the set
-- was made again since). Writes keep the key's expiry.
local function lighten(key, at, units)
  local time = text(at)
  local same = call('ZRANGEBYSCORE', key, time, time)
  -- What each event of the microsecond gives, the last first.
  local gives, taken, from = {}, 0, nil
  for j = #same, 1, -1 do
    if taken >= units then
      break
    end
    if is_event(same[j]) then
      local _, _, weight = event(same[j])
      gives[j] = min(units - taken, weight)
      taken, from = taken + gives[j], j
    end
  end
  if taken == 0 then
    return 0
  end
  -- The microsecond's events from the first that gives are written again, lighter and with
  -- their totals less what the ones before them gave; everything after moves by the whole.
  local rewrite, given = {}, 0
  for j = from, #same do
    if gives[j] then
      rewrite[#rewrite + 1] = same[j]
    end
  end
  call('ZREM', key, unpack(rewrite))
  for j = from, #same do
    local give = gives[j]
    if give then
      local e, total, weight = event(same[j])
      given = given + give
      if weight > give then
        call('ZADD', key, time, member(e, total - given, weight - give))
      end
    end
  end
  shift(key, call('ZRANGEBYSCORE', key, '(' .. time, '+inf'), -taken)
  return taken
end
