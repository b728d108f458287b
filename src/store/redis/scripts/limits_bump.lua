-- Changes the limits version (limits_version.lua, before this text): a change of overrides
-- is announced, or a stamp taken for a policy's override written to several hash slots.
--
-- KEYS[1]   the limits version (<prefix>:{overrides}:limits)
--
-- Reply     {version, epoch}

local version = next_version(KEYS[1])
local epoch = set_version(KEYS[1], version)
return {version, epoch}
