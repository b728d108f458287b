-- The floor of a GCRA decision in a script (examples/redis_costs.rs): what the plain tier's
-- script (src/store/redis/scripts/gcra_plain.lua) asks of Redis for an admission, and nothing
-- else. It reads no arguments, decides nothing and packs nothing, so no script that makes
-- these commands costs Redis less.
--
-- KEYS[k]   a key: read (GET) and written again with 40 bytes, as a state of one limit is,
--           keeping its expiry (SETRANGE over the 40 bytes, expiry.lua's `write_gcra`), as the
--           plain tier writes a key it wrote within the same eighth of its window (expiry.lua,
--           `expires_at`); the store's runs here decide each key many times in that time
-- ARGV      none
-- Reply     48 bytes per key (a decision's six integers' worth), then 16 (Redis TIME and a
--           generation's worth), as the plain tier replies

redis.call('TIME')
local reply = {}
for k = 1, #KEYS do
  redis.call('GET', KEYS[k])
  redis.call('SETRANGE', KEYS[k], '0', '0123456789012345678901234567890123456789')
  reply[k] = '012345678901234567890123456789012345678901234567'
end
reply[#reply + 1] = '0123456789012345'
return table.concat(reply)
