-- Prepended to park.lua and sem_park.lua: "last call wins" (on_contention="replace",
-- lock_debounce; docs/concepts.md, "Last call wins"). One hash per key, `latest`:
--   p, pt, ps, pf, pd, pm, pq  the pending call: its owner, task id, sent time (µs on its
--                              publisher's clock), the sent time of the oldest call it took
--                              the place of (lock_debounce_max counts from it), when it is
--                              due (ms on the server's clock; 0: its quiet period is over and
--                              it waits for the lock in the parked line), its message (while
--                              it waits to be due), when a drainer last sent it (ms)
--   s, st                      the newest call that started: its sent time and task id
--                              (a stored sent time a day or more ahead of the server's
--                              clock is junk: read as missing)
--   x:<task id>                a superseded call not yet recorded as such in the result
--                              backend -> "<ms> <the task id of the call that superseded
--                              it>" ("" for a run that started); the worker that records it
--                              deletes the field, so a lost reply or a dead worker leaves it
--                              for a later call of the key to record
-- Calls are ordered by (sent time, task id): "newer" is sent later.
-- latest_gate(latest, owner, task_id, sent, quiet_ms, max_ms, message, holds, evict)
--   -> reply, evicted, first, sent
--   reply: {4, task id or false} superseded (by the pending call or by a run that started);
--          {5, ms} pending until due (quiet period); nil: go on and take (or park).
--   evicted: the task id of the older pending call this call took the place of (its parked
--   records removed: evict(owner)), else false. first: the chain's oldest sent time.
--   sent: this call's sent time as it counts (another delivery of the pending call keeps
--   the one it was first pending with).
--   holds(owner): whether owner holds the lock (a permit), handed over or running; a call
--   that holds it (handed over to it) is never superseded nor made to wait: it takes it up.
-- latest_enter(latest, registry, owner, task_id, sent, quiet_ms, max_ms, message, keep_ms,
--              holds, evict) -> reply, evicted, first, sent
--   The parking scripts' step: the arguments checked (sent, quiet_ms, max_ms: as given in
--   ARGV, before any write), latest_gate, and for a call pending until due its key entered
--   in the debounce registry at its due time. reply: the gate's as a parking script's
--   reply ({code, value, nil, evicted}), or nil: go on and take (or park).
-- latest_reply(latest, reply, task_id, evicted) -> reply's first three elements, evicted,
--   and the superseded calls this call's worker records (a flat list id, by, id, by...):
--   this call's own x: field and those of the calls it superseded, and any other left
--   unrecorded for
--   LATEST_UNRECORDED_MS (claimed for that long again); at most 32.
-- latest_after(latest, owner, task_id, sent, first, taken, keep_ms)
--   taken: the newest started call is this one (if newer), and it is no longer pending;
--   else (parked): this call is the pending one, waiting for the lock.
local LATEST_UNRECORDED_MS = 10000
-- A stored sent time more than this ahead of the server's clock (µs) is junk: each worker
-- caps a call's sent time at its own clock, so only clocks' offsets put one ahead.
local LATEST_AHEAD_US = 86400000000
local function latest_time(value, latest_us)
  local t = tonumber(value)
  if t and t <= latest_us then
    return t
  end
  return nil
end
local function latest_older(s1, t1, s2, t2)
  if s1 ~= s2 then
    return s1 < s2
  end
  return t1 < t2
end
-- A superseded call's record until its worker stores its state: "<ms> <newer task id>".
-- At most LATEST_MAX_FIELDS fields: past that (a result backend down for long, or junk
-- written under the prefix), a superseded call is stored by its worker's reply alone.
local LATEST_MAX_FIELDS = 256
local function latest_record(latest, task_id, by)
  if redis.call('hlen', latest) < LATEST_MAX_FIELDS then
    redis.call('hset', latest, 'x:' .. task_id, now_ms() .. ' ' .. (by or ''))
  end
end
local function latest_clear(latest)
  redis.call('hdel', latest, 'p', 'pt', 'ps', 'pf', 'pd', 'pm', 'pq')
