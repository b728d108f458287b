-- GCRA, the leaky bucket; src/model/gcra.rs is the same procedure and explains the math.
--
-- Appended to prelude.lua without common.lua's driver: GCRA is the algorithm for the busiest
-- paths, and the driver (closures, a table per request for its state) costs about a third of a
-- decision's work in Redis. It combines limits exactly as the driver's `decide` does.
--
-- KEYS[k]   request k's state: 64-bit little-endian integers t1 b1 u1 t2 b2 u2 ...; for limit
--           i, the time of the last write (us), the backlog it left, in GCRA units of
--           scale/count us (gcra.rs: one unit of cost weighs u = window/scale of them, and
--           count/scale drain per us), and the u of the counts it was written under; then a
--           header of two: the Redis time (us) the state was created at and the last time a
--           lease was taken from it (0: never), which refunds and return.lua check. State of
--           another length counts as none.
-- ARGV[1]   as prelude.lua: 64-bit little-endian signed integers, for each request in turn n,
--           cost, record (LOOK, ADMIT, LEASE, SETTLE or TAKE), event time (-1: now; GCRA
--           takes no other), override id, penalty box (us), policy-wide and plan override
--           fields, known and the kind of the override the store knew (prelude.lua,
--           "Overrides"), for a lease want and headroom (us), for a settlement refund,
--           admission time and the units recorded then, count, window (us) and scale of
--           limits 1..n, shortest first, then for known counts the override's (prelude.lua);
--           ARGV[2] and after as prelude.lua
--
-- Reply     as prelude.lua: one string of 64-bit little-endian signed integers, six per
--           request: allowed (0 refused, else 1 + units leased beyond the cost), limit index
--           (0-based), remaining, reset_after (us), retry_after (us; -1 when admitted, -2
--           when no wait helps), the overriding count (-1: none); then Redis TIME, the
--           generation of the hash of overrides, a byte per slot operation, and the override
--           fields read (prelude.lua)
--
-- Headroom h: a store that leases keeps h of drain free in every bucket (capacity (w - h) * d
-- instead of w * d), because leased units may be spent up to h after they were taken; the
-- bucket then never holds more than its size of units as they were spent. Peeks carry the
-- same h (prelude.lua), and `remaining` counts against the same capacity, so that what a peek
-- and a refusal report agrees with what a decision admits.
--
-- Settlements: a charge is recorded as an admitted request, whatever the limits say
-- (TAT = max(TAT, now) + n T, so a bucket may hold more than its size), the backlog saturating
-- at MAX_UNITS (at least three buckets: policy.rs keeps a bucket within 2^50). A refund takes
-- its units off every backlog as far as they still weigh, units * u - (now - admitted) * d
-- (what has drained since the admission is not taken twice), not below empty, and only from
-- state created no later than the admission (a reset or a restart since turns it into a
-- no-op); it writes nothing where there is no state or no admission time.
--
-- Other counts (Policy::with_limits, the same windows): a backlog written under another u
-- holds b / u units of cost; it is read as as many units of the counts at hand, rounded up
-- (exact.lua's `reweigh`), and drains at their rate from the last write on.
--
-- Exactness: a bucket is at most 2^50 units and a backlog at most MAX_UNITS (2^52), so every
-- sum and difference here stays below 2^53, and so does every numerator divided: a double
-- quotient a / b of such integers is never rounded across an integer (when it is not one, it
-- is at least 1 / b from one, more than its rounding error a / b * 2^-53), so math.floor and
-- math.ceil of it are exact. A drain `elapsed * d` past 2^53 is inexact, but then larger than
-- any backlog, which it empties either way.
--
-- Writes: an admitted request, or a settlement, stores every limit's new backlog and sets the
-- key to expire once every bucket has drained: after the longest window, or longer where a
-- charge overfilled a bucket, or where an override's counts decided (its units weigh more
-- under the policy's own, once it is removed: prelude.lua, `stretch_num`); that time rounded
-- up as expiry.lua's `expires_at` says.
-- A refusal extends the key's expiry to when its backlog drains under the counts at hand,
-- where that is later (counts lower than those it was written under).

-- The largest bucket, in GCRA units (2^50; MAX_GCRA_BUCKET in src/model/mod.rs): past it
-- the arithmetic would not be exact, so such a request is an error (the policy refuses it).
local MAX_BUCKET = 1125899906842624

-- Per limit of the request at hand (entries past its n are left over and never read).
-- Per limit, also the weight of one unit of cost and the drain per us, in GCRA units (gcra.rs),
-- computed once per request.
local counts, windows, scales, backlogs, weights, drains = {}, {}, {}, {}, {}, {}

for k = 1, REQUESTS do
  local key = KEYS[k]
  local n, cost, record, t, want, h, refund, admitted, _, blocked =
    next_request(counts, windows, scales, k)
  if blocked then
    reply[k] = blocked
  elseif n == 0 then
    reply[k] = conclude(k, NO_LIMITS)
  else
    local state = redis.call('GET', key)
    if state and #state ~= 24 * n + 16 then
      state = nil
    end

    -- Each limit's backlog now, and the limit that refuses with the latest retry (-2, no wait
    -- helps, is the latest of all); `room`, the fewest whole units that fit in any limit.
    local state_byte = 1
    local denied, denied_retry, room = nil, nil, nil
    -- The time the state is written at: `t`, or the state's own where that is later (made for
    -- the end of a pause, prelude.lua RESERVE), whose backlog has not drained at all by `t`,
    -- so that it drains from there and not from `t`.
    local stamp, written = t, false
    for i = 1, n do
      local c, w, g, at, left = counts[i], windows[i], scales[i]
      local u, d = w / g, c / g
      weights[i], drains[i] = u, d
      if u * c > MAX_BUCKET then
        error('GCRA bucket out of range: ' .. c .. ' per ' .. w .. ' us')
      end
      local b = 0
      if state then
        local from
        at, left, from, state_byte = sunpack('<lll', state, state_byte)
        stamp, written = math.max(stamp, at), at
        if from ~= u then
          left = reweigh(left, from, u)
        end
        b = math.max(left - math.max(t - at, 0) * d, 0)
      end
      backlogs[i] = b
      local capacity = (w - h) * d
      local new = b + cost * u
      if new > capacity and record ~= SETTLE then
        local retry = -2
        if cost * u <= capacity then
          retry = math.ceil((new - capacity) / d)
        end
        if later(retry, denied_retry) then
          denied, denied_retry = i, retry
        end
      elseif record == LEASE then
        local fit = math.floor((capacity - b) / u)
        if room == nil or fit < room then
          room = fit
        end
      end
    end

    -- A reservation (prelude.lua, RESERVE) takes the latest retry as its turn, within its
    -- wait: it is recorded at `t` (now, or the end of the key's pause), past the capacity
    -- (the backlog is the queue), and answered admitted with the turn as its retry.
    local turn = nil
    if record == RESERVE then
      local shift = t - now
      if denied == nil then
        if shift <= reserve_wait then
          turn = shift
        else
          denied, denied_retry = 1, shift
        end
      elseif denied_retry >= 0 then
        if shift + denied_retry <= reserve_wait then
          turn, denied = shift + denied_retry, nil
        else
          denied_retry = shift + denied_retry
        end
      end
    end

    -- The header: when the state was created, when a lease was last taken from it.
    local born, leased = now, 0
    if state then
      born, leased = sunpack('<ll', state, state_byte)
    end
    if record == LEASE then
      leased = now
    end

    -- Refused: report the refusing limit. Admitted (or settled): record, then report the limit
    -- with the fewest units left (the first of equals). A refund writes only to state that held
    -- the request (created no later than its admission).
    local allowed, reported, retry = 0, denied, denied_retry
    if denied ~= nil and state then
      -- Refused under counts that drain the backlog slower than those it was written under
      -- (an override that cuts them, a plan's, a rule's): it drains later than the expiry its
      -- write set, and the key is kept until it has, so that the refusal's retry holds. Under
      -- the counts it was written under, the key's expiry already covers it.
      local drained = 0
      for i = 1, n do
        drained = math.max(drained, math.ceil(backlogs[i] / drains[i]))
      end
      local ms = math.ceil(drained / 1000)
      local left = redis.call('PTTL', key)
      if left >= 0 and left < ms then
        redis.call('PEXPIRE', key, ms)
      end
    end
    if denied == nil then
      allowed, retry = 1, -1
      local held = refund == 0 or (state ~= nil and admitted >= 0 and born <= admitted)
      if record ~= LOOK and held then
        if record == LEASE then
          local take = math.min(want, room)
          allowed, cost = 1 + take - cost, take
        end
        -- The longest window, the same for every request of a call (so `text` formats it
        -- once), unless a charge overfilled a bucket: it then lives until that one drains.
        local ttl = windows[n]
        for i = 1, n do
          local u, d = weights[i], drains[i]
          if refund == 1 then
            -- Its units drain from its admission, or, for a single-limit attempt, after the
            -- units ahead of them (prelude.lua, SETTLE), as far as they still weigh.
            local from = admitted
            if n == 1 and drains_from > admitted then
              from = drains_from
            end
            local weight = math.max(cost * u - math.max(t - from, 0) * d, 0)
            backlogs[i] = math.max(backlogs[i] - weight, 0)
          else
            backlogs[i] = math.min(backlogs[i] + cost * u, MAX_UNITS)
          end
          if record == SETTLE or record == RESERVE then
            ttl = math.max(ttl, math.ceil(backlogs[i] / d))
          end
        end
        local value
        if n == 1 then
          value = spack('<lllll', stamp, backlogs[1], weights[1], born, leased)
        else
          local parts = {}
          for i = 1, n do
            parts[i] = spack('<lll', stamp, backlogs[i], weights[i])
          end
          parts[n + 1] = spack('<ll', born, leased)
          value = table.concat(parts)
        end
        -- Stamped later than now: it starts draining only then.
        ttl = ttl + math.max(stamp - now, 0)
        -- Decided under an override's counts: kept until the backlog drains under the
        -- policy's own too (prelude.lua, `stretch_num`), at most 2^50 us.
        if stretch_num > stretch_den then
          ttl = math.min(math.ceil(ttl * stretch_num / stretch_den), 1125899906842624)
        end
        -- Where the expiry rounds to the one the state's stamp guarantees, the key keeps its
        -- own (expiry.lua, `expires_at`), as gcra_plain.lua's writes do.
        local w = windows[n]
        local kept = written and stretch_num <= stretch_den and expires_at(written + w, w)
        write_gcra(key, value, now, expires_at(now + ttl, w), kept)
      end
      local least
      for i = 1, n do
        local u, d = weights[i], drains[i]
        local remaining = math.floor(((windows[i] - h) * d - backlogs[i]) / u)
        if least == nil or remaining < least then
          least, reported = remaining, i
        end
      end
    end
    if turn ~= nil then
      retry = join_line(key, now + turn, cost) - now
    end
    local w, b = windows[reported], backlogs[reported]
    local u, d = weights[reported], drains[reported]
    reply[k] = spack('<llllll', allowed, reported - 1, math.max(math.floor(((w - h) * d - b) / u), 0),
      math.ceil(b / d), retry, overridden and counts[reported] or -1)
    if attempt_id > 0 and allowed == 0 then
      -- prelude.lua, "Attempts": each attempt's units weigh what a refund would take back
      -- (its cost less what has drained since it was admitted), in state created before it.
      fits_without = function(tries)
        for i = 1, n do
          local u2, d2, b2 = weights[i], drains[i], backlogs[i]
          for _, try in ipairs(tries) do
            if born <= try.at then
              b2 = b2 - math.max(try.units * u2 - math.max(t - try.at, 0) * d2, 0)
            end
          end
          if math.max(b2, 0) + cost * u2 > (windows[i] - h) * d2 then
            return false
          end
        end
        return true
      end
    end
    if box_ms > 0 or slot_cap > 0 or attempt_id > 0 then
      reply[k] = conclude(k, reply[k])
    end
  end
end

return finish()
