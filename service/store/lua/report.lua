-- report.lua: apply one latency report to a broker's fault item, on Redis's clock, atomically.
-- KEYS[1] faults hash (broker -> "latencyMs,availableAt")
-- KEYS[2] meta hash (version, config_version, config)
-- ARGV[1] broker   ARGV[2] latency ms   ARGV[3] window duration ms
-- ARGV[4] update rule: "extend" (max of old and new end), "overwrite" (RocketMQ 4.x last report
--         wins) or "off" (avoidance disabled: read only, nothing written)
-- ARGV[5] config version the caller chose duration and rule with
-- ARGV[6] change channel
-- returns {status, now ms, availableAt ms, version}
--   status 1: written; version > 0 when the window opened, moved or cleared (pushed on the
--             channel as {k="fault", v=version, f=broker, x="latencyMs,availableAt"}), else 0
--   status -1: the caller's config is stale (version = current config version); nothing written
local config_version = tonumber(redis.call('HGET', KEYS[2], 'config_version') or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if config_version ~= tonumber(ARGV[5]) then
  return {-1, now, 0, config_version}
end

local old = redis.call('HGET', KEYS[1], ARGV[1])
local old_end = nil
if old then
  old_end = tonumber(string.match(old, ',(%d+)$'))
end

if ARGV[4] == 'off' then
  return {1, now, old_end or now, 0}
end

local new_end = now + tonumber(ARGV[3])
if ARGV[4] == 'extend' and old_end and old_end > new_end then
  new_end = old_end
end
local value = ARGV[2] .. ',' .. string.format('%.0f', new_end)
redis.call('HSET', KEYS[1], ARGV[1], value)

local was_open = old_end ~= nil and old_end > now
local is_open = new_end > now
local version = 0
if (is_open and new_end ~= old_end) or (was_open and not is_open) then
  version = redis.call('HINCRBY', KEYS[2], 'version', 1)
  redis.call('PUBLISH', ARGV[6], cjson.encode({k = 'fault', v = version, f = ARGV[1], x = value}))
end
return {1, now, new_end, version}
