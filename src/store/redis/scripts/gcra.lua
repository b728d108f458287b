-- GCRA, the leaky bucket (appended to common.lua); src/algorithm/gcra.rs is the same procedure
-- and explains the math.
--
-- KEYS[k]   string "t1 b1 t2 b2 ...": for limit i, the time of the last admission (us) and the
--           backlog it left, in us scaled by the count (so one unit of cost is exactly `window`)
-- ARGV      as common.lua (event times are -1: GCRA takes none)
-- Reply     as common.lua
--
-- Writes: an admitted request stores every limit's new backlog and sets the key to expire
-- after the longest window, by which time every bucket has drained.

-- `state` (from common.lua), per limit i: state[2i - 1] = time of the last admission,
-- state[2i] = backlog it left.

local function backlog(i)
  local at = state[2 * i - 1]
  if at == nil then
    return 0
  end
  local elapsed = math.max(t - at, 0)
  if elapsed >= windows[i] then
    return 0
  end
  return math.max(state[2 * i] - elapsed * counts[i], 0)
end

local function fits(i)
  local c, w = counts[i], windows[i]
  local new = backlog(i) + cost * w
  if new <= w * c then
    return nil
  end
  if cost > c then
    return -2
  end
  return math.ceil((new - w * c) / c)
end

local function apply()
  local new = {}
  for i = 1, n do
    new[2 * i - 1], new[2 * i] = t, backlog(i) + cost * windows[i]
  end
  state = new
  store_fields(state, longest)
end

local function report(i)
  local c, w = counts[i], windows[i]
  local b = backlog(i)
  return math.floor((w * c - b) / w), math.ceil(b / c)
end

return each_stored_request(fits, apply, report)
