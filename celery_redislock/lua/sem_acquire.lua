-- sem_acquire(keys=[holders, fence, waiters, claims, wake, done?, parked?, messages?, limits?],
--             args=[owner, lease_ms, margin_ms?, limit, permit_prefix, mode?, adopted?])
--   -> {1, token, count} | {0, ms} | {-1, 0} | {2, ms}
-- Take or re-enter a permit of a semaphore (sem.lua's take_permit), fair to its line of
-- waiters (the lock's line: list, places, wake ids; a semaphore's waiters take no direct
-- grants). owner: the caller; lease_ms: the permit's lease; margin_ms: join the line when
-- refused, keeping the place this long past the wait ("": a single try); limit: how many
-- permits may be held at once, read at each acquire; permit_prefix: the owner's permit key is
-- permit_prefix .. owner. A task run's attempt (the Celery layer's, as acquire.lua's): done,
-- its done marker (it exists: take nothing); mode "task" (one hold per run: a permit the
-- owner holds already is left alone, {2, ms}) or "adopt" (take over the permit of `adopted`,
-- an earlier run that kept it across a retry, as one hold, unless this run holds one already);
-- parked, messages, limits: the parked tasks (sem_park.lua's), served first (take_permit).
-- Replies: {1, token, count} taken or re-entered; {0, ms} refused (take_permit's wait);
-- {-1, 0} done; {2, ms} "task": this owner holds a permit (ms: its lease left).
local lease = ms_arg(ARGV[2], 'lease')
local margin = ARGV[3] and ARGV[3] ~= '' and ms_arg(ARGV[3], 'line margin', 0)
local limit = sem_limit(ARGV[4])
local prefix = ARGV[5]
if KEYS[6] and redis.call('exists', KEYS[6]) == 1 then
  return {-1, 0}
end
local permit = prefix .. ARGV[1]
local count = redis.call('hget', permit, ARGV[1])
if (ARGV[6] == 'task' or ARGV[6] == 'adopt') and count and count ~= '0' then
  return {2, redis.call('pttl', permit)}  -- another delivery of this run holds it
end
if ARGV[6] == 'adopt' and not count and ARGV[7] and ARGV[7] ~= ARGV[1]
    and redis.call('hexists', prefix .. ARGV[7], ARGV[7]) == 1 then
  local kept = prefix .. ARGV[7]
  local token = tonumber(redis.call('hget', kept, '__fence__') or '')
  if token then  -- (a permit without a token was not written by these scripts: not adopted)
    redis.call('del', kept)
    redis.call('srem', KEYS[1], ARGV[7])
    give_permit(KEYS[1], prefix, ARGV[1], 1, token, lease, limit)
    return {1, token, 1}
  end
end
local parked = KEYS[9] and {KEYS[7], KEYS[8], KEYS[9]}
return take_permit(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], lease, limit, prefix, margin,
  parked)
