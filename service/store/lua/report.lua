-- report.lua: apply latency reports to brokers' fault items, on Redis's clock, atomically,
-- and append each to the latency log. The rule is service.policy.apply (a differential
-- test feeds both the same reports).
-- KEYS[1] faults hash (broker -> "latencyMs,availableAt" or, when the policy keeps more,
--         "latencyMs,availableAt,isolations[,probation[,reachable]];producer=at;...", then
--         ";producer=at=end" per slow answer short of the latency quorum, ";~producer=since=at"
--         per in-flight signal (at 0: withdrawn by a completed send at since): see
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
-- KEYS[5] window ends: sorted set broker -> availableAt, the eviction index (no scan of the
--         table per report; rebuilt once from the hash when it holds fewer members)
-- KEYS[6] writers hash: writer -> its sequence high-water mark; writer|gaps -> the numbers
--         below it not applied yet ("lo-hi,..." oldest first, at most seqWindow ranges: a
--         number older than the oldest kept gap counts as applied)
-- KEYS[7] writers seen: sorted set writer -> last write ms (bounds KEYS[6]: a writer silent
--         longer than the longest a journal keeps a report is forgotten)
-- KEYS[8] report ids: sorted set reportId -> first seen ms, the producers' own identities
-- ARGV[5] table cap: fault items the hash may hold. When the reports name brokers not in it
--         and it would overflow, items whose window has ended are dropped, oldest end first,
--         found in KEYS[5] (each pushed as a delete); if live windows still fill it, nothing is
--         written. A dropped item takes its isolation count and suspects with it.
-- ARGV[6] policy: "quorum,quorumWindowMs,keepMs,repeat(0/1),maxIsolationMs,repeatDecayMs,
--         jitterPercent,jitterScale,maxSuspects,maxIsolations,eventLogCap,probeOnExpiry(0/1),
--         latencyQuorum,earlyRecovery(0/1),rampMs,pendingQuorum"
--         (eventLogCap 0 = no log)
-- ARGV[7] the table epoch the caller holds: a table with another epoch (or none: emptied,
--         flushed, failed over) is not written (status -3). "+id": the caller holds no table
--         yet (its first write to a new one): a table without an epoch takes id as its epoch
-- ARGV[8] writer (the replica's id)
-- ARGV[9] integrity: "acked,seqWindow,idWindowMs,idCap,writerKeepMs,writerCap": acked is the
--         highest sequence number the writer saw applied; a stored high-water mark below it
--         means the table lost writes (status -3)
-- ARGV[10..] twelve values per report, applied in order: broker, latency ms, the tier's window
--         duration ms, age ms (the report happened at now - age), isolation (0/1), producer
--         ("" = none), quorum (1: a failure that waits for the isolation quorum, 2: a slow
--         answer that waits for the latency quorum, 3: an in-flight signal, policy.apply_pending:
--         its window duration is pending_duration's, 0 = records nothing; never logged),
--         jitter roll
--         (0..jitterScale-1), the tier's latencyMax ms ("" below every tier), voter (who the
--         quorum counts: the token's identity with tokens, else the producer), the writer's
--         sequence number (0 = none), report id ("" = none). A report whose sequence number
--         or id was applied already changes nothing and is not logged again.
--         A summary entry (isolation "s": the reports the writer kept local, see
--         service/store/aggregate.py) reads: broker, latest latency ("" = keep), age ms of
--         the interval's first report, age ms of the latest, "s", histogram counts per
--         bucket of service.model.LATENCY_BUCKETS ("c0,c1,..."), 0, 0, "", producer,
--         sequence number, "". It sets the latency of an item that exists and logs
--         {b=broker h=counts s=first ms p=producer w=writer t=latest ms}; no window, no push.
-- returns {status, now ms, {availableAt}, {version}, {change}, evicted, {quorum}, {duration},
--   {value}, {probe}, {duplicate}} with one entry per report; evicted: the number of items
--   dropped to make room; probe: 0 none, 1 passed (a success re-opened a broker on probation),
--   2 failed; duplicate: 1 when the report had been applied already (nothing done)
--   status 1: applied. version > 0: the report changed the window, the suspects or the
--             probation and was
--             pushed as {k="fault", v=version, f=broker, x=value};
--             change: 0 none, 1 opened, 2 moved, 3 cleared; quorum: 0 n/a, 1 suspected,
--             2 reached; duration: the window asked for after quorum, backoff and jitter;
--             value: the item as stored ("" with avoidance off)
--   status -2: the table is full (nothing written): {} {} {} and evicted as the sixth element
--   status -1: the caller's config is stale: nothing written; {} {} {} and the current config
--             version as the sixth element
--   status -3: the table is not the one the caller holds (lost): nothing written; {} {} {}
--             and the table's epoch ("" = none) as the sixth element
local FIRST, STRIDE = 10, 12
local epoch = redis.call('HGET', KEYS[2], 'epoch') or ''
local writer = ARGV[8]
local g = {}
for x in string.gmatch(ARGV[9], '[^,]+') do
  g[#g + 1] = tonumber(x)
end
local acked, seq_window, id_window, id_cap, writer_keep, writer_cap =
  g[1], g[2], g[3], g[4], g[5], g[6]
local hwm = tonumber(redis.call('HGET', KEYS[6], writer) or '0')
local held = ARGV[7]
if string.sub(held, 1, 1) == '+' then
  -- The caller holds no table yet: a table without an epoch takes its candidate.
  held = string.sub(held, 2)
  if epoch == '' then
    epoch = held
    redis.call('HSET', KEYS[2], 'epoch', epoch)
  end
end
if epoch ~= held or hwm < acked then
  local t0 = redis.call('TIME')
  return {-3, tonumber(t0[1]) * 1000 + math.floor(tonumber(t0[2]) / 1000), {}, {}, {}, epoch}
end
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
local latency_quorum = p[13] or 1
-- policy.probation_on: earlyRecovery obeys the probation flag too (a window ended early)
local probe_expiry, ramp = probe_on, (p[15] or 0) > 0
probe_on = probe_on or p[14] == 1
local pending_quorum = p[16] or 0

local function fmt(n)
  return string.format('%.0f', n)
end

local function by_time(a, b)
  return a[2] < b[2] or (a[2] == b[2] and a[1] < b[1])
end

-- policy._bounded: the producer's entry replaced, others kept while recent, newest kept.
local function bounded_signals(signals, who, entry)
  local kept = {}
  for _, s in ipairs(signals) do
    if s[1] ~= who and math.max(s[2], s[3]) > now - quorum_window then
      kept[#kept + 1] = s
    end
  end
  kept[#kept + 1] = entry
  table.sort(kept, function(a, b)
    local x, y = math.max(a[2], a[3]), math.max(b[2], b[3])
    return x < y or (x == y and a[1] < b[1])
  end)
  while #kept > max_suspects do
    table.remove(kept, 1)
  end
  return kept
end

-- A fault item as codec.encode_fault writes it.
local function encode_value(lat, new_end, iso, probation, reach, suspects, slow, signals)
  local value = lat .. ',' .. fmt(new_end)
  if iso > 0 or #suspects > 0 or #slow > 0 or #signals > 0 or probation or reach ~= '' then
    value = value .. ',' .. fmt(iso)
    if reach ~= '' then
      value = value .. ',' .. (probation and '1' or '0') .. ',' .. reach
    elseif probation then
      value = value .. ',1'
    end
    for _, s in ipairs(suspects) do
      value = value .. ';' .. s[1] .. '=' .. fmt(s[2])
    end
    for _, s in ipairs(slow) do
      value = value .. ';' .. s[1] .. '=' .. fmt(s[2]) .. '=' .. fmt(s[3])
    end
    for _, s in ipairs(signals) do
      value = value .. ';~' .. s[1] .. '=' .. fmt(s[2]) .. '=' .. fmt(s[3])
    end
  end
  return value
end

-- policy.live_signals: producers with an open signal within the quorum window.
local function live_voters(signals)
  local n = 0
  for _, s in ipairs(signals) do
    if s[3] > 0 and s[3] > now - quorum_window and s[1] ~= '~' then
      n = n + 1
    end
  end
  return n
end

local evicted = 0
if rule ~= 'off' then
  local cap = tonumber(ARGV[5])
  local function count_new()
    local new, seen = 0, {}
    for i = FIRST, #ARGV, STRIDE do
      local broker = ARGV[i]
      -- (a summary entry creates no item)
      if not seen[broker] and ARGV[i + 4] ~= 's' then
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
      if redis.call('ZCARD', KEYS[5]) < size then
        -- A table written before the index existed: index it once.
        local all = redis.call('HGETALL', KEYS[1])
        for j = 1, #all, 2 do
          redis.call('ZADD', KEYS[5], tonumber(string.match(all[j + 1], '^%d+,(%d+)')), all[j])
        end
      end
      -- The items whose window ended longest ago, as many as needed (and a few more, so
      -- the next new brokers find room at once).
      local ended = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0,
        size + new - cap + 16)
      for _, broker in ipairs(ended) do
        redis.call('HDEL', KEYS[1], broker)
        redis.call('ZREM', KEYS[5], broker)
        local v = redis.call('HINCRBY', KEYS[2], 'version', 1)
        redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = v, f = broker, x = ''}))
        evicted = evicted + 1
      end
      size = size - evicted
      if evicted > 0 then
        -- a broker of these reports may have been one of the dropped
        new = count_new()
      end
      if size + new > cap then
        return {-2, now, {}, {}, {}, evicted}
      end
    end
  end
end
local ends, versions, changes, quorums, durations, values, probes, dups, summaries =
  {}, {}, {}, {}, {}, {}, {}, {}, {}
-- The writer's sequence numbers below its high-water mark that were not applied (a call
-- that failed, or one still in flight): inclusive ranges, oldest first, at most seq_window.
local gaps = {}
for lo, hi in string.gmatch(redis.call('HGET', KEYS[6], writer .. '|gaps') or '', '(%d+)-(%d+)') do
  gaps[#gaps + 1] = {tonumber(lo), tonumber(hi)}
end
local top = hwm
local function seen_before(seq, rid)
  if seq > 0 and seq <= top then
    for _, gap in ipairs(gaps) do
      if gap[1] <= seq and seq <= gap[2] then
        return rid ~= '' and redis.call('ZSCORE', KEYS[8], rid) ~= false
      end
    end
    return true
  end
  return rid ~= '' and redis.call('ZSCORE', KEYS[8], rid) ~= false
end
local function mark(seq)
  if seq > top then
    if seq > top + 1 then
      gaps[#gaps + 1] = {top + 1, seq - 1}
    end
    top = seq
  else
    for j, gap in ipairs(gaps) do
      if gap[1] <= seq and seq <= gap[2] then
        local keep = {}
        if gap[1] < seq then
          keep[#keep + 1] = {gap[1], seq - 1}
        end
        if seq < gap[2] then
          keep[#keep + 1] = {seq + 1, gap[2]}
        end
        table.remove(gaps, j)
        for k = #keep, 1, -1 do
          table.insert(gaps, j, keep[k])
        end
        break
      end
    end
  end
end
for i = FIRST, #ARGV, STRIDE do
  local broker, latency = ARGV[i], ARGV[i + 1]
  local seq, rid = tonumber(ARGV[i + 10]), ARGV[i + 11]
  if seen_before(seq, rid) then
    local cur = redis.call('HGET', KEYS[1], broker)
    local cur_end = cur and tonumber(string.match(cur, '^%d+,(%d+)')) or now
    ends[#ends + 1] = cur_end
    versions[#versions + 1] = 0
    changes[#changes + 1] = 0
    quorums[#quorums + 1] = 0
    durations[#durations + 1] = 0
    probes[#probes + 1] = 0
    values[#values + 1] = cur or ''
    dups[#dups + 1] = 1
  elseif ARGV[i + 4] == 's' then
    -- A summary of the reports this replica kept local (policy.quiet, docs/semantics.md):
    -- one histogram entry in the latency log now; the broker's latest latency ("" = a later
    -- report wrote it already) after the loop, in one HMGET and one HSET for all summaries,
    -- on items that exist (window, suspects and probation as they are: none of these
    -- reports could change them).
    if seq > 0 then
      mark(seq)
    end
    if log_cap > 0 then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', log_cap, '*', 'b', broker, 'h', ARGV[i + 5],
        's', fmt(now - tonumber(ARGV[i + 2])), 'p', ARGV[i + 9], 'w', writer,
        't', fmt(now - tonumber(ARGV[i + 3])))
    end
    summaries[#summaries + 1] = {broker, latency, #ends + 1}
    ends[#ends + 1] = now
    versions[#versions + 1] = 0
    changes[#changes + 1] = 0
    quorums[#quorums + 1] = 0
    durations[#durations + 1] = 0
    probes[#probes + 1] = 0
    values[#values + 1] = ''
    dups[#dups + 1] = 0
  else
  if seq > 0 then
    mark(seq)
  end
  if rid ~= '' then
    redis.call('ZADD', KEYS[8], now, rid)
  end
  local at = now - tonumber(ARGV[i + 3])
  local isolation, producer, voter = ARGV[i + 4], ARGV[i + 5], ARGV[i + 9]
  local old = redis.call('HGET', KEYS[1], broker)
  local old_end, old_iso, suspects, old_probation, reach = nil, 0, {}, false, ''
  local slow, own_ended, signals = {}, false, {}
  if old then
    local head, tail = string.match(old, '^([^;]*)(.*)$')
    local _, e, n, pr, rc = string.match(head, '^(%d+),(%d+),?(%d*),?(%d*),?(%d*)$')
    reach = rc
    old_end = tonumber(e)
    old_iso = tonumber(n) or 0
    old_probation = pr == '1'
    for who, when, ends_at in string.gmatch(tail, ';([^=;]*)=(%d+)=?(%d*)') do
      if string.sub(who, 1, 1) == '~' then
        signals[#signals + 1] = {string.sub(who, 2), tonumber(when), tonumber(ends_at)}
      elseif ends_at == '' then
        suspects[#suspects + 1] = {who, tonumber(when)}
      else
        slow[#slow + 1] = {who, tonumber(when), tonumber(ends_at)}
      end
    end
  end
  local version, change, quorum_state, value, reporters, probe = 0, 0, 0, '', 1, 0
  local duration = tonumber(ARGV[i + 2])
  local new_end
  if ARGV[i + 6] == '3' then
    -- policy.apply_pending: record the signal; a quorum of them opens the window (extend
    -- only); nothing at all with pendingQuorum 0, avoidance off or no windowed tier.
    new_end = old_end or 0
    local mine, accepted = nil, rule ~= 'off' and pending_quorum > 0 and duration > 0
    for _, s in ipairs(signals) do
      if s[1] == voter then
        mine = s
      end
    end
    local since, sig_at = at - tonumber(latency), at
    if accepted and mine ~= nil then
      if mine[3] == 0 then
        accepted = since > mine[2]
      else
        since, sig_at = math.min(since, mine[2]), math.max(sig_at, mine[3])
      end
    end
    if not accepted then
      duration = 0
      value = old or ''
    else
      signals = bounded_signals(signals, voter, {voter, since, sig_at})
      local voters = live_voters(signals)
      if voters >= pending_quorum then
        quorum_state, reporters = 2, voters
        if at + duration > new_end then
          -- held by the signals (policy.settle_pending may end it early)
          new_end = at + duration
          signals = bounded_signals(signals, '~', {'~', new_end, 0})
        end
      else
        quorum_state, duration = 1, 0
      end
      value = encode_value(old and string.match(old, '^(%d+)') or '0', new_end, old_iso,
        old_probation, reach, suspects, slow, signals)
      redis.call('HSET', KEYS[1], broker, value)
      redis.call('ZADD', KEYS[5], new_end, broker)
      local was_open = old_end ~= nil and old_end > now
      if new_end > now and not was_open then
        change = 1
      elseif new_end > now and new_end ~= old_end then
        change = 2
      end
      if change > 0 and event_cap > 0 then
        redis.call('XADD', KEYS[4], 'MAXLEN', '~', event_cap, '*', 'k',
          change == 1 and 'opened' or 'extended', 'r', 'pending', 'b', broker, 't', ARGV[i + 8],
          'n', reporters, 'e', fmt(new_end), 'a', fmt(at))
      end
      version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
    end
  elseif rule == 'off' then
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
    elseif ARGV[i + 6] == '2' then
      -- policy.latency_vote: one entry per producer (latest answer, latest window end).
      local since, kept, mine, mine_end = now - quorum_window, {}, at, at + duration
      for _, s in ipairs(slow) do
        if s[1] == voter then
          mine = math.max(mine, s[2])
          if rule ~= 'overwrite' then
            mine_end = math.max(mine_end, s[3])
          end
        elseif s[2] > since or s[3] > now then
          kept[#kept + 1] = s
        end
      end
      kept[#kept + 1] = {voter, mine, mine_end}
      table.sort(kept, by_time)
      while #kept > max_suspects do
        table.remove(kept, 1)
      end
      local voters = 0
      for _, s in ipairs(kept) do
        if s[2] > since then
          voters = voters + 1
        end
      end
      if voters >= latency_quorum then
        slow, quorum_state, reporters = {}, 2, voters
      else
        slow, quorum_state, duration = kept, 1, 0
      end
    elseif rule == 'overwrite' and #slow > 0 then
      -- lastReportWins overwrites the reporter's own window too
      local kept = {}
      for _, s in ipairs(slow) do
        if s[1] ~= voter then
          kept[#kept + 1] = s
        end
      end
      own_ended = #kept < #slow
      slow = kept
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
      probation = probe_expiry
      if probing then
        probe = 2
      end
    elseif probing and isolation ~= '1' then
      probation, probe = false, 1
    end
    if ramp and duration == 0 and probe == 0 then
      -- policy.ramp_end: a report that opens no window keeps the last window's end
      if old_end == nil then
        new_end = 0
      elseif old_end <= at then
        new_end = old_end
      end
    end
    -- policy.withdraw_pending: a completed send withdraws its producer's signal
    local withdrawn = false
    for _, s in ipairs(signals) do
      if s[1] == voter then
        local done = at
        if s[3] == 0 then
          done = math.max(at, s[2])
        end
        withdrawn = s[3] > 0
        signals = bounded_signals(signals, voter, {voter, done, 0})
        break
      end
    end
    own_ended = own_ended or withdrawn
    -- policy.settle_pending: a window the signals hold
    local hold = nil
    for _, s in ipairs(signals) do
      if s[1] == '~' then
        hold = s[2]
      end
    end
    if hold ~= nil then
      local released = {}
      for _, s in ipairs(signals) do
        if s[1] ~= '~' then
          released[#released + 1] = s
        end
      end
      if new_end ~= hold then
        signals = released
      elseif isolation ~= '1' and live_voters(signals) < pending_quorum then
        signals = released
        new_end = math.min(new_end, at)
      end
    end
    value = encode_value(latency, new_end, iso, probation, reach, suspects, slow, signals)
    redis.call('HSET', KEYS[1], broker, value)
    redis.call('ZADD', KEYS[5], new_end, broker)
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
    -- slow vote ended by lastReportWins, and a probation set or lifted.
    if change > 0 or quorum_state > 0 or own_ended or probation ~= old_probation then
      version = redis.call('HINCRBY', KEYS[2], 'version', 1)
      redis.call('PUBLISH', ARGV[3], cjson.encode({k = 'fault', v = version, f = broker, x = value}))
    end
  end
  if log_cap > 0 and ARGV[i + 6] ~= '3' then
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
  dups[#dups + 1] = 0
  end
end
if #summaries > 0 then
  local names = {}
  for j, sm in ipairs(summaries) do
    names[j] = sm[1]
  end
  local cur = redis.call('HMGET', KEYS[1], unpack(names))
  local set = {}
  for j, sm in ipairs(summaries) do
    local v = cur[j]
    if v then
      if sm[2] ~= '' and rule ~= 'off' then
        v = sm[2] .. string.match(v, '^%d+(.*)$')
        set[#set + 1] = sm[1]
        set[#set + 1] = v
      end
      ends[sm[3]] = tonumber(string.match(v, '^%d+,(%d+)'))
      values[sm[3]] = v
    end
  end
  if #set > 0 then
    redis.call('HSET', KEYS[1], unpack(set))
  end
end
if top > 0 then
  while #gaps > seq_window do
    table.remove(gaps, 1)
  end
  local parts = {}
  for _, gap in ipairs(gaps) do
    parts[#parts + 1] = string.format('%.0f-%.0f', gap[1], gap[2])
  end
  if #parts > 0 then
    redis.call('HSET', KEYS[6], writer .. '|gaps', table.concat(parts, ','))
  else
    redis.call('HDEL', KEYS[6], writer .. '|gaps')
  end
  redis.call('HSET', KEYS[6], writer, string.format('%.0f', top))
end
if top > 0 then
  redis.call('ZADD', KEYS[7], now, writer)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now - writer_keep, 'LIMIT', 0, 4)
  local extra = redis.call('ZCARD', KEYS[7]) - writer_cap
  if extra > 0 then
    for _, w in ipairs(redis.call('ZRANGE', KEYS[7], 0, math.min(extra, 4) - 1)) do
      gone[#gone + 1] = w
    end
  end
  for _, w in ipairs(gone) do
    redis.call('HDEL', KEYS[6], w, w .. '|gaps')
    redis.call('ZREM', KEYS[7], w)
  end
end
if ARGV[FIRST + 11] ~= nil then
  local any_id = false
  for i = FIRST, #ARGV, STRIDE do
    if ARGV[i + 11] ~= '' then
      any_id = true
    end
  end
  if any_id then
    redis.call('ZREMRANGEBYSCORE', KEYS[8], '-inf', now - id_window)
    local ids = redis.call('ZCARD', KEYS[8])
    if ids > id_cap then
      redis.call('ZREMRANGEBYRANK', KEYS[8], 0, ids - id_cap - 1)
    end
  end
end
return {1, now, ends, versions, changes, evicted, quorums, durations, values, probes, dups}
