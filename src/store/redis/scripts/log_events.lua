-- The sliding log's events: how a member of its sorted set spells one (log_lighten.lua makes
-- them lighter). Shared by sliding_log.lua (after prelude.lua), sliding_log_plain.lua (after
-- plain.lua) and return.lua (which gives leased units back), so that all read and write the
-- set alike; decides nothing. The locals below serve the files after it too.
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
