-- sweep(keys=[lock, channel, fence, parked, messages, unused, dispatched, registry?],
--       args=[lease_ms, stale_ms, reach?, grace_ms?, own?]) -> {0} | {-1} | {1, message, task id, tag}
-- The worker's safety net for parked tasks, run every few seconds per lock with parked tasks
-- (docs/concepts.md, "The sweeper"): hands a lock whose holder vanished (lease expired) to
-- the first parked task, and sends again a handed-over task not started stale_ms after its
-- hand-over, unless its envelope still waits in its queue list (its lease is renewed then).
-- Keys as handoff.lua's (unused: its done marker's slot); registry: the sweeper's sorted set,
-- this lock dropped from it when nothing is parked or dispatched any more (in the same step:
-- a task parking meanwhile is not dropped with it). lease_ms: the lease of a task the lock
-- is handed to; stale_ms: when a hand-over counts as lost; reach: how many messages from a
-- queue list's read end to look for a pushed envelope in (default 1000); grace_ms (default
-- stale_ms): how long after a run-on task's hold is first seen gone without its run's end it
-- goes back to the head of the parked line (parked.lua's resend_stale); own: the locks'
-- database (resend_stale's).
-- Replies: {0} nothing to do, tasks still parked; {-1} nothing parked or dispatched: forget
-- this lock; {1, message, task id, tag} check this message and send it now (a parked
-- envelope with delivery tag "<placeholder>h<tag>": tag "<token>" for a hand-over, as
-- handoff.lua's, or "<token>s<ms>" for a re-send at <ms>, the time in dispatched).
local lease = ms_arg(ARGV[1], 'lease')
local stale_ms = ms_arg(ARGV[2], 'hand-over staleness')
local reach = whole_arg(ARGV[3] or '1000', 'queue reach', 1, 2147483647)
local grace_ms = ms_arg((ARGV[4] ~= '' and ARGV[4]) or ARGV[2], 'run-on grace')
local own = ARGV[5] ~= '' and ARGV[5] or nil  -- the locks' database (parked.lua's resend_stale)
local now = now_ms()
if redis.call('exists', KEYS[1]) == 0 then
  local next_id, message = pop_parked(KEYS[4], KEYS[5])
  if next_id then
    return {1, message, next_id, hand_to(KEYS[1], KEYS[3], KEYS[7], next_id, lease)}
  end
end
local function hold_of()
  return KEYS[1]
end
local message, task_id, tag = resend_stale(hold_of, KEYS[5], KEYS[7], lease, stale_ms, reach, now,
  KEYS[4], grace_ms, own)
if message then
  return {1, message, task_id, tag}
end
if redis.call('llen', KEYS[4]) == 0 and redis.call('hlen', KEYS[7]) == 0 then
  if KEYS[8] then
    redis.call('zrem', KEYS[8], KEYS[1])
  end
  return {-1}
end
return {0}
