-- fault_items.lua: every fault item with the Redis time they are judged against, and the
-- table's identity, so the reader can tell a table that lost data from the one it holds.
-- KEYS[1] faults hash   KEYS[2] meta hash   KEYS[3] writers hash   KEYS[4], KEYS[5] routes,
-- graves hashes (their marks: lib/item.lua table_epoch)
-- ARGV[1] the writer (replica id) whose sequence high-water mark to return
-- ARGV[2], ARGV[3] the lineage pair (version, token) the replica reached (lib/item.lua)
-- returns {now ms, {broker, item, ...}, epoch ("" = none), version, the writer's high-water
--   mark, hlc, 1 when the table's history holds the replica's lineage pair, else 0}
local meta = redis.call('HMGET', KEYS[2], 'version', 'hlc')
return {clock_ms(), redis.call('HGETALL', KEYS[1]), table_epoch(KEYS[2], {KEYS[1], KEYS[4], KEYS[5]}),
  tonumber(meta[1] or '0'), tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0'), meta[2] or '0',
  lineage_holds(KEYS[2], ARGV[2], ARGV[3]) and 1 or 0}
