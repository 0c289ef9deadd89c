-- reach.lua: record the active detector's readings on brokers' fault items, pushing each
-- item whose reading changed; the rule is detour.policy.recovery.reach (a differential test
-- feeds both the same readings). Without earlyRecovery the window and everything else in
-- the item stay as they are.
-- KEYS[1] faults hash   KEYS[2] meta hash (version, hlc)
-- KEYS[3] window ends (report.lua's KEYS[5]: broker -> availableAt)
-- ARGV[1] change channel
-- ARGV[2] earlyRecovery (1/0; 0 with avoidance off): a broker in an open window read
--         unreachable before and reachable now, isolated at most once recently, gets its
--         window ended now, on probation
-- ARGV[3] the caller's stamp floor
-- ARGV[4..] pairs: broker, reachable (1/0); a broker without an item is skipped
-- returns {{broker, version, value}, ...} for every item that changed
local now = clock_ms()
local early = ARGV[2] == '1'
local stamps = stamper(KEYS[2], now, ARGV[3])
local out = {}
for i = 4, #ARGV, 2 do
  local broker, reach = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], broker)
  if old then
    local it = parse_item(old)
    if it.reach ~= reach then
      if early and reach == '1' and it.reach == '0' and it.iso <= 1 and now < it.e then
        -- refused, then reachable: back on probation, the window ends now
        it.e, it.prob, it.why = now, true, nil
        redis.call('ZADD', KEYS[3], now, broker)
      end
      it.reach, it.stamp = reach, stamps.next()
      local value = encode_item(it)
      redis.call('HSET', KEYS[1], broker, value)
      local version = push(KEYS[2], ARGV[1], 'fault', broker, value, it.stamp)
      out[#out + 1] = {broker, version, value}
    end
  end
end
stamps.done()
return out
