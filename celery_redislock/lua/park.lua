-- park(keys=[lock, fence, done, parked, messages, dispatched, waiters, claims, wake, registry?],
--      args=[owner, lease_ms, message, keep_ms, behind?])
--   -> {1, token, count} | {3, ms} | {0, ms} | {-1, 0} | {2, 0}
-- A task's acquire in "requeue" mode: take the lock, or park the task behind its holder
-- (docs/concepts.md, "Parking and hand-over"). lock, fence, waiters, claims, wake: as
-- acquire.lua's (a free lock is the first waiter's in line, as for acquire); done: this task
-- id's done marker; parked: list of parked task ids, oldest first; messages: hash task id ->
-- message (a signature, or a broker envelope: envelope.lua); dispatched: as handoff.lua's;
-- registry: the sweeper's sorted set of lock keys, entered when the task parks (single Redis).
-- Last call wins (latest.lua): with keys latest, debounce registry and args task_id, sent_us,
-- quiet_ms, max_ms (behind ""), the call first passes latest_gate: {4, task id} superseded,
-- {5, ms} pending until due (its message kept in latest; the key entered in the debounce
-- registry at its due time); else it takes or parks as below, as the key's one pending call.
-- Each reply then carries, 4th, the task id of the pending call it took the place of.
-- owner: the task id; lease_ms: its lease; message: published again when the lock is handed
-- to it; keep_ms: lifetime of the parked structures; behind "behind": only park behind
-- another owner's hold, never take the lock (the worker's main process).
-- Replies: {1, token, count} taken (or a hand-over to it taken up); {3, ms} this task id holds
-- it (another delivery of the run); {0, ms} parked (or parked already; ms: the holder's lease
-- left, or the wait for the first in line); {-1, 0} it finished; {2, 0} "behind": the lock
-- is free or this task id's (finished or not).
local lease = ms_arg(ARGV[2], 'lease')
local keep_for = ms_arg(ARGV[4], 'parking lifetime')
-- "behind" on a free lock (or this task id's) answers before the done marker is read:
-- either way the worker delivers the task, whose own acquire reads the marker.
if ARGV[5] == 'behind' and (redis.call('exists', KEYS[1]) == 0 or redis.call('hexists', KEYS[1], ARGV[1]) == 1) then
  return {2, 0}
end
if redis.call('exists', KEYS[3]) == 1 then
  return {-1, 0}
end
local held = redis.call('hget', KEYS[1], ARGV[1])
if held and held ~= '0' then
  return {3, redis.call('pttl', KEYS[1])}  -- another delivery of this run holds it
end
local latest, evicted, first, sent = KEYS[11], false, nil, nil
if latest then
  local gate
  gate, evicted, first, sent = latest_enter(latest, KEYS[12], ARGV[1], ARGV[6], ARGV[7], ARGV[8],
    ARGV[9], ARGV[3], keep_for,
    function(owner) return redis.call('hexists', KEYS[1], owner) == 1 end,
    function(owner)
      redis.call('lrem', KEYS[4], 0, owner)
      redis.call('hdel', KEYS[5], owner)
      redis.call('hdel', KEYS[6], owner)
    end)
  if gate then
    return gate
  end
end
local reply = take_or_enter(KEYS[1], KEYS[2], KEYS[7], KEYS[8], KEYS[9], ARGV[1], lease)
if reply and reply[1] == 1 then
  if latest then
    latest_after(latest, ARGV[1], ARGV[6], sent, first, true, keep_for)
    return latest_reply(latest, reply, ARGV[6], evicted)
  end
  return reply  -- taken, or handed to this task (count 0) and taken up
end
if latest then
  latest_after(latest, ARGV[1], ARGV[6], sent, first, false, keep_for)
end
enqueue(KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[3])
if KEYS[10] then
  redis.call('zadd', KEYS[10], math.floor(now_ms() / 1000), KEYS[1])
end
redis.call('pexpire', KEYS[4], keep_for)
redis.call('pexpire', KEYS[5], keep_for)
redis.call('pexpire', KEYS[6], keep_for)
local wait = reply and reply[2] or redis.call('pttl', KEYS[1])
if latest then
  return latest_reply(latest, {0, wait}, ARGV[6], evicted)
end
return {0, wait}