end
local function latest_gate(latest, owner, task_id, sent, quiet_ms, max_ms, message, holds, evict)
  local kind = redis.call('type', latest).ok
  if kind ~= 'hash' and kind ~= 'none' then
    redis.call('del', latest)  -- junk where the hash belongs: whoever may write the prefix
  end
  if holds(owner) then
    -- A release handed this call the lock (a permit): it started (a newer call that came
    -- since is the pending one, behind it). Superseding it would leave its hand-over
    -- untaken, handed to it again by every sweep.
    return nil, false, sent, sent
  end
  local f = redis.call('hmget', latest, 'p', 'pt', 'ps', 'pf', 's', 'st')
  local ahead = now_ms() * 1000 + LATEST_AHEAD_US
  local p, pt, ps, pf = f[1], f[2], latest_time(f[3], ahead), latest_time(f[4], ahead)
  local s, st = latest_time(f[5], ahead), f[6]
  if s and not st then
    s = nil
  end
  if s and latest_older(sent, task_id, s, st) then
    latest_record(latest, task_id, st)
    return {4, st}, false, sent, sent
  end
  local first, evicted = sent, false
  if p and p ~= owner then
    if not ps or not pt then
      latest_clear(latest)  -- junk
    elseif holds(p) then  -- handed over (or running): it started
      if not s or latest_older(s, st, ps, pt) then
        redis.call('hset', latest, 's', f[3], 'st', pt)
        if latest_older(sent, task_id, ps, pt) then
          latest_clear(latest)
          latest_record(latest, task_id, pt)
          return {4, pt}, false, sent, sent
        end
      end
      latest_clear(latest)
    elseif latest_older(sent, task_id, ps, pt) then
      latest_record(latest, task_id, pt)
      return {4, pt}, false, sent, sent
    else
      evict(p)
      evicted = pt
      latest_record(latest, pt, task_id)
      first = math.min(pf or ps, ps, sent)
      latest_clear(latest)
    end
  elseif p == owner then
    -- Another delivery of the pending call (a drainer's send, a copy): it keeps the sent
    -- time it was first pending with. A header ahead of the worker's clock is capped at
    -- each delivery's time: taken anew, it would restart the quiet period at every send.
    if ps then
      sent = math.min(sent, ps)
    end
    first = math.min(pf or sent, sent)
  end
  if quiet_ms > 0 then
    local due = math.min(math.floor(sent / 1000) + quiet_ms, math.floor(first / 1000) + max_ms)
    local now = now_ms()
    if now < due then
      redis.call('hset', latest, 'p', owner, 'pt', task_id, 'ps', string.format('%.0f', sent),
        'pf', string.format('%.0f', first), 'pd', string.format('%.0f', due), 'pm', message)
      redis.call('hdel', latest, 'pq')
      return {5, due - now}, evicted, first, sent
    end
  end
  return nil, evicted, first, sent
end
local function latest_reply(latest, reply, task_id, evicted)
  local unreported, now = {}, now_ms()
  local fields = redis.call('hgetall', latest)  -- (a few fields: HGETALL, in every ACL given)
  for i = 1, #fields, 2 do
    local field, value = fields[i], fields[i + 1]
    local id = string.sub(field, 3)
    if string.sub(field, 1, 2) == 'x:' and #unreported < 64 then
      local at, by = string.match(value, '^(%d+) (.*)$')
      if id == task_id or id == evicted or by == task_id then
        unreported[#unreported + 1] = id
        unreported[#unreported + 1] = by or ''
      elseif not at or math.abs(now - tonumber(at)) > LATEST_UNRECORDED_MS then
        -- Left by a worker that did not store it (it died, or its reply was lost): this
        -- call's worker does, and has it for the next LATEST_UNRECORDED_MS alone. A time
        -- ahead of the server's clock (stepped back since, or junk) counts as left too:
        -- else it would be claimed for as long as the clock takes to catch up.
        redis.call('hset', latest, field, now .. ' ' .. (by or ''))
        unreported[#unreported + 1] = id
        unreported[#unreported + 1] = by or ''
      end
    end
  end
  return {reply[1], reply[2], reply[3] or false, evicted, unreported}
end
local function latest_enter(latest, registry, owner, task_id, sent, quiet_ms, max_ms, message,
    keep_ms, holds, evict)
  sent = whole_arg(sent, 'sent time', 0, 9007199254740991)
  quiet_ms = ms_arg(quiet_ms, 'debounce', 0)
  max_ms = ms_arg(max_ms, 'debounce max', 0)
  local gate, evicted, first
  gate, evicted, first, sent = latest_gate(latest, owner, task_id, sent, quiet_ms, max_ms, message,
    holds, evict)
  if not gate then
    return nil, evicted, first, sent
  end
  if gate[1] == 5 then
    redis.call('zadd', registry, redis.call('hget', latest, 'pd'), latest)
  end
  -- Superseded, the call's record (x:) is kept as long as any other call's would be.
  if redis.call('pttl', latest) < keep_ms then
    redis.call('pexpire', latest, keep_ms)
  end
  return latest_reply(latest, gate, task_id, evicted), evicted, first, sent
end
local function latest_after(latest, owner, task_id, sent, first, taken, keep_ms)
  if taken then
    local f = redis.call('hmget', latest, 's', 'st', 'p')
    local s, st = latest_time(f[1], now_ms() * 1000 + LATEST_AHEAD_US), f[2]
    if not s or not st or latest_older(s, st, sent, task_id) then
      redis.call('hset', latest, 's', string.format('%.0f', sent), 'st', task_id)
    end
    if f[3] == owner then
      latest_clear(latest)
    end
  else
    redis.call('hset', latest, 'p', owner, 'pt', task_id, 'ps', string.format('%.0f', sent),
      'pf', string.format('%.0f', first), 'pd', '0')
    redis.call('hdel', latest, 'pm', 'pq')
  end
  if redis.call('pttl', latest) < keep_ms then
    redis.call('pexpire', latest, keep_ms)
  end
end
