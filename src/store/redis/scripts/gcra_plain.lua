-- GCRA on the plain tier (after expiry.lua, exact.lua and plain.lua): gcra.lua's decision of a
-- look, an admission or a lease, and nothing else; src/model/gcra.rs is the same procedure and
-- explains the math. A change to gcra.lua's arithmetic is made here in the same change: the
-- differential test (src/store/redis/tests/differential.rs) runs both against the model.
--
-- KEYS[k]   request k's state, exactly as gcra.lua keeps it (t b u per limit, then the
--           creation time and the last lease's time), read and written alike
-- ARGV[1]   as plain.lua says (a plain request: what gcra.lua reads of one, and no more)
--
-- Reply     as plain.lua: six integers per request (allowed, limit index, remaining,
--           reset_after, retry_after, the overriding count), then Redis TIME and -2
--
-- Handles: LOOK, ADMIT and LEASE, now or at an event time, under the policy's counts or the
-- override's the arguments carry (a backlog written under other counts is reweighed, as
-- gcra.lua does, with exact.lua's arithmetic: deciding here costs a refused key under lowered
-- counts, which writes no state, less than sending each of its refusals to the full tier),
-- with the headroom a leasing store keeps.
-- Sends to the full tier (FULL_PATH): what plain.lua sends (settlements, slots,
-- reservations, penalty boxes, attempts, what its confirmation does not cover); no GCRA state
-- needs the full tier.
--
-- Writes: as gcra.lua for those modes, but where the key has state, an admission whose expiry
-- rounds to the one its state guarantees (expiry.lua, `expires_at`: the last write's, at least
-- its stamp plus the longest window, rounded up to an eighth of that window) keeps the key's
-- expiry (SETRANGE over its state, expiry.lua's `write_gcra`): on a key busy enough to be
-- written again within an eighth of its window, most writes, each about 7 400 Redis
-- instructions cheaper than one that sets it with PSETEX (docs/performance.md). Under an
-- override's counts (a longer expiry), or without state, the write sets the expiry. A refusal
-- extends the key's expiry (PTTL, PEXPIRE) as gcra.lua does, but only where the write that set
-- it may not cover the backlog's drain under the counts at hand: a limit written under another
-- weight, or a backlog that drains after the stamp plus the longest window (which every
-- write's expiry covers). Under the counts the state was written under, neither happens, and a
-- refusal costs one GET.

-- The largest bucket, in GCRA units (gcra.lua).
local MAX_BUCKET = 1125899906842624

-- Per limit of the request at hand: count, window, scale, backlog now, the weight of one unit
-- of cost and the drain per us, in GCRA units (entries past its n are left over, never read).
local counts, windows, scales, backlogs, weights, drains = {}, {}, {}, {}, {}, {}

-- A refused key kept for `ms` more, where its expiry is sooner (gcra.lua). It captures nothing,
-- as plain.lua's functions (functions are made anew by every call).
local function keep_for(key, ms)
  local left = redis.call('PTTL', key)
  if left >= 0 and left < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

-- Writes `value`, state stamped `stamp`, to `key`, whose state was stamped `written` (false:
-- none) under the longest window `w`, at Redis time `now`: to expire after the longest window,
-- later by a stamp past now, longer under an override's counts (gcra.lua), rounded up as
-- expiry.lua's `expires_at` says. Where the key has state and the expiry rounds to the one that
-- state guarantees, the key keeps its own (see the header; expiry.lua, `write_gcra`). It
-- captures only expiry.lua's `expires_at` and `write_gcra`.
local function write(key, value, now, stamp, written, w, stretch_num, stretch_den)
  local ttl = w + math.max(stamp - now, 0)
  local stretched = stretch_num > stretch_den
  if stretched then
    ttl = math.min(math.ceil(ttl * stretch_num / stretch_den), 1125899906842624)
  end
  local kept = written and not stretched and expires_at(written + w, w)
  write_gcra(key, value, now, expires_at(now + ttl, w), kept)
end

-- One loop besides: see plain.lua. Locals for what the loop calls in every request spare it a
-- global lookup each time.
local floor, ceil, max, min, call = math.floor, math.ceil, math.max, math.min, redis.call
for k = 1, #KEYS do
  local key = KEYS[k]
  local n, cost, record, t, want, h, answer, overridden, stretch_num, stretch_den
  next_byte, n, cost, record, t, want, h, answer, overridden, stretch_num, stretch_den =
    next_plain(requests, next_byte, confirmed, counts, windows, scales)
  if t < 0 then
    t = now
  end
  if answer then
    reply[k] = answer
  elseif n == 0 then
    -- As prelude.lua's NO_LIMITS: admitted, nothing recorded.
    reply[k] = spack('<llllll', 1, 0, 0, 0, -1, -1)
  elseif n == 1 then
    -- One limit, as most policies have: the loop below for n = 1, in locals, which costs Redis
    -- about 9 % fewer instructions a decision than the tables (examples/redis_costs.rs).
    local c, w = counts[1], windows[1]
    local u, d = w / scales[1], c / scales[1]
    if u * c > MAX_BUCKET then
      error('GCRA bucket out of range: ' .. c .. ' per ' .. w .. ' us')
    end
    local state = call('GET', key)
    local b, stamp, written, reweighed, born, leased = 0, t, false, false, now, 0
    if state and #state == 40 then
      local left, from
      written, left, from, born, leased = sunpack('<lllll', state)
      stamp = max(t, written)
      if from ~= u then
        left, reweighed = reweigh(left, from, u), true
      end
      b = max(left - max(t - written, 0) * d, 0)
    end
    local capacity = (w - h) * d
    local new = b + cost * u
    local allowed, retry = 1, -1
    if new > capacity then
      allowed, retry = 0, -2
      if cost * u <= capacity then
        retry = ceil((new - capacity) / d)
      end
      -- The expiry, as the loop below.
      local drained = ceil(b / d)
      if written and (reweighed or t + drained > written + w) then
        keep_for(key, ceil(drained / 1000))
      end
    elseif record ~= LOOK then
      if record == LEASE then
        local take = min(want, floor((capacity - b) / u))
        allowed, cost, leased = 1 + take - cost, take, now
      end
      b = min(b + cost * u, MAX_UNITS)
      -- As `write` above, inline (a call of a Lua function costs Redis more than this whole
      -- expiry): expiry.lua's `expires_at` in us, for the time the write needs and for the one
      -- the state's stamp guarantees, and its `write_gcra`.
      local value = spack('<lllll', stamp, b, u, born, leased)
      local quantum = (w - w % 8000) / 8
      if quantum < 1000 then
        quantum = 1000
      end
      local at = now + w + max(stamp - now, 0) + quantum - 1
      at = at - at % quantum
      local kept = written and written + w + quantum - 1
      if stretch_num > stretch_den then
        write(key, value, now, stamp, false, w, stretch_num, stretch_den)
      elseif kept and at <= kept - kept % quantum then
        call('SETRANGE', key, '0', value)
      else
        call('PSETEX', key, text((at - now + now % 1000) / 1000), value)
      end
    end
    reply[k] = spack('<llllll', allowed, 0, max(floor((capacity - b) / u), 0), ceil(b / d), retry,
      overridden and c or -1)
  else
    -- Two limits or more.
    local state = call('GET', key)
    if state and #state ~= 24 * n + 16 then
      state = nil
    end

    -- Each limit's backlog at t, and the limit that refuses with the latest retry; `room`, the
    -- fewest whole units that fit in any limit (a lease's); the stamp to write (t, or the
    -- state's own where later), the state's own (`written`, false: none), and whether a limit
    -- was written under another weight (reweighed, as gcra.lua).
    local state_byte, stamp, written, reweighed = 1, t, false, false
    local denied, denied_retry, room = nil, nil, nil
    for i = 1, n do
      local c, w, g = counts[i], windows[i], scales[i]
      local u, d = w / g, c / g
      weights[i], drains[i] = u, d
      if u * c > MAX_BUCKET then
        error('GCRA bucket out of range: ' .. c .. ' per ' .. w .. ' us')
      end
      local b = 0
      if state then
        local at, left, from
        at, left, from, state_byte = sunpack('<lll', state, state_byte)
        stamp, written = max(stamp, at), at
        if from ~= u then
          left, reweighed = reweigh(left, from, u), true
        end
        b = max(left - max(t - at, 0) * d, 0)
      end
      backlogs[i] = b
      local capacity = (w - h) * d
      local new = b + cost * u
      if new > capacity then
        local retry = -2
        if cost * u <= capacity then
          retry = ceil((new - capacity) / d)
        end
        if later(retry, denied_retry) then
          denied, denied_retry = i, retry
        end
      elseif record == LEASE then
        local fit = floor((capacity - b) / u)
        if room == nil or fit < room then
          room = fit
        end
      end
    end
    -- The header: when the state was created, when a lease was last taken from it.
    local born, leased = now, 0
    if state then
      born, leased = sunpack('<ll', state, state_byte)
    end

    local allowed, reported, retry = 0, denied, denied_retry
    if denied ~= nil and state then
      -- Refused: the key kept until its backlog drains under the counts at hand (gcra.lua),
      -- where the expiry the last write set (at least the longest window after the state's
      -- stamp) may not cover that.
      local drained = 0
      for i = 1, n do
        drained = max(drained, ceil(backlogs[i] / drains[i]))
      end
      if reweighed or t + drained > written + windows[n] then
        keep_for(key, ceil(drained / 1000))
      end
    end
    if denied == nil then
      allowed, retry = 1, -1
      if record ~= LOOK then
        if record == LEASE then
          local take = min(want, room)
          allowed, cost, leased = 1 + take - cost, take, now
        end
        local parts = {}
        for i = 1, n do
          backlogs[i] = min(backlogs[i] + cost * weights[i], MAX_UNITS)
          parts[i] = spack('<lll', stamp, backlogs[i], weights[i])
        end
        parts[n + 1] = spack('<ll', born, leased)
        write(key, table.concat(parts), now, stamp, written, windows[n], stretch_num, stretch_den)
      end
      local least
      for i = 1, n do
        local remaining = floor(((windows[i] - h) * drains[i] - backlogs[i]) / weights[i])
        if least == nil or remaining < least then
          least, reported = remaining, i
        end
      end
    end
    local w, b = windows[reported], backlogs[reported]
    local u, d = weights[reported], drains[reported]
    reply[k] = spack('<llllll', allowed, reported - 1, max(floor(((w - h) * d - b) / u), 0),
      ceil(b / d), retry, overridden and counts[reported] or -1)
  end
end

reply[#reply + 1] = spack('<ll', now, NOT_READ)
return table.concat(reply)
