-- report.lua: apply latency reports to brokers' fault items, on Redis's clock, atomically,
-- and append each to the latency log.
-- KEYS[1] faults hash (broker -> "latencyMs,availableAt")
-- KEYS[2] meta hash (version, config_version, config)
-- KEYS[3] latency log stream (entries b=broker l=latency ms i=isolation 0/1 p=producer
--         t=report time ms)
-- ARGV[1] config version the caller chose durations and rule with
-- ARGV[2] update rule: "extend" (window end = max(old, at + duration)), "overwrite" (RocketMQ
--         4.x: at + duration) or "off" (avoidance disabled: the table is not written)
-- ARGV[3] change channel
-- ARGV[4] latency log length cap (approximate trim; 0 = no log)
-- ARGV[5..] six values per report, applied in order: broker, latency ms, window duration ms,
--         age ms (the report happened at now - age), isolation (0/1), producer ("" = none)
-- returns {status, now ms, {availableAt}, {version}, {change}} with one entry per report
--   status 1: applied. version > 0: the report changed the window and was pushed as
--             {k="fault", v=version, f=broker, x="latencyMs,availableAt"};
--             change: 0 none, 1 opened, 2 moved, 3 cleared
--   status -1: the caller's config is stale: nothing written; {} {} {} and the current config
--             version as the sixth element
local config_version = tonumber(redis.call('HGET', KEYS[2], 'config_version') or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if config_version ~= tonumber(ARGV[1]) then
  return {-1, now, {}, {}, {}, config_version}
end

local rule = ARGV[2]
local log_cap = tonumber(ARGV[4])
local ends, versions, changes = {}, {}, {}
for i = 5, #ARGV, 6 do
  local broker, latency = ARGV[i], ARGV[i + 1]
  local at = now - tonumber(ARGV[i + 3])
  local old = redis.call('HGET', KEYS[1], broker)
  local old_end = nil
  if old then
    old_end = tonumber(string.match(old, ',(%d+)$'))
  end
  local version, change = 0, 0
  local new_end
  if rule == 'off' then
    new_end = old_end or now
  else
    new_end = at + tonumber(ARGV[i + 2])
    if rule == 'extend' and old_end and old_end > new_end then
      new_end = old_end
    end
    local value = latency .. ',' .. string.format('%.0f', new_end)
    redis.call('HSET', KEYS[1], broker, value)
    local was_open = old_end ~= nil and old_end > now
    local is_open = new_end > now
    if is_open and not was_open then
      change = 1
    elseif is_open and new_end ~= old_end then
      change = 2
    elseif was_open and not is_open then
      change = 3
    end
    if change > 0 then
      version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
    end
  end
  if log_cap > 0 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', log_cap, '*', 'b', broker, 'l', latency,
      'i', ARGV[i + 4], 'p', ARGV[i + 5], 't', string.format('%.0f', at))
  end
  ends[#ends + 1] = new_end
  versions[#versions + 1] = version
  changes[#changes + 1] = change
end
return {1, now, ends, versions, changes}
