-- Takes the stamp of a write of a policy's override (override_write.lua): a time and the
-- limits version incremented, which orders writes of one microsecond. The time is Redis TIME
-- of this node, but never earlier than the last stamp's (kept beside the version): after a
-- failover to a replica whose clock is behind, or a clock step, stamps still increase, so a
-- later write is never taken for an earlier one.
--
-- KEYS[1]   the limits version (<prefix>:{overrides}:version)
-- KEYS[2]   the last stamp's time, "<seconds>:<microseconds>" (same hash tag)
--
-- Reply     {seconds, microseconds, version}

local time = redis.call('TIME')
local s, us = tonumber(time[1]), tonumber(time[2])
local last = redis.call('GET', KEYS[2])
if last then
  local ls, lus = string.match(last, '^(%d+):(%d+)$')
  ls, lus = tonumber(ls), tonumber(lus)
  if ls and (ls > s or (ls == s and lus >= us)) then
    s, us = ls, lus + 1
    if us >= 1000000 then
      s, us = s + 1, 0
    end
  end
end
redis.call('SET', KEYS[2], s .. ':' .. us)
local version = redis.call('INCR', KEYS[1])
return {s, us, version}
