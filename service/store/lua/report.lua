-- report.lua: apply reports to brokers' fault items on Redis's clock, atomically, and log
-- each. The rule is detour.apply.apply_one (tests/test_report_rule.py drives random report
-- sequences through both and compares the tables); it runs here so that it is atomic on
-- Redis's table and clock. Items are read and written by lib/item.lua.
-- KEYS[1] faults hash (broker -> item)   KEYS[2] meta hash (version, hlc, config_stamp,
--         config, epoch)
-- KEYS[3] latency log stream (b=broker l=latency ms i=isolation 0/1 p=producer t=ms)
-- KEYS[4] event log stream: one entry per window opened, extended, ended early or opened
--         by quorum (k=kind r=reason b=broker t=tier ms or "" n=reporters e=window end a=at);
--         the kinds and reasons are detour.policy.events.window_event's
-- KEYS[5] window ends: sorted set broker -> availableAt, the eviction index
-- KEYS[6] writers hash: writer -> its sequence high-water mark; writer|gaps -> the numbers
--         below it not applied yet ("lo-hi,..." oldest first, at most seqWindow ranges: a
--         number older than the oldest kept gap counts as applied)
-- KEYS[7] writers seen: sorted set writer -> last write ms (bounds KEYS[6])
-- KEYS[8] report ids hash: "scope#reportId" -> "first ms|fingerprint|availableAt|duration|
--         change|quorum|probe" (the first answer)
-- KEYS[9] report ids index: sorted set (score 0) of "scope#first ms (13 digits)#reportId",
--         so a scope's oldest ids come first (ZRANGEBYLEX) and are counted by ZLEXCOUNT
-- KEYS[10] ids forgotten: hash scope -> the newest first sighting (ms) of an id it dropped
-- KEYS[11], KEYS[12] routes, graves hashes (with KEYS[1], the marks: lib/item.lua table_epoch)
-- ARGV[1] the config stamp the caller chose durations and rule with: the table's is newer
--         -> status -1 (stale, nothing written); older -> status -3 (the table lost it)
-- ARGV[2] update rule: "extend", "overwrite" (lastReportWins) or "off" (avoidance disabled)
-- ARGV[3] change channel   ARGV[4] latency log cap (approximate trim; 0 = no log)
-- ARGV[5] table cap: fault items the hash may hold; past it, items whose window has ended
--         are dropped, oldest end first (and 16 more), each pushed as a delete; if open
--         windows still fill it, nothing is written (status -2)
-- ARGV[6] policy: "quorum,quorumWindowMs,keepMs,repeat(0/1),maxIsolationMs,repeatDecayMs,
--         jitterPercent,jitterScale,maxSuspects,maxIsolations,eventLogCap,probeOnExpiry(0/1),
--         latencyQuorum,earlyRecovery(0/1),rampMs,pendingQuorum" (codec.REPORT_POLICY)
-- ARGV[7] the table epoch the caller holds: another (or none) -> status -3, nothing written.
--         "+id": the caller holds no table yet: a table without an epoch takes id
-- ARGV[8] writer (the replica's id)
-- ARGV[9] integrity "acked,seqWindow,idWindowMs,idCap,writerKeepMs,writerCap,idMarginMs":
--         acked is the highest sequence number the writer saw applied; a high-water mark
--         below it means the table lost writes (status -3)
-- ARGV[10] the caller's stamp floor: the highest stamp it has seen (lib/item.lua stamper)
-- ARGV[11] base: the caller's reading of this table's clock that the ages below are from
--         ("" = now). A report happened at base - age, never after now (``dated``: the
--         date the replica answered with, however late this call runs; detour.apply
--         ReportIn.at)
-- ARGV[12..] fourteen values per report, applied in order: broker, latency ms, the tier's
--         window ms, age ms (it happened at base - age), isolation (0/1), producer ("" =
--         none), quorum (1: a failure that waits for the isolation quorum, 2: a slow answer
--         that waits for the latency quorum, 3: an in-flight signal, whose window ms is
--         pending_duration's), jitter roll (0..jitterScale-1), the tier's latencyMax ms
--         ("" below every tier), voter (who the quorums count), sequence number (0 = none),
--         report id ("" = none), its scope, its fingerprint.
--         A summary entry (isolation "s", service/store/aggregate.py): broker, latest
--         latency ("" = keep), age ms of the first report, of the latest, "s", histogram
--         counts ("c0,c1,..." per bucket of detour.model.LATENCY_BUCKETS), 0, 0, "",
--         producer, sequence number, "", "", "": sets the latency of an item that exists and
--         logs {b h=counts s=first ms p w=writer t=latest ms}; no window, no push.
--         A report whose sequence number was applied already, or whose id its scope
--         applied within idWindowMs, changes nothing, is not logged, and is answered with
--         the first answer. One whose id its scope does not hold and may have forgotten
--         (dated at or before its horizon: service/store/ids.py, the same rule) changes
--         nothing either, and is answered "expired" with the item as it is.
-- returns {status, now, {availableAt}, {version}, {change}, extra, {quorum}, {duration},
--   {value}, {probe}, {duplicate}}, one entry per report: version > 0 when the change was
--   pushed ({k="fault", v, f=broker, x=value, s=stamp}); change 0 none, 1 opened, 2 moved,
--   3 cleared; quorum 0 n/a, 1 suspected, 2 reached; duration: the window asked for after
--   quorum, backoff and jitter; value: the item as stored ("" when none); probe 0, 1 passed,
--   2 failed; duplicate 1: applied before (the first answer's fields), 2: expired.
--   status 1 applied (extra: items evicted); -1 stale config (extra: the table's config
--   stamp); -2 table full (extra: items evicted); -3 the table is not the one the caller
--   holds (extra: its epoch); -4 a report id reused with other content (extra: the report's
--   1-based index): nothing written.
local FIRST, STRIDE = 12, 14
local now = clock_ms()
local base = ARGV[11] ~= '' and tonumber(ARGV[11]) or now
-- When something happened ``age`` ms before the caller's base: never in the table's future.
local function dated(age)
  return math.min(base - tonumber(age), now)
end
local marked = {KEYS[1], KEYS[11], KEYS[12]}
local epoch = table_epoch(KEYS[2], marked)
local writer = ARGV[8]
local g = {}
for x in string.gmatch(ARGV[9], '[^,]+') do
  g[#g + 1] = tonumber(x)
end
local acked, seq_window, id_window, id_cap, writer_keep, writer_cap, id_margin =
  g[1], g[2], g[3], g[4], g[5], g[6], g[7]
local hwm = tonumber(redis.call('HGET', KEYS[6], writer) or '0')
local held = ARGV[7]
if string.sub(held, 1, 1) == '+' then
  -- The caller holds no table yet: a table without an epoch takes its candidate.
  held = string.sub(held, 2)
  if epoch == '' then
    epoch = held
    mark_table(KEYS[2], epoch, marked)
  end
end
local config_stamp = tonumber(redis.call('HGET', KEYS[2], 'config_stamp') or '0')
local asked_stamp = tonumber(ARGV[1])
if epoch ~= held or hwm < acked or config_stamp < asked_stamp then
  return {-3, now, {}, {}, {}, epoch}
end
if config_stamp ~= asked_stamp then
  return {-1, now, {}, {}, {}, fmt(config_stamp)}
end

local rule = ARGV[2]
local log_cap = tonumber(ARGV[4])
local p = {}
for x in string.gmatch(ARGV[6], '[^,]+') do
  p[#p + 1] = tonumber(x)
end
local quorum, quorum_window, keep_ms, repeat_on = p[1], p[2], p[3], p[4] == 1
local max_isolation, decay, jitter_pct, jitter_scale = p[5], p[6], p[7], p[8]
local max_suspects, max_isolations, event_cap, probe_expiry = p[9], p[10], p[11], p[12] == 1
local latency_quorum, early, ramp, pending_quorum = p[13], p[14] == 1, p[15] > 0, p[16]
-- policy.probation_on: earlyRecovery obeys the probation flag too (a window ended early)
local probe_on = probe_expiry or early

local function id_key(i)
  return ARGV[i + 12] .. '#' .. ARGV[i + 11]
end

-- A report id seen before in its scope, within the window: its stored answer fields.
local function known_id(i)
  if ARGV[i + 11] == '' then
    return nil
  end
  local v = redis.call('HGET', KEYS[8], id_key(i))
  if not v then
    return nil
  end
  local f = {}
  for x in string.gmatch(v, '[^|]+') do
    f[#f + 1] = x
  end
  if tonumber(f[1]) <= now - id_window then
    return nil
  end
  return f
end

-- A report of ``scope`` dated at or before this may carry an id the scope forgot: older
-- than the window, or no later than the newest id its cap pushed out, with a margin of at
-- most half the time since (ids.py ``horizon``, the same rule).
local function id_horizon(scope)
  local by_time = now - id_window + id_margin
  local pushed = redis.call('HGET', KEYS[10], scope)
  if not pushed then
    return by_time
  end
  pushed = tonumber(pushed)
  return math.max(by_time, pushed + math.min(id_margin, math.floor((now - pushed) / 2)))
end

-- The writer's sequence numbers below its high-water mark that were not applied (a call
-- that failed, or one still in flight): inclusive ranges, oldest first, at most seq_window.
local gaps = {}
for lo, hi in string.gmatch(redis.call('HGET', KEYS[6], writer .. '|gaps') or '', '(%d+)-(%d+)') do
  gaps[#gaps + 1] = {tonumber(lo), tonumber(hi)}
end
local top = hwm
local function seq_applied(seq)
  if seq <= 0 or seq > top then
    return false
  end
  for _, gap in ipairs(gaps) do
    if gap[1] <= seq and seq <= gap[2] then
      return false
    end
  end
  return true
end
local function mark(seq)
  if seq <= 0 then
    return
  end
  if seq > top then
    if seq > top + 1 then
      gaps[#gaps + 1] = {top + 1, seq - 1}
    end
    top = seq
    return
  end
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
      return
    end
  end
end

-- Before anything is written: which reports were applied before (a sequence number the
-- table applied, an id its scope applied within the window, or an id earlier in this call),
-- and bad input, which changes nothing: an id reused with other content refuses the call.
local dup = {}
do
  local in_call = {}
  for i = FIRST, #ARGV, STRIDE do
    if ARGV[i + 4] == 's' then
      dup[i] = seq_applied(tonumber(ARGV[i + 10]))
    else
      local seq = tonumber(ARGV[i + 10])
      local f = known_id(i)
      dup[i] = seq_applied(seq) or f ~= nil
      if ARGV[i + 11] ~= '' then
        local key, fp = id_key(i), ARGV[i + 13]
        local first = (f and f[2]) or in_call[key]
        if first ~= nil and first ~= fp then
          return {-4, now, {}, {}, {}, (i - FIRST) / STRIDE + 1}
        end
        if not dup[i] and dated(ARGV[i + 3]) <= id_horizon(ARGV[i + 12]) then
          dup[i] = 2  -- expired: perhaps applied, and forgotten
        else
          dup[i] = dup[i] or in_call[key] ~= nil
          in_call[key] = in_call[key] or fp
        end
      end
    end
  end
end

local stamps = stamper(KEYS[2], now, ARGV[10])

local evicted = 0
if rule ~= 'off' then
  local cap = tonumber(ARGV[5])
  local function count_new()
    local new, seen = 0, {}
    for i = FIRST, #ARGV, STRIDE do
      local broker = ARGV[i]
      -- (a summary entry creates no item, nor does a report applied before)
      if not seen[broker] and ARGV[i + 4] ~= 's' and not dup[i] then
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
    local size = redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], MARK)
    if size + new > cap then
      if redis.call('ZCARD', KEYS[5]) < size then
        -- A table written before the index existed: index it once.
        local all = redis.call('HGETALL', KEYS[1])
        for j = 1, #all, 2 do
          if all[j] ~= MARK then
            redis.call('ZADD', KEYS[5], item_end(all[j + 1]), all[j])
          end
        end
      end
      -- detour.apply.make_room: the items whose window ended longest ago, as many as
      -- needed and EVICT_SLACK (16) more.
      local ended = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0,
        size + new - cap + 16)
      for _, broker in ipairs(ended) do
        redis.call('HDEL', KEYS[1], broker)
        redis.call('ZREM', KEYS[5], broker)
        -- (no stamp: an eviction leaves no grave; the item had ended, a merge may bring it
        -- back within the cap, harmlessly)
        push(KEYS[2], ARGV[3], 'fault', broker, '', 0)
        evicted = evicted + 1
      end
      size = size - evicted
      if evicted > 0 then
        -- a broker of these reports may have been one of the dropped
        new = count_new()
      end
      if size + new > cap then
        stamps.done()
        return {-2, now, {}, {}, {}, evicted}
      end
    end
  end
end

-- policy.pending.bounded_signals: the producer's entry replaced, others kept while recent,
-- the newest kept.
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

-- policy.pending.live_signals: producers with an open signal within the quorum window.
local function live_voters(signals)
  local n = 0
  for _, s in ipairs(signals) do
    if s[3] > 0 and s[3] > now - quorum_window and s[1] ~= '~' then
      n = n + 1
    end
  end
  return n
end

local function by_time(a, b)
  return a[2] < b[2] or (a[2] == b[2] and a[1] < b[1])
end

-- strategy.window_change
local function window_change(old_end, new_end)
  local was_open = old_end ~= nil and old_end > now
  local is_open = new_end > now
  if is_open and not was_open then
    return 1
  elseif is_open and new_end ~= old_end then
    return 2
  elseif was_open and not is_open then
    return 3
  end
  return 0
end

-- detour.apply.why_after: the report that opened or moved the window end is why it is open;
-- a window still open keeps its reason; one that is over has none.
local function why_after(old_why, kind, reason, at, latency, voter, new_end, isolation)
  if kind == 'opened' or kind == 'extended' or kind == 'quorum' then
    if reason == 'quorum' and not isolation then
      reason = 'latency'
    end
    return {reason, at, latency, voter}
  elseif new_end > now then
    return old_why
  end
  return nil
end

-- detour.apply.apply_one for a report that is not a signal; returns the item after, and
-- {duration, change, quorum, reporters, probe, kind, reason, visible}.
local function apply_report(i, old)
  local at = dated(ARGV[i + 3])
  local isolation, voter = ARGV[i + 4] == '1', ARGV[i + 9]
  local duration = tonumber(ARGV[i + 2])
  local it = {stamp = 0, lat = ARGV[i + 1], e = 0, iso = 0, prob = false, reach = '',
    suspects = {}, slow = {}, signals = {}, why = nil}
  local old_end = nil
  if old then
    it.iso, it.prob, it.reach = old.iso, old.prob, old.reach
    it.suspects, it.slow, it.signals, it.why = old.suspects, old.slow, old.signals, old.why
    old_end = old.e
  end
  local quorum_state, reporters, own_ended = 0, 1, false
  local voted = ARGV[i + 6] == '1' or ARGV[i + 6] == '2'
  if ARGV[i + 6] == '1' then
    -- policy.votes.quorum_vote: one entry per producer (its latest failure), newest kept
    local kept, mine = {}, at
    for _, s in ipairs(it.suspects) do
      if s[1] == voter then
        mine = math.max(mine, s[2])
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
      it.suspects, quorum_state, reporters = {}, 2, voters
    else
      it.suspects, quorum_state = kept, 1
    end
  elseif ARGV[i + 6] == '2' then
    -- policy.votes.latency_vote: one entry per producer (latest answer, latest window end)
    local since, kept, mine, mine_end = now - quorum_window, {}, at, at + duration
    for _, s in ipairs(it.slow) do
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
      it.slow, quorum_state, reporters = {}, 2, voters
    else
      it.slow, quorum_state = kept, 1
    end
  elseif rule == 'overwrite' and #it.slow > 0 then
    -- lastReportWins overwrites the reporter's own window too
    local kept = {}
    for _, s in ipairs(it.slow) do
      if s[1] ~= voter then
        kept[#kept + 1] = s
      end
    end
    own_ended = #kept < #it.slow
    it.slow = kept
  end
  if voted and quorum_state == 1 then
    duration = 0
  end
  if isolation and duration > 0 then
    -- policy.backoff
    if repeat_on then
      if old_end == nil or old_end <= at then
        local prev = it.iso
        if old_end ~= nil and prev > 0 then
          prev = math.max(0, prev - math.floor((at - old_end) / decay))
        end
        it.iso = math.min(prev + 1, max_isolations)
      else
        it.iso = math.max(it.iso, 1)
      end
      duration = math.max(duration, math.min(duration * it.iso, max_isolation))
    else
      it.iso = 0
    end
    if jitter_pct > 0 then
      duration = duration
        + math.floor(duration * jitter_pct * tonumber(ARGV[i + 7]) / (100 * jitter_scale))
    end
  end
  it.e = at + duration
  if rule == 'extend' and old_end ~= nil and old_end > it.e then
    it.e = old_end
  end
  -- probation
  local old_probation = old ~= nil and old.prob and probe_on
  local probing = old_probation and at >= old_end
  local probe = 0
  it.prob = old_probation
  if not probe_on then
    it.prob = false
  elseif duration > 0 then
    -- earlyRecovery alone: a failed probe re-isolates, the window's end returns the broker
    it.prob = probe_expiry
    if probing then
      probe = 2
    end
  elseif probing and not isolation then
    it.prob, probe = false, 1
  end
  if ramp and duration == 0 and probe == 0 then
    -- policy.recovery.ramp_end: a report that opens no window keeps the last window's end
    if old_end == nil then
      it.e = 0
    elseif old_end <= at then
      it.e = old_end
    end
  end
  -- policy.pending.settle_pending: a completed send withdraws its producer's signal...
  for _, s in ipairs(it.signals) do
    if s[1] == voter then
      local done = at
      if s[3] == 0 then
        done = math.max(at, s[2])
      end
      own_ended = own_ended or s[3] > 0
      it.signals = bounded_signals(it.signals, voter, {voter, done, 0})
      break
    end
  end
  -- ... and a window the signals hold is released, or ended when the sends completed
  local hold = nil
  for _, s in ipairs(it.signals) do
    if s[1] == '~' then
      hold = s[2]
    end
  end
  if hold ~= nil then
    local released = {}
    for _, s in ipairs(it.signals) do
      if s[1] ~= '~' then
        released[#released + 1] = s
      end
    end
    if it.e ~= hold then
      it.signals = released
    elseif not isolation and live_voters(it.signals) < pending_quorum then
      it.signals = released
      it.e = math.min(it.e, at)
    end
  end
  local change = window_change(old_end, it.e)
  -- policy.events.window_event
  local kind, reason = nil, nil
  if probe == 1 then
    kind, reason = 'ended', 'probe'
  elseif probe == 2 and change == 1 then
    kind, reason = 'opened', 'probe'
  elseif change == 3 then
    kind, reason = 'ended', 'success'
  elseif change == 1 and quorum_state == 2 then
    kind, reason = 'quorum', 'quorum'
  elseif change > 0 then
    kind = change == 1 and 'opened' or 'extended'
    reason = isolation and 'isolation' or 'latency'
  end
  it.why = why_after(it.why, kind, reason, at, ARGV[i + 1], voter, it.e, isolation)
  local had_probation = old ~= nil and old.prob
  local visible = change > 0 or quorum_state > 0 or own_ended or it.prob ~= had_probation
  return it, {duration, change, quorum_state, reporters, probe, kind, reason, visible}
end

-- detour.apply._signal: an in-flight signal; nil when it records nothing.
local function apply_signal(i, old)
  local duration = tonumber(ARGV[i + 2])
  if rule == 'off' or pending_quorum == 0 or duration == 0 then
    return nil
  end
  local at = dated(ARGV[i + 3])
  local voter = ARGV[i + 9]
  local it = old or {stamp = 0, lat = '0', e = 0, iso = 0, prob = false, reach = '',
    suspects = {}, slow = {}, signals = {}, why = nil}
  -- policy.pending.pending_vote
  local since, sig_at, mine = at - tonumber(ARGV[i + 1]), at, nil
  for _, s in ipairs(it.signals) do
    if s[1] == voter then
      mine = s
    end
  end
  if mine ~= nil then
    if mine[3] == 0 then
      if since <= mine[2] then
        return nil
      end
    else
      since, sig_at = math.min(since, mine[2]), math.max(sig_at, mine[3])
    end
  end
  it.signals = bounded_signals(it.signals, voter, {voter, since, sig_at})
  local voters = live_voters(it.signals)
  if voters < pending_quorum then
    it.why = why_after(it.why, nil, nil, at, ARGV[i + 1], voter, it.e, false)
    return it, {0, 0, 1, 1, 0, nil, nil, true}
  end
  local old_end = old and old.e or nil
  if at + duration > it.e then
    -- held by the signals (policy.pending.settle_pending may end it early)
    it.e = at + duration
    it.signals = bounded_signals(it.signals, '~', {'~', it.e, 0})
  end
  local change = window_change(old_end, it.e)
  local kind = nil
  if change > 0 then
    kind = change == 1 and 'opened' or 'extended'
  end
  it.why = why_after(it.why, kind, 'pending', at, ARGV[i + 1], voter, it.e, false)
  return it, {duration, change, 2, voters, 0, kind, kind and 'pending', true}
end

-- The one block that writes an item: a fresh stamp, the hash, the eviction index, the
-- push when another replica must see it. Returns the value and the push's version (0).
local function write_item(broker, it, visible)
  it.stamp = stamps.next()
  local value = encode_item(it)
  redis.call('HSET', KEYS[1], broker, value)
  redis.call('ZADD', KEYS[5], it.e, broker)
  local version = 0
  if visible then
    version = push(KEYS[2], ARGV[3], 'fault', broker, value, it.stamp)
  end
  return value, version
end

local ends, versions, changes, quorums, durations, values, probes, dups, summaries =
  {}, {}, {}, {}, {}, {}, {}, {}, {}
local function answer(e, version, change, quorum_state, duration, value, probe, dup)
  ends[#ends + 1] = e
  versions[#versions + 1] = version
  changes[#changes + 1] = change
  quorums[#quorums + 1] = quorum_state
  durations[#durations + 1] = duration
  values[#values + 1] = value
  probes[#probes + 1] = probe
  dups[#dups + 1] = dup
end

local any_id = false
for i = FIRST, #ARGV, STRIDE do
  local broker, seq = ARGV[i], tonumber(ARGV[i + 10])
  if dup[i] == 2 then
    mark(seq)
    local cur = redis.call('HGET', KEYS[1], broker)
    answer(cur and item_end(cur) or now, 0, 0, 0, 0, cur or '', 0, 2)
  elseif dup[i] then
    local first = known_id(i)
    -- applied before: nothing changes; the first answer (or, for a sequence number whose
    -- answer was not kept, the item as it is)
    mark(seq)
    local cur = redis.call('HGET', KEYS[1], broker)
    if first ~= nil then
      answer(tonumber(first[3]), 0, tonumber(first[5]), tonumber(first[6]), tonumber(first[4]),
        cur or '', tonumber(first[7]), 1)
    else
      answer(cur and item_end(cur) or now, 0, 0, 0, 0, cur or '', 0, 1)
    end
  elseif ARGV[i + 4] == 's' then
    -- A summary of the reports this replica kept local (policy.quiet, docs/semantics.md):
    -- one histogram entry in the latency log now; the broker's latest latency after the
    -- loop, in one HMGET and one HSET for all summaries, on items that exist.
    mark(seq)
    if log_cap > 0 then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', log_cap, '*', 'b', broker, 'h', ARGV[i + 5],
        's', fmt(dated(ARGV[i + 2])), 'p', ARGV[i + 9], 'w', writer,
        't', fmt(dated(ARGV[i + 3])))
    end
    summaries[#summaries + 1] = {broker, ARGV[i + 1], #ends + 1}
    answer(now, 0, 0, 0, 0, '', 0, 0)
  else
    mark(seq)
    local at = dated(ARGV[i + 3])
    local cur = redis.call('HGET', KEYS[1], broker)
    local old = cur and parse_item(cur) or nil
    local it, eff = nil, nil
    if ARGV[i + 6] == '3' then
      it, eff = apply_signal(i, old)
    elseif rule ~= 'off' then
      it, eff = apply_report(i, old)
    end
    local value, version = cur or '', 0
    local e = old and old.e or now
    local result = {0, 0, 0, 1, 0}
    if it ~= nil then
      value, version = write_item(broker, it, eff[8])
      e, result = it.e, eff
      if eff[6] ~= nil and event_cap > 0 then
        redis.call('XADD', KEYS[4], 'MAXLEN', '~', event_cap, '*', 'k', eff[6], 'r', eff[7],
          'b', broker, 't', ARGV[i + 8], 'n', eff[4], 'e', fmt(it.e), 'a', fmt(at))
      end
    end
    if log_cap > 0 and ARGV[i + 6] ~= '3' then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', log_cap, '*', 'b', broker, 'l', ARGV[i + 1],
        'i', ARGV[i + 4], 'p', ARGV[i + 5], 't', fmt(at))
    end
    answer(e, version, result[2], result[3], result[1], value, result[5], 0)
    if ARGV[i + 11] ~= '' then
      -- remember the id with the first answer: a repeat is answered as this one was
      any_id = true
      local key = id_key(i)
      local old_id = redis.call('HGET', KEYS[8], key)
      if old_id then
        redis.call('ZREM', KEYS[9], ARGV[i + 12] .. '#' .. string.format('%013d',
          tonumber(string.match(old_id, '^(%d+)'))) .. '#' .. ARGV[i + 11])
      end
      redis.call('HSET', KEYS[8], key, table.concat({fmt(now), ARGV[i + 13], fmt(e),
        fmt(result[1]), result[2], result[3], result[5]}, '|'))
      redis.call('ZADD', KEYS[9], 0, ARGV[i + 12] .. '#' .. string.format('%013d', now) .. '#'
        .. ARGV[i + 11])
    end
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
        -- the latest latency, with a fresh stamp (a write like any other)
        local it = parse_item(v)
        it.lat, it.stamp = sm[2], stamps.next()
        v = encode_item(it)
        set[#set + 1] = sm[1]
        set[#set + 1] = v
      end
      ends[sm[3]] = item_end(v)
      values[sm[3]] = v
    end
  end
  if #set > 0 then
    redis.call('HSET', KEYS[1], unpack(set))
  end
end
stamps.done()
if top > 0 then
  while #gaps > seq_window do
    table.remove(gaps, 1)
  end
  local parts = {}
  for _, gap in ipairs(gaps) do
    parts[#parts + 1] = fmt(gap[1]) .. '-' .. fmt(gap[2])
  end
  if #parts > 0 then
    redis.call('HSET', KEYS[6], writer .. '|gaps', table.concat(parts, ','))
  else
    redis.call('HDEL', KEYS[6], writer .. '|gaps')
  end
  redis.call('HSET', KEYS[6], writer, fmt(top))
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
if any_id then
  -- each scope keeps its ids for id_window and at most id_cap of them: only its own
  -- traffic can push them out (service/store/ids.py keeps the same rule)
  local scopes = {}
  for i = FIRST, #ARGV, STRIDE do
    if ARGV[i + 11] ~= '' then
      scopes[ARGV[i + 12]] = true
    end
  end
  for scope, _ in pairs(scopes) do
    local lo, hi = '[' .. scope .. '#', '(' .. scope .. '$'
    local old = redis.call('ZRANGEBYLEX', KEYS[9], lo,
      '(' .. scope .. '#' .. string.format('%013d', now - id_window), 'LIMIT', 0, 64)
    local excess = redis.call('ZLEXCOUNT', KEYS[9], lo, hi) - #old - id_cap
    if excess > 0 then
      old = redis.call('ZRANGEBYLEX', KEYS[9], lo, hi, 'LIMIT', 0, #old + math.min(excess, 64))
    end
    local newest = 0
    for _, member in ipairs(old) do
      local first, id = string.match(member, '^.-#(%d+)#(.*)$')
      redis.call('ZREM', KEYS[9], member)
      redis.call('HDEL', KEYS[8], scope .. '#' .. id)
      newest = math.max(newest, tonumber(first))
    end
    if newest > now - id_window
        and newest > tonumber(redis.call('HGET', KEYS[10], scope) or '0') then
      redis.call('HSET', KEYS[10], scope, newest)  -- pushed out by the cap (id_horizon)
    end
  end
end
return {1, now, ends, versions, changes, evicted, quorums, durations, values, probes, dups}
