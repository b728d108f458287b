-- Sliding window counter (appended to common.lua); src/algorithm/sliding_window.rs is the same
-- procedure and explains the math and its bounds.
--
-- KEYS[k]   string "s1 c1 p1 s2 c2 p2 ...": for limit i, the start of the current window (us, a
--           multiple of the window since the epoch), its count and the previous window's count
-- ARGV      as common.lua (event times are -1: the counter takes none)
-- Reply     as common.lua
--
-- Writes: an admitted request adds its cost to every limit's current window and sets the key
-- to expire after twice the longest window (the previous window still weighs until then).

local SUFFIXES = { 's', 'c', 'p' }
local state

-- Elapsed time in the current window, its count and the previous window's.
local function current(i)
  local w, s = windows[i], state[i]
  local start = window_start(t, w)
  if s.s == start then
    return t - start, s.c, s.p
  elseif s.s ~= nil and s.s + w == start then
    return t - start, 0, s.c
  end
  return t - start, 0, 0
end

local function fits(i)
  local c, w = counts[i], windows[i]
  local e, curr, prev = current(i)
  if prev * (w - e) + (curr + cost) * w <= c * w then
    return nil
  end
  if cost > c then
    return -2
  end
  if curr + cost <= c then
    return w - math.floor((c - curr - cost) * w / prev) - e
  end
  return (w - e) + math.max(0, w - math.floor((c - cost) * w / curr))
end

local function apply()
  for i = 1, n do
    local _, curr, prev = current(i)
    state[i] = { s = window_start(t, windows[i]), c = curr + cost, p = prev }
  end
  store_fields(state, SUFFIXES, 2 * longest)
end

local function report(i)
  local c, w = counts[i], windows[i]
  local e, curr, prev = current(i)
  local remaining = math.floor(math.max(c * w - prev * (w - e) - curr * w, 0) / w)
  local reset = 0
  if curr > 0 then
    reset = 2 * w - e
  elseif prev > 0 then
    reset = w - e
  end
  return remaining, reset
end

local function run()
  state = load_fields(SUFFIXES)
  return decide(fits, apply, report)
end

return each_request(run)
