-- Integers in Lua: exact arithmetic past 2^53, where Lua's doubles stop being exact.
-- Prepended to the full scripts (after expiry.lua, before prelude.lua), to GCRA's plain script
-- (before plain.lua) and to return.lua, for the products of counts and times
-- (sliding_window.lua) and GCRA's change of units (gcra.lua, gcra_plain.lua, return.lua). The
-- Rust does the same in 128-bit integers. The sliding log's plain script goes without it
-- (plain.lua, "Cost").

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

