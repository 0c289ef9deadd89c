-- snapshot.lua: the whole table at one version, for a replica's (re)sync and merges.
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash   KEYS[4] writers hash
-- ARGV[1] the writer (replica id) whose sequence high-water mark to return
-- returns {version, config stamp, config JSON or "", now ms, {broker, item, ...},
--   {topic, route, ...}, epoch ("" = none yet), the writer's high-water mark, hlc (the last
--   stamp the table gave)}
local meta = redis.call('HMGET', KEYS[3], 'version', 'config_stamp', 'config', 'epoch', 'hlc')
return {
  tonumber(meta[1] or '0'),
  meta[2] or '0',
  meta[3] or '',
  clock_ms(),
  redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2]),
  meta[4] or '',
  tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0'),
  meta[5] or '0',
}
