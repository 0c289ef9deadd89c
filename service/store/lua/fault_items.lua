-- fault_items.lua: every fault item with the Redis time they are judged against, and the
-- table's identity, so the reader can tell a table that lost data from the one it holds.
-- KEYS[1] faults hash   KEYS[2] meta hash   KEYS[3] writers hash
-- ARGV[1] the writer (replica id) whose sequence high-water mark to return
-- returns {now ms, {broker, item, ...}, epoch ("" = none), version, the writer's high-water
--   mark, hlc}
local meta = redis.call('HMGET', KEYS[2], 'epoch', 'version', 'hlc')
return {clock_ms(), redis.call('HGETALL', KEYS[1]), meta[1] or '', tonumber(meta[2] or '0'),
  tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0'), meta[3] or '0'}
