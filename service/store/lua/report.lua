-- report.lua: apply latency reports to brokers' fault items, on Redis's clock, atomically.
-- KEYS[1] faults hash (broker -> "latencyMs,availableAt")
-- KEYS[2] meta hash (version, config_version, config)
-- ARGV[1] config version the caller chose durations and rule with
-- ARGV[2] update rule: "extend" (window end = max(old, at + duration)), "overwrite" (RocketMQ
--         4.x: at + duration) or "off" (avoidance disabled: read only, nothing written)
-- ARGV[3] change channel
-- ARGV[4..] four values per report, applied in order:
--         broker, latency ms, window duration ms, age ms (the report happened at now - age)
-- returns {status, now ms, {availableAt per report}, {version per report}}
--   status 1: written; a version > 0 means that report opened, moved or cleared the window
--             and was pushed as {k="fault", v=version, f=broker, x="latencyMs,availableAt"}
--   status -1: the caller's config is stale: nothing written, {} {} and the current config
--             version as the fifth element
local config_version = tonumber(redis.call('HGET', KEYS[2], 'config_version') or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if config_version ~= tonumber(ARGV[1]) then
  return {-1, now, {}, {}, config_version}
end

local rule = ARGV[2]
local ends, versions = {}, {}
for i = 4, #ARGV, 4 do
  local broker = ARGV[i]
  local old = redis.call('HGET', KEYS[1], broker)
  local old_end = nil
  if old then
    old_end = tonumber(string.match(old, ',(%d+)$'))
  end
  local version = 0
  local new_end
  if rule == 'off' then
    new_end = old_end or now
  else
    new_end = now - tonumber(ARGV[i + 3]) + tonumber(ARGV[i + 2])
    if rule == 'extend' and old_end and old_end > new_end then
      new_end = old_end
    end
    local value = ARGV[i + 1] .. ',' .. string.format('%.0f', new_end)
    redis.call('HSET', KEYS[1], broker, value)
    local was_open = old_end ~= nil and old_end > now
    local is_open = new_end > now
    if (is_open and new_end ~= old_end) or (was_open and not is_open) then
      version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
    end
  end
  ends[#ends + 1] = new_end
  versions[#versions + 1] = version
end
return {1, now, ends, versions}
