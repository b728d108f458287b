-- Fixed window (appended to common.lua); src/algorithm/fixed_window.rs is the same procedure.
--
-- KEYS[k]   string "s1 c1 s2 c2 ...": for limit i, the start of the window counted (us, a
--           multiple of the window since the epoch) and the units counted in it
-- ARGV      as common.lua (event times are -1: fixed windows take none)
-- Reply     as common.lua
--
-- Writes: an admitted request adds its cost to every limit's current window and sets the key
-- to expire after the longest window.

local SUFFIXES = { 's', 'c' }
local state

local function used(i)
  local s = state[i]
  if s.s == window_start(t, windows[i]) then
    return s.c or 0
  end
  return 0
end

local function fits(i)
  if used(i) + cost <= counts[i] then
    return nil
  end
  if cost > counts[i] then
    return -2
  end
  return window_start(t, windows[i]) + windows[i] - t
end

local function apply()
  for i = 1, n do
    state[i] = { s = window_start(t, windows[i]), c = used(i) + cost }
  end
  store_fields(state, SUFFIXES, longest)
end

local function report(i)
  return math.max(counts[i] - used(i), 0), window_start(t, windows[i]) + windows[i] - t
end

local function run()
  state = load_fields(SUFFIXES)
  return decide(fits, apply, report)
end

return each_request(run)
