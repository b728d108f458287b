-- Integers handed to Redis, and the expiry of keys: the decimal text of an integer, and when
-- a GCRA or sliding-log key expires, which every script that writes one rounds alike, with the
-- write of GCRA state that keeps or sets it. Prepended to every script (before exact.lua and
-- prelude.lua, before plain.lua, and to return.lua).

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
-- table: about 1 900 Redis instructions a write fewer (the floor rows of
-- examples/redis_costs.rs, docs/performance.md).
local function write_gcra(key, value, now, at, kept)
  if kept and at <= kept then
    redis.call('SETRANGE', key, '0', value)
  else
    redis.call('PSETEX', key, text(at - (now - now % 1000) / 1000), value)
  end
end
