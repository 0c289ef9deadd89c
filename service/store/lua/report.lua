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
-- ARGV[5] table cap: fault items the hash may hold. When the reports name brokers not in it
--         and it would overflow, every item whose window has ended is dropped (each pushed as
--         a delete); if still too full, nothing is written. After a scan that could not make
--         room, the next one waits until the earliest open window ends (meta field prune_at,
--         cleared whenever a new broker is added), so a table full of open windows costs O(1)
--         per refused report.
-- ARGV[6..] six values per report, applied in order: broker, latency ms, window duration ms,
--         age ms (the report happened at now - age), isolation (0/1), producer ("" = none)
-- returns {status, now ms, {availableAt}, {version}, {change}} with one entry per report
--   status 1: applied. version > 0: the report changed the window and was pushed as
--             {k="fault", v=version, f=broker, x="latencyMs,availableAt"};
--             change: 0 none, 1 opened, 2 moved, 3 cleared
--   the sixth element is the number of items dropped to make room
--   status -1: the caller's config is stale: nothing written; {} {} {} and the current config
--             version as the sixth element
--   status -2: the table is full of open windows: nothing written; {} {} {} and the number
--             of items dropped (0) as the sixth element
local config_version = tonumber(redis.call('HGET', KEYS[2], 'config_version') or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if config_version ~= tonumber(ARGV[1]) then
  return {-1, now, {}, {}, {}, config_version}
end

local rule = ARGV[2]
local log_cap = tonumber(ARGV[4])
local evicted = 0
if rule ~= 'off' then
  local cap = tonumber(ARGV[5])
  local function count_new()
    local new, seen = 0, {}
    for i = 6, #ARGV, 6 do
      local broker = ARGV[i]
      if not seen[broker] then
        seen[broker] = true
        if redis.call('HEXISTS', KEYS[1], broker) == 0 then
          new = new + 1
        end
      end
    end
    return new
  end
  local new = count_new()
  if new > 0 then
    local size = redis.call('HLEN', KEYS[1])
    if size + new > cap then
      local prune_at = tonumber(redis.call('HGET', KEYS[2], 'prune_at') or '0')
      if now >= prune_at then
        local all = redis.call('HGETALL', KEYS[1])
        local next_end = nil
        for j = 1, #all, 2 do
          local item_end = tonumber(string.match(all[j + 1], ',(%d+)$'))
          if item_end <= now then
            redis.call('HDEL', KEYS[1], all[j])
            local v = redis.call('HINCRBY', KEYS[2], 'version', 1)
            redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = v, f = all[j], x = ''}))
            evicted = evicted + 1
          elseif next_end == nil or item_end < next_end then
            next_end = item_end
          end
        end
        size = size - evicted
        -- a broker of these reports may have been one of the dropped
        new = count_new()
        if size + new > cap then
          -- Nothing is added while refusing, so no item can end before next_end.
          redis.call('HSET', KEYS[2], 'prune_at', string.format('%.0f', next_end or 0))
        end
      end
      if size + new > cap then
        return {-2, now, {}, {}, {}, evicted}
      end
    end
    redis.call('HDEL', KEYS[2], 'prune_at')
  end
end
local ends, versions, changes = {}, {}, {}
for i = 6, #ARGV, 6 do
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
return {1, now, ends, versions, changes, evicted}
