-- reseed.lua: give the table an epoch and write back what a replica holds that the table
-- lacks, merged so that several replicas re-seeding at once converge and no window shrinks.
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash   KEYS[4] event log stream
-- KEYS[5] window ends sorted set   KEYS[6] writers hash   KEYS[7] writers seen sorted set
-- ARGV[1] change channel
-- ARGV[2] a fresh epoch: taken when the table has none (it was emptied, flushed or never had
--         one); a table with an epoch keeps it, so every replica ends up with the same
-- ARGV[3] the writer (replica id)   ARGV[4] its acked sequence number: the high-water mark
--         is raised to it (the writer's own reports up to it are in what it re-seeds)
-- ARGV[5] event log cap (0 = no events)
-- ARGV[6] announce (0/1): push a "reseed" change so the other replicas resync and merge
--         theirs (the last of a re-seed's calls: a large table goes back in several, so no
--         one call holds Redis long)
-- ARGV[7] config JSON ("" = none): written when the table has none
-- ARGV[8] n, the number of routes; ARGV[9 .. 8 + 2n] topic, route JSON: a topic the table
--         lacks is written (an operator's newer route wins)
-- ARGV[9 + 2n ..] broker, fault item (report.lua's format): written when the table lacks the
--         broker or holds an earlier window end (extend-only), with an event (k=opened
--         r=recovery) for each
-- returns {epoch, version, config written (0/1), routes written, windows written}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('HGET', KEYS[3], 'epoch')
if not epoch then
  epoch = ARGV[2]
  redis.call('HSET', KEYS[3], 'epoch', epoch)
end
local function push(kind, field, value)
  local v = redis.call('HINCRBY', KEYS[3], 'version', 1)
  redis.call('PUBLISH', ARGV[1], cjson.encode({k = kind, v = v, f = field, x = value}))
  return v
end
local wrote_config, wrote_routes, wrote_faults = 0, 0, 0
if ARGV[7] ~= '' and not redis.call('HGET', KEYS[3], 'config') then
  redis.call('HSET', KEYS[3], 'config', ARGV[7])
  redis.call('HSET', KEYS[3], 'config_version', push('config', 'config', ARGV[7]))
  wrote_config = 1
end
local n = tonumber(ARGV[8])
for i = 9, 8 + 2 * n, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    push('route', ARGV[i], ARGV[i + 1])
    wrote_routes = wrote_routes + 1
  end
end
local event_cap = tonumber(ARGV[5])
for i = 9 + 2 * n, #ARGV, 2 do
  local broker, value = ARGV[i], ARGV[i + 1]
  local new_end = tonumber(string.match(value, '^%d+,(%d+)'))
  local old = redis.call('HGET', KEYS[1], broker)
  local old_end = old and tonumber(string.match(old, '^%d+,(%d+)')) or nil
  if old_end == nil or old_end < new_end then
    redis.call('HSET', KEYS[1], broker, value)
    redis.call('ZADD', KEYS[5], new_end, broker)
    push('fault', broker, value)
    wrote_faults = wrote_faults + 1
    if event_cap > 0 then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', event_cap, '*', 'k', 'opened', 'r', 'recovery',
        'b', broker, 't', '', 'n', 0, 'e', string.format('%.0f', new_end),
        'a', string.format('%.0f', now))
    end
  end
end
local acked = tonumber(ARGV[4])
if acked > tonumber(redis.call('HGET', KEYS[6], ARGV[3]) or '0') then
  redis.call('HSET', KEYS[6], ARGV[3], acked)
  redis.call('ZADD', KEYS[7], now, ARGV[3])
end
local version = tonumber(redis.call('HGET', KEYS[3], 'version') or '0')
if ARGV[6] == '1' then
  version = push('reseed', '', epoch)
end
return {epoch, version, wrote_config, wrote_routes, wrote_faults}
