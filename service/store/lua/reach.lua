-- reach.lua: record the active detector's readings on brokers' fault items, pushing each
-- item whose reading changed; the rule is service.policy.reach (a differential test feeds
-- both the same readings). Without earlyRecovery the window and everything else in the item
-- stay as they are.
-- KEYS[1] faults hash (the item format of report.lua / service/store/codec.py)
-- KEYS[2] meta hash (version)
-- KEYS[3] window ends (report.lua's KEYS[5]: broker -> availableAt)
-- ARGV[1] change channel
-- ARGV[2] earlyRecovery (1/0; 0 with avoidance off): a broker in an open window read
--         unreachable before and reachable now, isolated at most once recently, gets its
--         window ended now, on probation
-- ARGV[3..] pairs: broker, reachable (1/0); a broker without an item is skipped
-- returns {{broker, version, value}, ...} for every item that changed
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local early = ARGV[2] == '1'
local out = {}
for i = 3, #ARGV, 2 do
  local broker, reach = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], broker)
  if old then
    local head, tail = string.match(old, '^([^;]*)(.*)$')
    local l, e, n, pr, rc = string.match(head, '^(%d+),(%d+),?(%d*),?(%d*),?(%d*)$')
    if rc ~= reach then
      if n == '' then
        n = '0'
      end
      if pr == '' then
        pr = '0'
      end
      if early and reach == '1' and rc == '0' and tonumber(n) <= 1 and now < tonumber(e) then
        -- policy.reach: refused, then reachable: back on probation, the window ends now
        e, pr = string.format('%.0f', now), '1'
        redis.call('ZADD', KEYS[3], now, broker)
      end
      local value = l .. ',' .. e .. ',' .. n .. ',' .. pr .. ',' .. reach .. tail
      redis.call('HSET', KEYS[1], broker, value)
      local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[1], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
      out[#out + 1] = {broker, version, value}
    end
  end
end
return out
