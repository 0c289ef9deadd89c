-- reseed.lua: merge what a replica holds into the table after a discontinuity (Redis lost
-- or rolled back data, or may have): the rules are detour.merge's, applied atomically per
-- entry, so that replicas merging at once, in any order, converge, and no merge moves the
-- table back.
--   config and routes: the newer stamp wins; a grave (a delete's stamp) beats every copy
--     stamped before it
--   a fault item: the later window wins (extend-only; the end, then the reason), everything
--     else comes from the copy with the newer stamp (ties: the larger stored form); a grave beats copies
--     stamped before it; a new broker only while the table has room (open windows first:
--     the caller sends them first)
-- KEYS[1] faults hash   KEYS[2] routes hash   KEYS[3] meta hash   KEYS[4] event log stream
-- KEYS[5] window ends sorted set   KEYS[6] graves hash   KEYS[7] graves index (by time)
-- ARGV[1] change channel
-- ARGV[2] a fresh epoch: taken when the table has none (emptied, flushed, never had one,
--         or a hash of it lost: lib/item.lua table_epoch)
-- ARGV[3] event log cap (0 = no events)   ARGV[4] the merging replica's id
-- ARGV[5] announce (0/1): push a "reseed" change (field: the replica's id) so the other
--         replicas merge theirs too (the last call of a merge a replica saw the cause of)
-- ARGV[6] table cap
-- ARGV[7] config JSON ("" = none)   ARGV[8] its stamp
-- ARGV[9] n routes, then n pairs: topic, stored route ("stamp|json")
-- then m graves, then m pairs: "r#topic" | "f#broker", the delete's stamp
-- then pairs: broker, stored item
-- returns {epoch, version, config written (0/1), routes written, items written, graves
--   applied, items refused for want of room}
local now = clock_ms()
local marked = {KEYS[1], KEYS[2], KEYS[6]}
local epoch = table_epoch(KEYS[3], marked)
if epoch == '' then
  -- no epoch, or a hash lost (its mark gone): a fresh one, which every replica merges into
  epoch = ARGV[2]
end
mark_table(KEYS[3], epoch, marked)
local top_stamp = 0
local function seen(stamp)
  if stamp > top_stamp then
    top_stamp = stamp
  end
end
local wrote_config, wrote_routes, wrote_items, graves_applied, refused = 0, 0, 0, 0, 0
if ARGV[7] ~= '' then
  local stamp = tonumber(ARGV[8])
  seen(stamp)
  local cur = -1
  if redis.call('HEXISTS', KEYS[3], 'config') == 1 then
    cur = tonumber(redis.call('HGET', KEYS[3], 'config_stamp') or '0')
  end
  if stamp > cur then
    redis.call('HSET', KEYS[3], 'config', ARGV[7], 'config_stamp', ARGV[8])
    push(KEYS[3], ARGV[1], 'config', 'config', ARGV[7], stamp)
    wrote_config = 1
  end
end
-- detour.merge._rest: a copy's stored form without its window (the tiebreak of one stamp)
local function rest(it)
  local e, why = it.e, it.why
  it.e, it.why = 0, nil
  local v = encode_item(it)
  it.e, it.why = e, why
  return v
end
-- detour.merge._window: whether a's window is later than b's (the end, then, between equal
-- ends, the reason: none lowest; then reason, since, latency, producer)
local function window_later(a, b)
  if a.e ~= b.e then
    return a.e > b.e
  end
  local x, y = a.why, b.why
  if x == nil or y == nil then
    return x ~= nil and y == nil
  end
  for k = 1, 4 do
    local p, q = x[k], y[k]
    if k == 2 or k == 3 then
      p, q = tonumber(p), tonumber(q)
    end
    if p ~= q then
      return p > q
    end
  end
  return false
end
local function grave_of(member)
  return tonumber(redis.call('HGET', KEYS[6], member) or '-1')
end
local i = 9
local n = tonumber(ARGV[i])
for j = i + 1, i + 2 * n, 2 do
  local topic, value = ARGV[j], ARGV[j + 1]
  local stamp = split_route(value)
  seen(stamp)
  local cur = redis.call('HGET', KEYS[2], topic)
  local cur_stamp = cur and split_route(cur) or -1
  if stamp > cur_stamp and stamp > grave_of('r#' .. topic) then
    redis.call('HSET', KEYS[2], topic, value)
    push(KEYS[3], ARGV[1], 'route', topic, value, stamp)
    wrote_routes = wrote_routes + 1
  end
end
i = i + 2 * n + 1
local m = tonumber(ARGV[i])
for j = i + 1, i + 2 * m, 2 do
  local member, stamp = ARGV[j], tonumber(ARGV[j + 1])
  seen(stamp)
  local kind, name = string.sub(member, 1, 1), string.sub(member, 3)
  local hash = kind == 'f' and KEYS[1] or KEYS[2]
  local cur = redis.call('HGET', hash, name)
  if cur then
    local cur_stamp = kind == 'f' and item_stamp(cur) or split_route(cur)
    if cur_stamp < stamp then
      redis.call('HDEL', hash, name)
      if kind == 'f' then
        redis.call('ZREM', KEYS[5], name)
      end
      push(KEYS[3], ARGV[1], kind == 'f' and 'fault' or 'route', name, '', stamp)
      graves_applied = graves_applied + 1
    end
  end
  if stamp > grave_of(member) then
    redis.call('HSET', KEYS[6], member, fmt(stamp))
    redis.call('ZADD', KEYS[7], now, member)
  end
end
i = i + 2 * m + 1
local cap = tonumber(ARGV[6])
local event_cap = tonumber(ARGV[3])
for j = i, #ARGV, 2 do
  local broker, value = ARGV[j], ARGV[j + 1]
  local mine = parse_item(value)
  seen(mine.stamp)
  local cur = redis.call('HGET', KEYS[1], broker)
  local merged, old_end = nil, nil
  if not cur then
    if mine.stamp > grave_of('f#' .. broker) then
      if redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], MARK) < cap then
        merged = value
      else
        refused = refused + 1
      end
    end
  else
    local theirs = parse_item(cur)
    old_end = theirs.e
    -- detour.merge.merge_items: the rest from the newer copy (stamp, then stored form
    -- without the window), the window (end and reason) from the later one by its own order
    local newer, other = theirs, mine
    if mine.stamp > theirs.stamp or (mine.stamp == theirs.stamp and rest(mine) > rest(theirs)) then
      newer, other = mine, theirs
    end
    if window_later(other, newer) then
      newer.e, newer.why = other.e, other.why
    end
    local v = encode_item(newer)
    if v ~= cur then
      merged = v
    end
  end
  if merged ~= nil then
    local e = item_end(merged)
    redis.call('HSET', KEYS[1], broker, merged)
    redis.call('ZADD', KEYS[5], e, broker)
    push(KEYS[3], ARGV[1], 'fault', broker, merged, item_stamp(merged))
    wrote_items = wrote_items + 1
    if event_cap > 0 and e > now and (old_end == nil or e > old_end) then
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', event_cap, '*', 'k', 'opened', 'r', 'recovery',
        'b', broker, 't', '', 'n', 0, 'e', fmt(e), 'a', fmt(now))
    end
  end
end
-- Stamps the table gives from now on are above everything merged into it.
if top_stamp > tonumber(redis.call('HGET', KEYS[3], 'hlc') or '0') then
  redis.call('HSET', KEYS[3], 'hlc', fmt(top_stamp))
end
local version = tonumber(redis.call('HGET', KEYS[3], 'version') or '0')
if ARGV[5] == '1' then
  version = push(KEYS[3], ARGV[1], 'reseed', ARGV[4], epoch, top_stamp)
end
return {epoch, version, wrote_config, wrote_routes, wrote_items, graves_applied, refused}
