-- set_entry.lua: write or delete one entry of the shared table and push the change.
-- Used for routes (hash routes, field topic), config (hash meta, field "config") and an
-- operator clearing a fault item (hash faults, field broker, delete).
-- KEYS[1] the hash   KEYS[2] meta hash (version, config_version, epoch)
-- KEYS[3] event log stream   KEYS[4] window ends sorted set (report.lua's eviction index)
-- ARGV[1] change channel   ARGV[2] kind ("route" | "config" | "fault")   ARGV[3] field
-- ARGV[4] value; "" deletes the field
-- ARGV[5] event log cap (0 = no event): an operator's delete of a broker whose window was
--         open is an event (k=ended r=operator, as report.lua's)
-- ARGV[6] the table epoch the caller holds: a table with another one (or none) is not
--         written: it was lost, and the caller re-seeds it first. "+id": the caller holds no
--         table yet: a table without an epoch takes id as its epoch (report.lua's ARGV[7])
-- returns the new version, 0 when deleting a field that does not exist (nothing pushed),
--   or -1 when the epoch differs (nothing written)
local epoch, held = redis.call('HGET', KEYS[2], 'epoch') or '', ARGV[6]
if string.sub(held, 1, 1) == '+' then
  held = string.sub(held, 2)
  if epoch == '' then
    epoch = held
    redis.call('HSET', KEYS[2], 'epoch', epoch)
  end
end
if epoch ~= held then
  return -1
end
if ARGV[4] == '' then
  local old = redis.call('HGET', KEYS[1], ARGV[3])
  if not old then
    return 0
  end
  redis.call('HDEL', KEYS[1], ARGV[3])
  if ARGV[2] == 'fault' then
    redis.call('ZREM', KEYS[4], ARGV[3])
  end
  if ARGV[2] == 'fault' and tonumber(ARGV[5]) > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local e = tonumber(string.match(old, '^%d+,(%d+)'))
    if e > now then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'k', 'ended', 'r', 'operator',
        'b', ARGV[3], 't', '', 'n', 0, 'e', string.format('%.0f', now), 'a', string.format('%.0f', now))
    end
  end
else
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
end
local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
if ARGV[2] == 'config' then
  redis.call('HSET', KEYS[2], 'config_version', version)
end
redis.call('PUBLISH', ARGV[1], cjson.encode({k = ARGV[2], v = version, f = ARGV[3], x = ARGV[4]}))
return version
