-- The limits version (src/store/redis/overrides/version.rs), shared by limits_bump.lua and
-- override_write.lua, which are this file followed by their own text.
--
-- The version is a hash at <prefix>:{overrides}:limits with two fields:
--   epoch     Redis TIME ("<seconds>.<microseconds>") when the hash was made. A restart
--             without persistence or a flush loses the hash with the overrides, and the next
--             change makes a new epoch, so an instance that saw the old one knows the
--             overrides it followed are gone, and never takes a new count for one it has seen.
--   version   microseconds of Redis TIME at the last change, never less than the one before
--             plus 1: it orders writes (override_write.lua's stamps) and increases even where
--             the clock of a new primary is behind.

-- The version the next change takes, without writing it.
local function next_version(key)
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
  local last = tonumber(redis.call('HGET', key, 'version') or '0')
  if last ~= nil and last >= now then
    now = last + 1
  end
  return now
end

-- Makes `version` the hash's version (an epoch first, where the hash is new); the epoch.
local function set_version(key, version)
  local time = redis.call('TIME')
  redis.call('HSETNX', key, 'epoch', time[1] .. '.' .. time[2])
  redis.call('HSET', key, 'version', string.format('%d', version))
  return redis.call('HGET', key, 'epoch')
end
