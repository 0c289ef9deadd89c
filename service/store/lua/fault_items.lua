-- fault_items.lua: every fault item with the Redis time they are judged against.
-- KEYS[1] faults hash
-- returns {now ms, {broker, "latencyMs,availableAt", ...}}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {now, redis.call('HGETALL', KEYS[1])}
