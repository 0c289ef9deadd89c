-- report.lua: apply latency reports to brokers' fault items, on Redis's clock, atomically,
-- and append each to the latency log. The rule is service.policy.apply (a differential
-- test feeds both the same reports).
-- KEYS[1] faults hash (broker -> "latencyMs,availableAt" or, when the policy keeps more,
--         "latencyMs,availableAt,isolations[,probation[,reachable]];producer=at;...": see
--         service/store/codec.py; a report keeps the detector's reachable as it is)
-- KEYS[2] meta hash (version, config_version, config)
-- KEYS[3] latency log stream (entries b=broker l=latency ms i=isolation 0/1 p=producer
--         t=report time ms)
-- KEYS[4] event log stream: one entry per window opened, extended, ended early or opened by
--         quorum (k=kind r=reason b=broker t=tier ms or "" n=reporters e=window end a=at);
--         the kinds and reasons are service.policy.window_event's
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
--         per refused report. A dropped item takes its isolation count and suspects with it.
-- ARGV[6] policy: "quorum,quorumWindowMs,keepMs,repeat(0/1),maxIsolationMs,repeatDecayMs,
--         jitterPercent,jitterScale,maxSuspects,maxIsolations,eventLogCap,probeOnExpiry(0/1)"
--         (eventLogCap 0 = no log)
-- ARGV[7..] ten values per report, applied in order: broker, latency ms, the tier's window
--         duration ms, age ms (the report happened at now - age), isolation (0/1), producer
--         ("" = none), quorum (1: a failure that waits for the quorum), jitter roll
--         (0..jitterScale-1), the tier's latencyMax ms ("" below every tier), voter (who the
--         quorum counts: the token's identity with tokens, else the producer)
-- returns {status, now ms, {availableAt}, {version}, {change}, evicted, {quorum}, {duration},
--   {value}, {probe}} with one entry per report; evicted: the number of items dropped to make
--   room; probe: 0 none, 1 passed (a success re-opened a broker on probation), 2 failed
--   status 1: applied. version > 0: the report changed the window, the suspects or the
--             probation and was
--             pushed as {k="fault", v=version, f=broker, x=value};
--             change: 0 none, 1 opened, 2 moved, 3 cleared; quorum: 0 n/a, 1 suspected,
--             2 reached; duration: the window asked for after quorum, backoff and jitter;
--             value: the item as stored ("" with avoidance off)
--   status -2: the table is full (nothing written): {} {} {} and evicted as the sixth element
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
local p = {}
for x in string.gmatch(ARGV[6], '[^,]+') do
  p[#p + 1] = tonumber(x)
end
local quorum, quorum_window, keep_ms, repeat_on = p[1], p[2], p[3], p[4] == 1
local max_isolation, decay, jitter_pct, jitter_scale = p[5], p[6], p[7], p[8]
local max_suspects, max_isolations, event_cap, probe_on = p[9], p[10], p[11], p[12] == 1

local function fmt(n)
  return string.format('%.0f', n)
end

local function by_time(a, b)
  return a[2] < b[2] or (a[2] == b[2] and a[1] < b[1])
end

local evicted = 0
if rule ~= 'off' then
  local cap = tonumber(ARGV[5])
  local function count_new()
    local new, seen = 0, {}
    for i = 7, #ARGV, 10 do
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
          local item_end = tonumber(string.match(all[j + 1], '^%d+,(%d+)'))
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
local ends, versions, changes, quorums, durations, values, probes = {}, {}, {}, {}, {}, {}, {}
for i = 7, #ARGV, 10 do
  local broker, latency = ARGV[i], ARGV[i + 1]
  local at = now - tonumber(ARGV[i + 3])
  local isolation, producer, voter = ARGV[i + 4], ARGV[i + 5], ARGV[i + 9]
  local old = redis.call('HGET', KEYS[1], broker)
  local old_end, old_iso, suspects, old_probation, reach = nil, 0, {}, false, ''
  if old then
    local head, tail = string.match(old, '^([^;]*)(.*)$')
    local _, e, n, pr, rc = string.match(head, '^(%d+),(%d+),?(%d*),?(%d*),?(%d*)$')
    reach = rc
    old_end = tonumber(e)
    old_iso = tonumber(n) or 0
    old_probation = pr == '1'
    for who, when in string.gmatch(tail, ';([^=;]*)=(%d+)') do
      suspects[#suspects + 1] = {who, tonumber(when)}
    end
  end
  local version, change, quorum_state, value, reporters, probe = 0, 0, 0, '', 1, 0
  local duration = tonumber(ARGV[i + 2])
  local new_end
  if rule == 'off' then
    new_end = old_end or now
    duration = 0
  else
    if ARGV[i + 6] == '1' then
      -- policy.quorum_step: one entry per producer (its latest failure), newest kept.
      local kept, mine = {}, at
      for _, s in ipairs(suspects) do
        if s[1] == voter then
          if s[2] > mine then
            mine = s[2]
          end
        elseif s[2] > now - keep_ms then
          kept[#kept + 1] = s
        end
      end
      kept[#kept + 1] = {voter, mine}
      table.sort(kept, by_time)
      while #kept > max_suspects do
        table.remove(kept, 1)
      end
      local voters = 0
      for _, s in ipairs(kept) do
        if s[2] > now - quorum_window then
          voters = voters + 1
        end
      end
      if voters >= quorum then
        suspects, quorum_state, reporters = {}, 2, voters
      else
        suspects, quorum_state, duration = kept, 1, 0
      end
    end
    local iso = old_iso
    if isolation == '1' and duration > 0 then
      -- policy.backoff
      if repeat_on then
        if old_end == nil or old_end <= at then
          local prev = old_iso
          if old_end ~= nil and prev > 0 then
            prev = math.max(0, prev - math.floor((at - old_end) / decay))
          end
          iso = math.min(prev + 1, max_isolations)
        else
          iso = math.max(old_iso, 1)
        end
        duration = math.max(duration, math.min(duration * iso, max_isolation))
      else
        iso = 0
      end
      if jitter_pct > 0 then
        duration = duration
          + math.floor(duration * jitter_pct * tonumber(ARGV[i + 7]) / (100 * jitter_scale))
      end
    end
    new_end = at + duration
    if rule == 'extend' and old_end and old_end > new_end then
      new_end = old_end
    end
    -- policy.apply: probation
    local probation = old_probation and probe_on
    local probing = probation and old_end ~= nil and at >= old_end
    if not probe_on then
      probation = false
    elseif duration > 0 then
      probation = true
      if probing then
        probe = 2
      end
    elseif probing and isolation ~= '1' then
      probation, probe = false, 1
    end
    value = latency .. ',' .. fmt(new_end)
    if iso > 0 or #suspects > 0 or probation or reach ~= '' then
      value = value .. ',' .. fmt(iso)
      if reach ~= '' then
        value = value .. ',' .. (probation and '1' or '0') .. ',' .. reach
      elseif probation then
        value = value .. ',1'
      end
      for _, s in ipairs(suspects) do
        value = value .. ';' .. s[1] .. '=' .. fmt(s[2])
      end
    end
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
    if (change > 0 or probe == 1) and event_cap > 0 then
      -- policy.window_event
      local kind, reason = 'extended', 'latency'
      if probe == 1 then
        kind, reason = 'ended', 'probe'
      elseif probe == 2 and change == 1 then
        kind, reason = 'opened', 'probe'
      elseif change == 3 then
        kind, reason = 'ended', 'success'
      elseif change == 1 and quorum_state == 2 then
        kind, reason = 'quorum', 'quorum'
      else
        if change == 1 then
          kind = 'opened'
        end
        if isolation == '1' then
          reason = 'isolation'
        end
      end
      redis.call('XADD', KEYS[4], 'MAXLEN', '~', event_cap, '*', 'k', kind, 'r', reason,
        'b', broker, 't', ARGV[i + 8], 'n', reporters, 'e', fmt(new_end), 'a', fmt(at))
    end
    -- A suspect is pushed too: its producer avoids the broker on every replica; so is a
    -- probation set or lifted.
    if change > 0 or quorum_state > 0 or probation ~= old_probation then
      version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
    end
  end
  if log_cap > 0 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', log_cap, '*', 'b', broker, 'l', latency,
      'i', isolation, 'p', producer, 't', fmt(at))
  end
  ends[#ends + 1] = new_end
  versions[#versions + 1] = version
  changes[#changes + 1] = change
  quorums[#quorums + 1] = quorum_state
  durations[#durations + 1] = duration
  probes[#probes + 1] = probe
  values[#values + 1] = value
end
return {1, now, ends, versions, changes, evicted, quorums, durations, values, probes}
