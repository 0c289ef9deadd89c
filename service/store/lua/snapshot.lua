-- snapshot.lua: the whole table at one version, for a replica's (re)sync and merges.
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash   KEYS[4] writers hash
-- KEYS[5] graves hash (its mark: lib/item.lua table_epoch)
-- ARGV[1] the writer (replica id) whose sequence high-water mark to return
-- ARGV[2], ARGV[3] the lineage pair (version, token) the replica reached (lib/item.lua)
-- returns {version, config stamp, config JSON or "", now ms, {broker, item, ...},
--   {topic, route, ...}, epoch ("" = none yet), the writer's high-water mark, hlc (the last
--   stamp the table gave), 1 when the table's history holds the replica's lineage pair
--   (else 0), the lineage token of the version returned}
local meta = redis.call('HMGET', KEYS[3], 'version', 'config_stamp', 'config', 'hlc')
return {
  tonumber(meta[1] or '0'),
  meta[2] or '0',
  meta[3] or '',
  clock_ms(),
  redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2]),
  table_epoch(KEYS[3], {KEYS[1], KEYS[2], KEYS[5]}),
  tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0'),
  meta[4] or '0',
  lineage_holds(KEYS[3], ARGV[2], ARGV[3]) and 1 or 0,
  lineage_now(KEYS[3], tonumber(meta[1] or '0')),
}
