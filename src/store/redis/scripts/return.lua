-- Gives back leased units that were never spent (src/store/redis/lease/ says when): for each
-- key, removes them from the state they were added to, where that state still counts them.
-- Stands alone, without prelude.lua (expiry.lua, exact.lua, log_events.lua and log_lighten.lua
-- before it): it decides nothing.
--
-- KEYS[k]   the state of give-back k, as the algorithm's own script keeps it (gcra.lua,
--           fixed_window.lua, sliding_window.lua)
-- ARGV[1]   64-bit little-endian signed integers, for each give-back k in turn: algorithm
--           (FIXED_WINDOW 1, SLIDING_WINDOW 2, GCRA 3, SLIDING_LOG 4; wire/request.rs,
--           encode_return), n (number of limits), units, the Redis time (us) the lease was
--           granted at, then count, window (us) and scale (their gcd) of limits 1..n
--
-- Reply     the number of keys whose state changed
--
-- Gives back only to the state the lease was taken from: the state's header (gcra.lua,
-- common.lua) holds the Redis time it was created at and the last time a lease was taken from
-- it, and a give-back applies only where created <= granted <= last lease. State created after
-- the grant (a reset, an expiry, a restart that lost the data) never held the units; state
-- whose last lease is older than the grant (a replica promoted before the grant reached it)
-- does not hold them either. Either way the give-back is a no-op, so that units returned late
-- never free room that another instance already admitted into.
--
-- Never gives back more than the units still weigh, so that the state afterwards is at least
-- what it would be had they never been taken:
-- - counters: the units leave the window they were counted in (fixed: that window's count;
--   sliding: the current or, after one rollover, the previous count), if it is still stored;
-- - GCRA: a bucket drains whatever it holds, so units taken at t0 weigh at most
--   units * u - (now - t0) * d of its backlog now (in gcra.lua's units, u = w / scale and
--   d = c / scale); that much leaves. A backlog written under other counts is first read in
--   the lease's units (exact.lua's `reweigh`), and written back in them.
-- - the sliding log: a lease is one event at the time it was granted, and the units leave it
--   (log_lighten.lua, `lighten`). Its time is the log's header: a set made again after the
--   grant (a reset, a restart) holds no event of that microsecond, and is left alone.
-- State of another shape (the policy changed) is left alone. Writes keep the key's expiry, but
-- extend a GCRA key's where it is sooner than expiry.lua's `expires_at` for the state's new
-- stamp (now), which the plain tier's writes rely on (gcra_plain.lua, "Writes").

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local spack, sunpack = struct.pack, struct.unpack
local args, next_byte = ARGV[1], 1
-- The algorithms whose state a give-back applies to, and the integers per limit of each.
local FIXED_WINDOW, SLIDING_WINDOW, GCRA, SLIDING_LOG = 1, 2, 3, 4
local FIELDS = { [FIXED_WINDOW] = 2, [SLIDING_WINDOW] = 3, [GCRA] = 3 }
local changed = 0
local counts, windows, scales = {}, {}, {}

local function window_start(x, w)
  return x - math.fmod(x, w)
end

-- Gives `units` granted at `granted` back to the counter or GCRA state at `key` (limits in
-- `counts`, `windows`, `scales`); 1 if the state changed, else 0.
local function give_back(key, algorithm, n, units, granted)
  local fields = FIELDS[algorithm]
  local raw = redis.call('GET', key)
  local values, size = nil, 0
  if raw and fields and #raw == 8 * (fields * n + 2) then
    size = fields * n + 2
    values = { sunpack('<' .. string.rep('l', size), raw) }
    values[#values] = nil
    -- The header: created at, last lease.
    if not (values[size - 1] <= granted and granted <= values[size]) then
      values = nil
    end
  end
  if values then
    for i = 1, n do
      local c, w, at = counts[i], windows[i], (i - 1) * fields
      if algorithm == FIXED_WINDOW then
        if values[at + 1] == window_start(granted, w) then
          values[at + 2] = math.max(values[at + 2] - units, 0)
        end
      elseif algorithm == SLIDING_WINDOW then
        local start = window_start(granted, w)
        if values[at + 1] == start then
          values[at + 2] = math.max(values[at + 2] - units, 0)
        elseif values[at + 1] == start + w then
          values[at + 3] = math.max(values[at + 3] - units, 0)
        end
      elseif algorithm == GCRA then
        local u, d = w / scales[i], c / scales[i]
        local elapsed = math.max(now - values[at + 1], 0)
        local held = reweigh(values[at + 2], values[at + 3], u)
        local backlog = math.max(held - elapsed * d, 0)
        local weight = math.max(units * u - math.max(now - granted, 0) * d, 0)
        values[at + 1], values[at + 2], values[at + 3] = now, math.max(backlog - weight, 0), u
      end
    end
    local value = spack('<' .. string.rep('l', size), unpack(values))
    if algorithm == GCRA then
      -- GCRA state now stamped `now`: its key must expire no sooner than expiry.lua's
      -- `expires_at` for that stamp, as every write of GCRA state keeps it; the expiry it has
      -- (PTTL) is kept where it covers that.
      local w = windows[n]
      write_gcra(key, value, now, expires_at(now + w, w), now / 1000 + redis.call('PTTL', key))
    else
      redis.call('SET', key, value, 'KEEPTTL')
    end
    return 1
  end
  return 0
end

for k = 1, #KEYS do
  local key = KEYS[k]
  local algorithm, n, units, granted
  algorithm, n, units, granted, next_byte = sunpack('<llll', args, next_byte)
  for i = 1, n do
    counts[i], windows[i], scales[i], next_byte = sunpack('<lll', args, next_byte)
  end
  if algorithm == SLIDING_LOG then
    if redis.call('TYPE', key).ok == 'zset' and lighten(key, granted, units) > 0 then
      changed = changed + 1
    end
  else
    changed = changed + give_back(key, algorithm, n, units, granted)
  end
end

return changed
