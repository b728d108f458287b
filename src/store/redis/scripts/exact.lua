-- Integers in Lua: exact arithmetic past 2^53, where Lua's doubles stop being exact, and the
-- decimal text of an integer handed to Redis. Prepended to every script (before prelude.lua,
-- and to return.lua), for the products of counts and times (sliding_window.lua) and GCRA's
-- change of units (gcra.lua, return.lua). The Rust does the same in 128-bit integers. Also
-- the expiry of GCRA and sliding-log keys, which every script that writes them rounds alike,
-- and the write of GCRA state that keeps or sets it.

-- The decimal text of the integer x, made once per call: Redis prints every Lua number it
-- receives with "%.17g", which costs more than the command itself (prelude.lua, "Cost").
local texts = {}
local function text(x)
  local s = texts[x]
  if s == nil then
    s = string.format('%d', x)
    texts[x] = s
  end
  return s
end

-- When a key that must last until `until_us` (an integer of Redis time, us) expires, in ms of
-- Redis time: `until_us` rounded up to a multiple of an eighth of the longest window `window`
-- in whole ms (at least 1 ms).
-- Every write of GCRA state sets its key to expire at expires_at(x, window) for some x at or
-- after the state's stamp plus that window (or keeps an expiry at least that), so that the
-- expiry of a key is at least expires_at(stamp + window, window) for the stamp its state
-- holds; the sliding log does the same with its newest event plus twice the window
-- (sliding_log_plain.lua, "Expiry"). A write whose own expiry rounds to that keeps the key's
-- (SETRANGE over the whole state, or no PEXPIREAT), which costs Redis fewer instructions than
-- setting one (gcra_plain.lua, "Writes"); the price is a key kept up to an eighth of its
-- window longer.
-- Integers only, and no `math` (a global, which Redis's Lua reads through a metatable, and
-- whose functions are calls into C): `%` rounds in the virtual machine, and every value here is
-- exact in a double.
local function expires_at(until_us, window)
  local quantum = (window - window % 8000) / 8
  if quantum < 1000 then
    quantum = 1000
  end
  local x = until_us + quantum - 1
  return (x - x % quantum) / 1000
end

-- Writes GCRA state `value` to `key` at Redis time `now` (us), to expire at `at` (ms, as
-- `expires_at` gives it), or keeping the key's expiry where `kept` (ms: an expiry the key is
-- known to have at least; false: none known) covers `at`. PSETEX, which costs Redis less than
-- SET PXAT, sets it for the ms from this call's time on: from Redis's time when the command
-- runs, no sooner. (gcra_plain.lua's admission of one limit does the same inline.)
-- `kept` is given only for a key that holds state of the length of `value` (every caller has
-- just read it): SETRANGE at 0 then overwrites all of it and keeps the expiry, as SET KEEPTTL
-- would, and replies an integer where SET replies a status, which Redis hands Lua as a new
-- table: about 2 300 Redis instructions a decision fewer (examples/redis_costs.rs).
local function write_gcra(key, value, now, at, kept)
  if kept and at <= kept then
    redis.call('SETRANGE', key, '0', value)
  else
    redis.call('PSETEX', key, text(at - (now - now % 1000) / 1000), value)
  end
end

-- The most units a state holds (2^52; MAX_UNITS in src/model/mod.rs): counts, totals and
-- backlogs saturate there, so that a sum of two stays below 2^53.
local MAX_UNITS = 4503599627370496

-- a * b as p + e exactly, for integers a, b below 2^53: p the double nearest the product and
-- e the rest (Dekker's algorithm; splitting at 2^27 + 1 makes every partial product exact).
local SPLIT = 134217729
local function product(a, b)
  local p = a * b
  local x = SPLIT * a
  local ah = x - (x - a)
  local al = a - ah
  x = SPLIT * b
  local bh = x - (x - b)
  local bl = b - bh
  return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl
end

-- Whether a * b <= x * y, exactly.
local function at_most(a, b, x, y)
  local p, e = product(a, b)
  local q, f = product(x, y)
  return p < q or (p == q and e <= f)
end

-- floor(a * b / d) exactly, for d > 0 and a quotient below 2^53: the double quotient, off by
-- a little, corrected by the exact remainder a * b - q * d (p - r is exact: r is close to p).
local function mul_div(a, b, d)
  local p, e = product(a, b)
  local q = math.floor(p / d)
  local r, f = product(q, d)
  local rest = (p - r) + (e - f)
  while rest < 0 do
    q, rest = q - 1, rest + d
  end
  while rest >= d do
    q, rest = q + 1, rest - d
  end
  return q
end

-- b units of GCRA weight `from` per unit of cost as units of weight `to`: ceil(b * to / from),
-- saturating at MAX_UNITS (gcra.lua: a backlog written under other counts, the same number
-- of units of cost, rounded up so that a change of counts never forgets usage).
local function reweigh(b, from, to)
  if from == to or b == 0 or from <= 0 then
    return b
  end
  if not at_most(b, to, MAX_UNITS, from) then
    return MAX_UNITS
  end
  local q = mul_div(b, to, from)
  if not at_most(b, to, q, from) then
    q = q + 1
  end
  return q
end

