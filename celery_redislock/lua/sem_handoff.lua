-- sem_handoff(keys=[holders, channel, fence, parked, messages, done, dispatched, waiters, claims,
--                   wake, limits],
--             args=[owner, mode, lease_ms, done_ms, lists, tasks, token?, grant_ms?, limit?,
--                   permit_prefix, hold_ms?]) -> {code, message?, task id?, token?}
-- handoff.lua for a limited task's permit (docs/concepts.md, "Parking and hand-over"): once the
-- owner's permit is freed, it goes to the first parked task if fewer permits are then held
-- than that task's limit (sem.lua's parked_fits: a lowered limit takes effect as permits are
-- released; a parked task waits its turn, first come, first served), else to the first waiter
-- in line if fewer are held than `limit` (grant.lua, not direct), else to nobody ("1"
-- published when the line is empty). No look-ahead. Keys as handoff.lua's (holders in the
-- lock's place); limits: sem_park.lua's. owner, lease_ms (the next task's permit lease),
-- done_ms, lists, tasks, token, grant_ms: as handoff.lua's; mode: "one", "all", "unstarted"
-- as handoff.lua's, or "hold": keep the permit hold_ms more (unrenewed), handing nothing
-- over; limit: the releasing caller's ("": no waiter is granted the permit).
-- Replies as handoff.lua's: {n} holds left (n > 0), or -1 the permit is gone (its lease ran
-- out), -2 another holding's (token), -3 not handed to it ("unstarted"); {0} released;
-- {0, message, task id, token} handed over: check and send the message; {0, nil, task id}
-- handed over, its envelope pushed back. Numbers are checked before any write.
local lease = ms_arg(ARGV[3], 'lease')
local done_ms = ms_arg(ARGV[4], 'done marker lifetime', 0)
local grant_ms = grant_lease(ARGV[8] or '')
local limit = (ARGV[9] and ARGV[9] ~= '' and sem_limit(ARGV[9])) or 0
local prefix = ARGV[10]
local mode = ARGV[2]
local hold_ms = mode == 'hold' and ms_arg(ARGV[11], 'hold')
local permit = prefix .. ARGV[1]
local count = redis.call('hget', permit, ARGV[1])
if mode == 'unstarted' and count ~= '0' then
  return {-3}
end
if count and ARGV[7] and ARGV[7] ~= '' and redis.call('hget', permit, '__fence__') ~= ARGV[7] then
  return {-2}  -- a later holding of this owner (another copy of the run): a late retry leaves it
end
local code = count and 0 or -1
if hold_ms and not count then
  return {-1}
end
if count and mode == 'one' and tonumber(count) > 1 then
  return {redis.call('hincrby', permit, ARGV[1], -1)}
end
run_over(KEYS[6], done_ms, KEYS[5], KEYS[7], ARGV[1])
redis.call('hdel', KEYS[11], ARGV[1])
if hold_ms then
  redis.call('hset', permit, ARGV[1], 1)
  redis.call('pexpire', permit, hold_ms)
  return {0}
end
redis.call('del', permit)
redis.call('srem', KEYS[1], ARGV[1])
local held = live_permits(KEYS[1], prefix)
local fits, parked_limit = parked_fits(KEYS[4], KEYS[5], KEYS[11], held, prefix)
if fits then
  local function permit_of(task_id, token, task_lease)
    give_permit(KEYS[1], prefix, task_id, 0, token, task_lease, parked_limit)
    redis.call('hdel', KEYS[11], task_id)
  end
  local message, next_id, token = serve_parked(permit_of, KEYS[3], KEYS[4], KEYS[5], KEYS[7],
    lease, KEYS[1], ARGV[5] or '', ARGV[6] or '')
  return {code, message, next_id, token}
end
if held >= limit or redis.call('llen', KEYS[4]) > 0 then
  return {code}  -- a lowered limit, or parked tasks first: the freed permit stays free
end
local function granted(owner)
  redis.call('hset', prefix .. owner, '__limit__', limit)
  return prefix .. owner
end
local head = grant_first(granted, KEYS[2], KEYS[3], KEYS[8], KEYS[9], KEYS[10], grant_ms, false)
if head then
  redis.call('sadd', KEYS[1], head)
elseif redis.call('llen', KEYS[8]) == 0 then
  redis.call('publish', KEYS[2], '1')
end
return {code}
