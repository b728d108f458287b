-- Sliding window counter (appended to prelude.lua and common.lua); src/model/sliding_window.rs is the same
-- procedure and explains the math and its bounds.
--
-- KEYS[k]   integers s1 c1 p1 s2 c2 p2 ... (as common.lua's load_fields): for limit i, the
--           start of the current window (us, a multiple of the window since the epoch), its
--           count and the previous window's count; then the header common.lua adds
--           (creation time, last lease)
-- ARGV      as prelude.lua (event times are -1: the counter takes none)
-- Reply     as prelude.lua
--
-- Writes: an admitted request, or a charge, adds its cost to every limit's current window (a
-- count saturates at MAX_UNITS) and sets the key to expire after twice the longest window
-- (the previous window still weighs until then); a refund takes up to its units (not below
-- 0) from the count of each limit's window that holds the admission time, while it is stored
-- (as the current window, or as the previous one after a rollover; none when that time is not
-- known, or the state was created after it), keeping the key's expiry.
--
-- Exactness: the weighing multiplies counts (up to 2^52) by times in us (up to 2^49), past
-- the 2^53 where Lua's doubles are exact, so products are compared and divided exactly with
-- exact.lua's `at_most` and `mul_div`, as the Rust does in 128-bit integers.

-- `state` (from common.lua), per limit i: state[3i - 2] = start of the current window,
-- state[3i - 1] = its count, state[3i] = the previous window's count.

-- Elapsed time in the current window, its count and the previous window's.
local function current(i)
  local w = windows[i]
  local start, s = window_start(t, w), state[3 * i - 2]
  if s == start then
    return t - start, state[3 * i - 1], state[3 * i]
  elseif s ~= nil and s + w == start then
    return t - start, 0, state[3 * i - 1]
  end
  return t - start, 0, 0
end

local function fits(i)
  local c, w = counts[i], windows[i]
  local e, curr, prev = current(i)
  -- prev * (w - e) + (curr + cost) * w <= c * w, with room = c - curr - cost.
  local room = c - curr - cost
  if room >= 0 and at_most(prev, w - e, room, w) then
    return nil
  end
  if cost > c then
    return -2
  end
  if room >= 0 then
    return w - mul_div(room, w, prev) - e
  end
  return (w - e) + math.max(0, w - mul_div(c - cost, w, curr))
end

local function apply()
  local new = {}
  for i = 1, n do
    local _, curr, prev = current(i)
    new[3 * i - 2], new[3 * i - 1], new[3 * i] = window_start(t, windows[i]),
      math.min(curr + cost, MAX_UNITS), prev
  end
  state = new
  store_fields(state, 2 * longest)
end

-- Units left, floor(c - curr - prev * (w - e) / w), and until both windows have passed.
local function report(i)
  local c, w = counts[i], windows[i]
  local e, curr, prev = current(i)
  local remaining = 0
  if curr < c then
    local weighed = mul_div(prev, w - e, w)
    if not at_most(prev, w - e, weighed, w) then
      weighed = weighed + 1
    end
    remaining = math.max(c - curr - weighed, 0)
  end
  local reset = 0
  if curr > 0 then
    reset = 2 * w - e
  elseif prev > 0 then
    reset = w - e
  end
  return remaining, reset
end

local function give_back()
  local changed = false
  for i = 1, n do
    local start, s = window_start(admitted, windows[i]), state[3 * i - 2]
    if s == start then
      state[3 * i - 1] = math.max(state[3 * i - 1] - cost, 0)
      changed = true
    elseif s ~= nil and s == start + windows[i] then
      state[3 * i] = math.max(state[3 * i] - cost, 0)
      changed = true
    end
  end
  return changed
end

return each_stored_request(3, fits, apply, report, give_back)
