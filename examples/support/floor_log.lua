-- The floor of a sliding-log decision in a script (examples/redis_costs.rs): what the plain
-- tier's script (src/store/redis/scripts/sliding_log_plain.lua) asks of Redis to admit a
-- request of one limit of a second on a key with events in its window, and nothing else. It
-- reads no arguments, decides nothing and parses no member, so no script that makes these
-- commands costs Redis less.
--
-- KEYS[k]   a sorted set: its newest event (ZRANGE -1 -1), the first in the last second
--           (ZRANGEBYSCORE LIMIT 0 1) and an event added at now (ZADD, a member spelt as
--           log_events.lua spells one); no PEXPIREAT, as the plain tier sends none where the
--           newest event is in the same eighth of the window (sliding_log_plain.lua, "Expiry")
-- ARGV      none
-- Reply     48 bytes per key, then 16, as floor_gcra.lua

local time = redis.call('TIME')
local now = string.format('%d%06d', time[1], time[2])
local from = string.format('%d', now - 999999)
local member = now .. ':0000000000000001:1'
local reply = {}
for k = 1, #KEYS do
  local key = KEYS[k]
  redis.call('ZRANGE', key, '-1', '-1')
  redis.call('ZRANGEBYSCORE', key, from, now, 'LIMIT', '0', '1')
  redis.call('ZADD', key, now, member)
  reply[k] = '012345678901234567890123456789012345678901234567'
end
reply[#reply + 1] = '0123456789012345'
return table.concat(reply)
