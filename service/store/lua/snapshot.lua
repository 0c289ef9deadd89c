-- snapshot.lua: the whole table at one version, for a replica's (re)sync.
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash   KEYS[4] writers hash
-- ARGV[1] the writer (replica id) whose sequence high-water mark to return
-- returns {version, config_version, config JSON or "", now ms, {broker, value, ...},
--   {topic, route JSON, ...}, epoch ("" = none yet), the writer's high-water mark}
local meta = redis.call('HMGET', KEYS[3], 'version', 'config_version', 'config', 'epoch')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {
  tonumber(meta[1] or '0'),
  tonumber(meta[2] or '0'),
  meta[3] or '',
  now,
  redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2]),
  meta[4] or '',
  tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0'),
}
