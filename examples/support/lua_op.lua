-- One Lua operation run ARGV[1] times (examples/redis_costs.rs, `--lua-ops`): the example
-- puts the operation in the loop's placeholder below and counts redis-server's instructions for
-- 0 and for 2 000 runs, so that their difference over 2 000 is what the operation costs in
-- Redis's Lua (the interpreter, the library function, the strings it makes).
--
-- KEYS      none
-- ARGV[1]   how many times to run the operation
-- Reply     1

local tonumber, sub, find, format = tonumber, string.sub, string.find, string.format
local spack, sunpack, floor = struct.pack, struct.unpack, math.floor
-- Operands: a time in us as Redis TIME's digits, a sliding-log member (log_events.lua), three
-- packed integers, and a table.
local digits, member = '1795900542147172', '1795900542147172:0000000000000042:1'
local packed, t = spack('<lll', 1, 2, 3), {}
for i = 1, tonumber(ARGV[1]) do
  {{op}}
end
return 1
