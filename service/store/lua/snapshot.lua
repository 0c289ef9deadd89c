-- snapshot.lua: the whole table at one version, for a replica's (re)sync.
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash
-- returns {version, config_version, config JSON or "", now ms, {broker, value, ...}, {topic, route JSON, ...}}
local meta = redis.call('HMGET', KEYS[3], 'version', 'config_version', 'config')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {
  tonumber(meta[1] or '0'),
  tonumber(meta[2] or '0'),
  meta[3] or '',
  now,
  redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2]),
}
