-- Writes one override into a hash of overrides (src/store/redis/overrides/mod.rs), after
-- limits_version.lua. On a single Redis the write changes the limits version in the same call,
-- so that a write whose reply is lost is still announced to every instance. In a Cluster the
-- version lives in its own hash slot: the store takes a stamp there first (limits_bump.lua)
-- and announces after the writes.
--
-- A policy's override is written to every lane's hash, one call each; two operators writing
-- at once could otherwise leave some lanes with one's value and the rest with the other's. So
-- such a write carries its stamp and a lane keeps the stamp of the last write it took, per
-- field: every lane ends with the value of the write with the highest stamp.
--
-- KEYS[1]   the hash of overrides
-- KEYS[2]   the hash's stamps (same hash tag): field -> stamp of the last write
-- KEYS[3]   (single Redis only) the limits version: the stamp is taken, and the version
--           changed, here
-- ARGV[1]   the field
-- ARGV[2]   the value, or an empty string to remove the override
-- ARGV[3]   the write's stamp (a limits version; ignored with KEYS[3])
-- ARGV[4]   1 to keep the stamp (a policy's override), 0 not to (a key's: one hash, the last
--           write to arrive wins)
--
-- Reply     {changed, version, epoch}: changed is 1 where the hash changed, 0 where there was
--           nothing to remove, -1 where a later write was here first; version and epoch are
--           the limits version after the write where it was changed here, else 0 and ''

local stamp = tonumber(ARGV[3])
if KEYS[3] then
  stamp = next_version(KEYS[3])
end
if ARGV[4] == '1' then
  local seen = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
  if seen ~= nil and seen >= stamp then
    return {-1, 0, ''}
  end
  redis.call('HSET', KEYS[2], ARGV[1], string.format('%d', stamp))
end
local changed = 1
if ARGV[2] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
if KEYS[3] and changed == 1 then
  return {1, stamp, set_version(KEYS[3], stamp)}
end
return {changed, 0, ''}
