-- set_entry.lua: write or delete one entry of the shared table, stamp it and push it.
-- Used for routes (hash routes, field topic, stored "stamp|json"), the config (meta
-- "config" and "config_stamp") and an operator clearing a fault item (hash faults, delete).
-- A delete leaves a grave (the delete's stamp), so that a merge (reseed.lua) never brings
-- back what an operator removed.
-- KEYS[1] the hash   KEYS[2] meta hash (version, hlc, config_stamp, epoch)
-- KEYS[3] event log stream   KEYS[4] window ends sorted set (report.lua's KEYS[5])
-- KEYS[5] graves hash: "r#topic" / "f#broker" -> the delete's stamp
-- KEYS[6] graves index: sorted set of the same members by delete time (ms)
-- KEYS[7], KEYS[8] faults, routes hashes (with KEYS[5], the marks: lib/item.lua table_epoch)
-- ARGV[1] change channel   ARGV[2] kind ("route" | "config" | "fault")   ARGV[3] field
-- ARGV[4] value (a route's JSON, the config's JSON); "" deletes the field
-- ARGV[5] event log cap (0 = no event): an operator's delete of a broker whose window was
--         open is an event (k=ended r=operator, as report.lua's)
-- ARGV[6] the table epoch the caller holds: a table with another one (or none) is not
--         written: it was lost, and the caller merges first. "+id": the caller holds no
--         table yet: a table without an epoch takes id (report.lua's ARGV[7])
-- ARGV[7] the caller's stamp floor (lib/item.lua stamper)
-- ARGV[8] config only: the config stamp the caller's change was made on ("" = any): a
--         table whose config has another stamp is not written (a concurrent change)
-- ARGV[9] graves kept: ms   ARGV[10] graves kept: most
-- ARGV[11] a delete only: 1 when the caller's copy holds the entry. Its delete leaves the
--         grave and is pushed even where the table lacks the entry (a table that lost it
--         and is not merged yet): else a later merge from a copy that holds it would bring
--         back what the operator removed
-- returns {version, stamp}: version 0 when deleting a field that neither the table nor the
--   caller holds (nothing pushed); -1 when the epoch differs, -2 when the config changed
--   meanwhile (stamp: the table's config stamp); nothing written then
local now = clock_ms()
local marked = {KEYS[7], KEYS[8], KEYS[5]}
local epoch, held = table_epoch(KEYS[2], marked), ARGV[6]
if string.sub(held, 1, 1) == '+' then
  held = string.sub(held, 2)
  if epoch == '' then
    epoch = held
    mark_table(KEYS[2], epoch, marked)
  end
end
if epoch ~= held then
  return {-1, '0'}
end
local kind, field, value = ARGV[2], ARGV[3], ARGV[4]
if kind == 'config' and ARGV[8] ~= '' then
  local current = redis.call('HGET', KEYS[2], 'config_stamp') or '0'
  if current ~= ARGV[8] then
    return {-2, current}
  end
end
local stamps = stamper(KEYS[2], now, ARGV[7])
local stamp = stamps.next()
local stored = value
if value == '' then
  local old = redis.call('HGET', KEYS[1], field)
  if not old and ARGV[11] ~= '1' then
    return {0, '0'}
  end
  if old then
    redis.call('HDEL', KEYS[1], field)
  end
  local grave = (kind == 'fault' and 'f#' or 'r#') .. field
  redis.call('HSET', KEYS[5], grave, fmt(stamp))
  redis.call('ZADD', KEYS[6], now, grave)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now - tonumber(ARGV[9]), 'LIMIT', 0, 16)
  local extra = redis.call('ZCARD', KEYS[6]) - #gone - tonumber(ARGV[10])
  if extra > 0 then
    for _, g in ipairs(redis.call('ZRANGE', KEYS[6], 0, math.min(extra, 16) + #gone - 1)) do
      gone[#gone + 1] = g
    end
  end
  for _, g in ipairs(gone) do
    redis.call('HDEL', KEYS[5], g)
    redis.call('ZREM', KEYS[6], g)
  end
  if kind == 'fault' then
    redis.call('ZREM', KEYS[4], field)
    local e = old and item_end(old) or 0
    if tonumber(ARGV[5]) > 0 and e > now then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'k', 'ended', 'r', 'operator',
        'b', field, 't', '', 'n', 0, 'e', fmt(now), 'a', fmt(now))
    end
  end
elseif kind == 'config' then
  redis.call('HSET', KEYS[2], 'config', value, 'config_stamp', fmt(stamp))
else
  stored = fmt(stamp) .. '|' .. value
  redis.call('HSET', KEYS[1], field, stored)
end
stamps.done()
local version = push(KEYS[2], ARGV[1], kind, field, stored, stamp)
return {version, fmt(stamp)}
