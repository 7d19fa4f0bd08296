-- sem_sweep(keys=[holders, channel, fence, parked, messages, limits, dispatched, registry],
--           args=[lease_ms, stale_ms, reach?, permit_prefix, own?]) -> {0} | {-1} | {1, message, task id, tag}
-- sweep.lua for a semaphore with parked tasks (docs/concepts.md, "The sweeper"): while fewer
-- permits are held than the limit the parked tasks left (limit_key; 1 if gone or not a limit),
-- hand one to the first parked task (one per call: the sweeper calls again); then send again
-- a handed-over task not started stale_ms after its hand-over (sweep.lua's resend_stale).
-- Keys as sweep.lua's (holders in the lock's place; limit_key in the unused slot). Replies as
-- sweep.lua's.
local lease = ms_arg(ARGV[1], 'lease')
local stale_ms = ms_arg(ARGV[2], 'hand-over staleness')
local reach = whole_arg(ARGV[3] or '1000', 'queue reach', 1, 2147483647)
local prefix = ARGV[4]
local own = ARGV[5] ~= '' and ARGV[5] or nil  -- the locks' database (parked.lua's resend_stale)
local now = now_ms()
local held = live_permits(KEYS[1], prefix)
local fits, parked_limit = parked_fits(KEYS[4], KEYS[5], KEYS[6], held, prefix)
if fits then
  local next_id, message = pop_parked(KEYS[4], KEYS[5])
  local function permit_of(task_id, token, task_lease)
    give_permit(KEYS[1], prefix, task_id, 0, token, task_lease, parked_limit)
    redis.call('hdel', KEYS[6], task_id)
  end
  return {1, message, next_id, hand_to(permit_of, KEYS[3], KEYS[7], next_id, lease)}
end
local function hold_of(task_id)
  return prefix .. task_id
end
local message, task_id, tag = resend_stale(hold_of, KEYS[5], KEYS[7], lease, stale_ms, reach, now,
  KEYS[4], stale_ms, own)
if message then
  return {1, message, task_id, tag}
end
if redis.call('llen', KEYS[4]) == 0 and redis.call('hlen', KEYS[7]) == 0 then
  redis.call('zrem', KEYS[8], KEYS[1])
  return {-1}
end
return {0}
