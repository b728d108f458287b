-- The sliding log's events made lighter: a refund of a request admitted from the log, and a
-- lease's give-back, take units off the events of a time (`lighten`). After log_events.lua,
-- whose members it reads and spells, in sliding_log.lua's script (after prelude.lua) and in
-- return.lua's; the plain tier, which records but never refunds, goes without it (plain.lua,
-- "Cost"). Decides nothing; uses log_events.lua's locals (`call`, `min`, `event`, ...).

-- Removing every member of a set deletes the set with its expiry, and members added back
-- make it again without one, to last for ever: gives such a set back the expiry `ttl` (ms,
-- PTTL before the removal), from now, so no sooner than it had. PTTL is 0 in a key's last ms,
-- when it still exists: PEXPIRE 0 then deletes the set, as its expiry would have a moment
-- later.
local function restore_expiry(key, ttl)
  if ttl >= 0 and call('PTTL', key) == -1 then
    call('PEXPIRE', key, ttl)
  end
end

-- Moves the totals of `members` by delta: all are removed before any is added back, since a
-- moved member may spell one not moved yet. The set keeps its expiry, or gets back `ttl`
-- where given (PTTL before the caller's own rewrites of the set began).
local function shift(key, members, delta, ttl)
  if #members == 0 then
    if ttl then
      restore_expiry(key, ttl)
    end
    return
  end
  ttl = ttl or call('PTTL', key)
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
  restore_expiry(key, ttl)
end

-- Takes up to `units` off the events of time `at` (us), the last added first, and as much off
-- the totals of every member after them; an event left weighing nothing is removed. Units of
-- one microsecond weigh alike in every window, so which of its events gives them does not
-- matter. Returns the units taken (0 when no event has that time: it has aged out, or the set
-- was made again since). Writes keep the key's expiry, even where they empty the set before
-- they fill it again.
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
  local ttl = call('PTTL', key)
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
  shift(key, call('ZRANGEBYSCORE', key, '(' .. time, '+inf'), -taken, ttl)
  return taken
end
