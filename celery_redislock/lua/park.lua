-- park(keys=[lock, fence, done, parked, messages, dispatched, waiters, claims, wake, registry?],
--      args=[owner, lease_ms, message, keep_ms, behind?])
--   -> {1, token, count} | {3, ms} | {0, ms} | {-1, 0} | {2, 0}
-- A task's acquire in "requeue" mode: take the lock, or park the task behind its holder
-- (docs/concepts.md, "Parking and hand-over"). lock, fence, waiters, claims, wake: as
-- acquire.lua's (a free lock is the first waiter's in line, as for acquire); done: this task
-- id's done marker; parked: list of parked task ids, oldest first; messages: hash task id ->
-- message (a signature, or a broker envelope: envelope.lua); dispatched: as handoff.lua's;
-- registry: the sweeper's sorted set of lock keys, entered when the task parks (single Redis).
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
local reply = take_or_enter(KEYS[1], KEYS[2], KEYS[7], KEYS[8], KEYS[9], ARGV[1], lease)
if reply and reply[1] == 1 then
  return reply  -- taken, or handed to this task (count 0) and taken up
end
enqueue(KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[3])
if KEYS[10] then
  redis.call('zadd', KEYS[10], math.floor(now_ms() / 1000), KEYS[1])
end
redis.call('pexpire', KEYS[4], keep_for)
redis.call('pexpire', KEYS[5], keep_for)
redis.call('pexpire', KEYS[6], keep_for)
return {0, reply and reply[2] or redis.call('pttl', KEYS[1])}
