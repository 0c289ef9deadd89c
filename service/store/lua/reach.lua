-- reach.lua: record the active detector's readings on brokers' fault items, pushing each
-- item whose reading changed. The window and everything else in the item stay as they are.
-- KEYS[1] faults hash (the item format of report.lua / service/store/codec.py)
-- KEYS[2] meta hash (version)
-- ARGV[1] change channel
-- ARGV[2..] pairs: broker, reachable (1/0); a broker without an item is skipped
-- returns {{broker, version, value}, ...} for every item that changed
local out = {}
for i = 2, #ARGV, 2 do
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
      local value = l .. ',' .. e .. ',' .. n .. ',' .. pr .. ',' .. reach .. tail
      redis.call('HSET', KEYS[1], broker, value)
      local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[1], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
      out[#out + 1] = {broker, version, value}
    end
  end
end
return out
