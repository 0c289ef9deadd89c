-- poll.lua: the table's identity and Redis's clock in one round trip, routed by the meta key
-- (a pipeline with TIME would send the keyless TIME to any cluster node).
-- KEYS[1] meta hash   KEYS[2] writers hash   KEYS[3..5] faults, routes, graves hashes (their
-- marks: lib/item.lua table_epoch)   ARGV[1] the writer (replica id)
-- ARGV[2], ARGV[3] the lineage pair (version, token) the replica reached (lib/item.lua)
-- returns {version, seconds, microseconds, epoch ("" = none), the writer's high-water mark,
--   hlc (the last stamp the table gave: below one the replica saw, the table lost writes),
--   1 when the table's history holds the replica's lineage pair, else 0}
local t = redis.call('TIME')
local meta = redis.call('HMGET', KEYS[1], 'version', 'hlc')
return {tonumber(meta[1] or '0'), t[1], t[2], table_epoch(KEYS[1], {KEYS[3], KEYS[4], KEYS[5]}),
  tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0'), meta[2] or '0',
  lineage_holds(KEYS[1], ARGV[2], ARGV[3]) and 1 or 0}
