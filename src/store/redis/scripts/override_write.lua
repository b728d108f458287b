-- Writes a policy's override into one lane's hash of overrides (src/store/redis/overrides.rs),
-- unless a later write has reached that hash first. A policy's override is written to every
-- lane's hash, one call each; two operators writing at once could otherwise leave some lanes
-- with one's value and the rest with the other's. Each write carries a stamp
-- (override_stamp.lua, taken before it starts), and a lane keeps the stamp of the last write
-- it took, so every lane ends with the value of the write with the highest stamp.
--
-- KEYS[1]   the lane's hash of overrides
-- KEYS[2]   the lane's hash of stamps (same hash tag): field -> stamp of the last write
-- ARGV[1]   the field (the plan's or the policy-wide one, overrides/place.rs)
-- ARGV[2]   the value, or an empty string to remove the override
-- ARGV[3..5] the write's stamp: seconds, microseconds, version; compared in that order
--
-- Reply     1: the hash changed; 0: nothing to remove; -1: a later write was here first

local stamp = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
local seen = redis.call('HGET', KEYS[2], ARGV[1])
if seen then
  local s, us, v = string.match(seen, '^(%d+):(%d+):(%d+)$')
  local before = {tonumber(s), tonumber(us), tonumber(v)}
  for i = 1, 3 do
    if before[i] ~= stamp[i] then
      if before[i] > stamp[i] then
        return -1
      end
      break
    end
    if i == 3 then
      return -1
    end
  end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ':' .. ARGV[4] .. ':' .. ARGV[5])
if ARGV[2] == '' then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
