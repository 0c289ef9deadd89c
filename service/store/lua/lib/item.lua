-- lib/item.lua: prepended to every script (service/store/scripts.py). A fault item, a route
-- and a table write's stamp, each read and written in one place.
--
-- A fault item is stored as codec.encode_fault writes it:
--   "stamp@latencyMs,availableAt[,isolations[,probation 0/1[,reachable 0/1]]]" then
--   ";producer=at" per suspect, ";producer=at=end" per slow vote, ";~producer=since=at" per
--   in-flight signal; the fields after availableAt only as far as the item keeps more; then
--   ";!reason=since=latencyMs=by" while a window is open (detour.model.Why). An item
--   written before stamps existed has no "stamp@" (stamp 0).
-- A route is stored as "stamp|" then its JSON; one written before stamps, as the JSON alone.
-- Stamps order the writes of a table (a hybrid logical clock): a write's stamp is above
-- every stamp the table gave before and every stamp the writer has seen (its floor), and
-- near Redis's clock (ms * 1000), so a table restored from an older copy still stamps new
-- writes above the lost ones. They are what merges (reseed.lua) compare.

local function fmt(n)
  return string.format('%.0f', n)
end

local function parse_item(v)
  local stamp, rest = string.match(v, '^(%d+)@(.*)$')
  if stamp == nil then
    stamp, rest = '0', v
  end
  local head, tail = string.match(rest, '^([^;]*)(.*)$')
  local l, e, n, pr, rc = string.match(head, '^(%d+),(%d+),?(%d*),?(%d*),?(%d*)$')
  local it = {stamp = tonumber(stamp), lat = l, e = tonumber(e), iso = tonumber(n) or 0,
    prob = pr == '1', reach = rc, suspects = {}, slow = {}, signals = {}, why = nil}
  for entry in string.gmatch(tail, ';([^;]*)') do
    local mark = string.sub(entry, 1, 1)
    if mark == '!' then
      local reason, since, lat, by = string.match(entry, '^!([^=]*)=(%d+)=(%d+)=(.*)$')
      it.why = {reason, tonumber(since), lat, by}
    else
      local who, when, ends_at = string.match(entry, '^([^=]*)=(%d+)=?(%d*)$')
      if mark == '~' then
        it.signals[#it.signals + 1] = {string.sub(who, 2), tonumber(when), tonumber(ends_at)}
      elseif ends_at == '' then
        it.suspects[#it.suspects + 1] = {who, tonumber(when)}
      else
        it.slow[#it.slow + 1] = {who, tonumber(when), tonumber(ends_at)}
      end
    end
  end
  return it
end

local function encode_item(it)
  local value = fmt(it.stamp) .. '@' .. it.lat .. ',' .. fmt(it.e)
  if it.iso > 0 or #it.suspects > 0 or #it.slow > 0 or #it.signals > 0 or it.prob
      or it.reach ~= '' then
    value = value .. ',' .. fmt(it.iso)
    if it.reach ~= '' then
      value = value .. ',' .. (it.prob and '1' or '0') .. ',' .. it.reach
    elseif it.prob then
      value = value .. ',1'
    end
    for _, s in ipairs(it.suspects) do
      value = value .. ';' .. s[1] .. '=' .. fmt(s[2])
    end
    for _, s in ipairs(it.slow) do
      value = value .. ';' .. s[1] .. '=' .. fmt(s[2]) .. '=' .. fmt(s[3])
    end
    for _, s in ipairs(it.signals) do
      value = value .. ';~' .. s[1] .. '=' .. fmt(s[2]) .. '=' .. fmt(s[3])
    end
  end
  if it.why ~= nil then
    local w = it.why
    value = value .. ';!' .. w[1] .. '=' .. fmt(w[2]) .. '=' .. w[3] .. '=' .. w[4]
  end
  return value
end

-- The window end of a stored item, without parsing the rest.
local function item_end(v)
  return tonumber(string.match(v, '^%d+@%d+,(%d+)') or string.match(v, '^%d+,(%d+)'))
end

-- The stamp of a stored item (0 before stamps existed).
local function item_stamp(v)
  return tonumber(string.match(v, '^(%d+)@') or '0')
end

-- The stamp of a stored route, and its JSON.
local function split_route(v)
  local stamp, json = string.match(v, '^(%d+)|(.*)$')
  if stamp == nil then
    return 0, v
  end
  return tonumber(stamp), json
end

-- Redis's clock in ms.
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Stamps for this call's writes: next() gives one per write, above the table's last stamp
-- (meta "hlc"), the caller's floor and now * 1000; done() keeps the last one given.
local function stamper(meta, now, floor)
  local last = math.max(tonumber(redis.call('HGET', meta, 'hlc') or '0'), tonumber(floor) or 0)
  local base, n = math.max(now * 1000, last + 1), -1
  return {
    next = function()
      n = n + 1
      return base + n
    end,
    done = function()
      if n >= 0 then
        redis.call('HSET', meta, 'hlc', fmt(base + n))
      end
    end,
  }
end

-- The table's lineage: each version the table reached, paired with a token that hashes the
-- token before it and the change that made it (meta "l:<version>", the last LINEAGE_KEPT
-- versions). Versions, stamps and the epoch of a table rolled back in place (older data
-- loaded into the live server) recover by themselves as new writes come in; the token at a
-- version does not: the changes after the fork differ, so the chains do. A replica keeps the
-- pair (version, token) it reached and asks whether the table's history still holds it
-- (lineage_holds): not so, the table is not the one it holds, and it merges.
local LINEAGE_KEPT = 1024

-- Whether the table's history holds the pair a replica reached ('' = a replica that knows
-- none: nothing to check). A version older than the kept history cannot be told: no.
local function lineage_holds(meta, version, token)
  return token == '' or redis.call('HGET', meta, 'l:' .. version) == token
end

-- The token of the table's version now ('' for none: a new table, or one written before
-- lineage existed).
local function lineage_now(meta, version)
  return redis.call('HGET', meta, 'l:' .. fmt(version)) or ''
end

-- Push one change to the other replicas: {k=kind, v=version, f=field, x=value, s=stamp,
-- l=the lineage token of v, p=the token of v - 1}: a replica at v - 1 whose token is not p
-- follows another history (a rollback in place).
-- A channel given as "#name" is a sharded channel (Redis Cluster, scripts.channel_arg):
-- SPUBLISH keeps the push on the shard serving the namespace's slot (the channel hashes
-- to it, as every key here does), where PUBLISH would be broadcast to every node.
local function push(meta, channel, kind, field, value, stamp)
  local v = redis.call('HINCRBY', meta, 'version', 1)
  local s = fmt(stamp or 0)
  local prev = redis.call('HGET', meta, 'l:' .. fmt(v - 1)) or ''
  local token = string.sub(
    redis.sha1hex(prev .. '\n' .. kind .. '\n' .. field .. '\n' .. value .. '\n' .. s), 1, 16)
  redis.call('HSET', meta, 'l:' .. fmt(v), token)
  redis.call('HDEL', meta, 'l:' .. fmt(v - LINEAGE_KEPT))
  local message = cjson.encode({k = kind, v = v, f = field, x = value, s = s, l = token,
    p = prev})
  if string.sub(channel, 1, 1) == '#' then
    redis.call('SPUBLISH', string.sub(channel, 2), message)
  else
    redis.call('PUBLISH', channel, message)
  end
  return v
end

-- The table's epoch, kept in meta and, as the field MARK, in each hash a select or a merge
-- reads (faults, routes, graves). Redis drops keys whole (an evicting maxmemory-policy, a
-- DEL of one key): a table whose meta outlived one of its hashes lacks that hash's mark,
-- and has no epoch then, whatever meta says, so every replica merges what it holds, as on
-- any other loss. MARK is no name a broker, a topic or a grave may have (NAME_PATTERN);
-- codec.MARK is the same field for the readers of whole hashes.
local MARK = '~epoch'

local function table_epoch(meta, marked)
  local epoch = redis.call('HGET', meta, 'epoch')
  if not epoch then
    return ''
  end
  for _, key in ipairs(marked) do
    if redis.call('HGET', key, MARK) ~= epoch then
      return ''
    end
  end
  return epoch
end

local function mark_table(meta, epoch, marked)
  redis.call('HSET', meta, 'epoch', epoch)
  for _, key in ipairs(marked) do
    redis.call('HSET', key, MARK, epoch)
  end
end
