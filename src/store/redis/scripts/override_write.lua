-- Writes one override into a hash of overrides (src/store/redis/overrides/write.rs), after
-- limits_version.lua.
--
-- Every write carries a stamp, a limits version taken before it was sent (limits_bump.lua),
-- and a hash keeps, per field, the stamp of the last write it took: a write that lands after
-- one stamped later (its reply lost, the write retried, or two operators at once) changes
-- nothing. So a write whose caller was told it may have landed never undoes a later one, and
-- a policy's override, written to every lane's hash one call each, ends alike everywhere.
--
-- A write that changes the hash also moves its generation, the field '' (never a field's
-- name: place.rs), to the Redis time in us, or one more than it was where that is not later:
-- a value the hash never held before, unless Redis's clock goes back. A removal that leaves
-- no override deletes the hash, generation and all: no hash is generation 0, no override. Decisions use an override
-- their store read earlier only while the hash is at the generation it was read at
-- (prelude.lua, "Overrides").
--
-- On a single Redis the write also raises the limits version in the same call, so that a
-- write whose reply is lost is still announced to every instance. In a Cluster the version
-- lives in its own hash slot, and the store raises it after the writes.
--
-- KEYS[1]   the hash of overrides
-- KEYS[2]   the hash's stamps (same hash tag): field -> stamp of the last write
-- KEYS[3]   (single Redis only) the limits version, raised here where the hash changed
-- ARGV[1]   the field (overrides/place.rs)
-- ARGV[2]   the value, or an empty string to remove the override
-- ARGV[3]   the write's stamp
--
-- Reply     {changed, version, epoch}: changed is 1 where the hash changed, 0 where there was
--           nothing to remove, -1 where a write stamped later was here first; version and
--           epoch are the limits version after the write where it was raised here, else 0
--           and ''

local stamp = tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if seen ~= nil and seen >= stamp then
  return {-1, 0, ''}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local changed = 1
if ARGV[2] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
if changed == 1 and ARGV[2] == '' and redis.call('HLEN', KEYS[1]) == 1
  and redis.call('HEXISTS', KEYS[1], '') == 1 then
  -- The last override gone: no hash, so that decisions read no field (generation 0).
  redis.call('DEL', KEYS[1])
elseif changed == 1 then
  local time = redis.call('TIME')
  local generation = tonumber(time[1]) * 1000000 + tonumber(time[2])
  local was = tonumber(redis.call('HGET', KEYS[1], '') or '0') or 0
  if generation <= was then
    generation = was + 1
  end
  redis.call('HSET', KEYS[1], '', string.format('%d', generation))
end
if KEYS[3] and changed == 1 then
  local version = next_version(KEYS[3])
  return {1, version, set_version(KEYS[3], version)}
end
return {changed, 0, ''}
