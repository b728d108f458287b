-- Takes the stamp of a write of a policy's override (override_write.lua): the Redis time of
-- the limits version's node, and the version incremented, which orders writes of the same
-- microsecond. The time keeps stamps increasing when the version is lost (a flush, a restart
-- without persistence) while the lanes' stamps are not.
--
-- KEYS[1]   the limits version (<prefix>:{overrides}:version)
--
-- Reply     {seconds, microseconds, version}

local time = redis.call('TIME')
local version = redis.call('INCR', KEYS[1])
return {tonumber(time[1]), tonumber(time[2]), version}
