-- Fixed window (appended to prelude.lua and common.lua); src/model/fixed_window.rs is the same procedure.
--
-- KEYS[k]   integers s1 c1 s2 c2 ... (as common.lua's load_fields): for limit i, the start of
--           the window counted (us, a multiple of the window since the epoch) and the units
--           counted in it; then the header common.lua adds (creation time, last lease)
-- ARGV      as prelude.lua (event times are -1: fixed windows take none)
-- Reply     as prelude.lua
--
-- Writes: an admitted request, or a charge, adds its cost to every limit's current window (a
-- count saturates at MAX_UNITS) and sets the key to expire after the longest window; a refund
-- takes up to its units (not below 0) from each limit's count whose window holds the
-- admission time and is still the current one (none when that time is not known, or the
-- state was created after it), keeping the key's expiry.

-- `state` (from common.lua), per limit i: state[2i - 1] = start of the window counted,
-- state[2i] = its count.

local function used(i)
  if state[2 * i - 1] == window_start(t, windows[i]) then
    return state[2 * i] or 0
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
  local new = {}
  for i = 1, n do
    new[2 * i - 1], new[2 * i] = window_start(t, windows[i]), math.min(used(i) + cost, MAX_UNITS)
  end
  state = new
  store_fields(state, longest)
end

local function report(i)
  return math.max(counts[i] - used(i), 0), window_start(t, windows[i]) + windows[i] - t
end

local function give_back()
  local changed = false
  for i = 1, n do
    local start = window_start(t, windows[i])
    if state[2 * i - 1] == start and window_start(admitted, windows[i]) == start then
      state[2 * i] = math.max(state[2 * i] - cost, 0)
      changed = true
    end
  end
  return changed
end

return each_stored_request(2, fits, apply, report, give_back)
