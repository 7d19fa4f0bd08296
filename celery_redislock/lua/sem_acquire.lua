-- sem_acquire(keys=[holders, fence, waiters, claims, wake],
--             args=[owner, lease_ms, margin_ms?, limit, permit_prefix]) -> {1, token, count} | {0, ms}
-- Take or re-enter a permit of a semaphore (sem.lua), fair to its line of waiters (the
-- lock's line: list, places, wake ids; a semaphore's waiters take no direct grants).
-- owner: the caller; lease_ms: the permit's lease; margin_ms: join the line when refused,
-- keeping the place this long past the wait ("": a single try); limit: how many permits
-- may be held at once, read at each acquire; permit_prefix: the owner's permit key is
-- permit_prefix .. owner.
-- An owner that holds a permit re-enters it (count + 1, its token; the lease extended to
-- lease_ms if shorter); a permit a release granted it (count 0) is taken up. Otherwise a
-- permit is taken (a fresh token from fence) when fewer than limit are held and fewer
-- places still kept are ahead of the owner in line than permits are free.
-- Replies: {1, token, count} taken or re-entered; {0, ms} refused: ms, the wait for a
-- change (the shortest lease left of the permits held; or, with permits free but others
-- first in line, the wait for the first of them, at most 1000).
local lease = ms_arg(ARGV[2], 'lease')
local margin = ARGV[3] and ARGV[3] ~= '' and ms_arg(ARGV[3], 'line margin', 0)
local limit = sem_limit(ARGV[4])
local prefix = ARGV[5]
local permit = prefix .. ARGV[1]
local count = redis.call('hget', permit, ARGV[1])
if count then
  if count == '0' then  -- granted by a release: taken up
    count = 1
    redis.call('hset', permit, ARGV[1], 1)
  else
    count = redis.call('hincrby', permit, ARGV[1], 1)
  end
  if redis.call('pttl', permit) < lease then
    redis.call('pexpire', permit, lease)
  end
  redis.call('sadd', KEYS[1], ARGV[1])
  return {1, tonumber(redis.call('hget', permit, '__fence__')), tonumber(count)}
end
local held, soonest = live_permits(KEYS[1], prefix)
local free = limit - held
local wait = soonest or 1000
if free > 0 then
  local now = now_ms()
  local ahead, first_keep = 0, nil
  for _, waiter in ipairs(redis.call('lrange', KEYS[3], 0, -1)) do
    if waiter == ARGV[1] then
      break
    end
    local keep = tonumber(redis.call('zscore', KEYS[4], waiter) or '0')
    if keep < now then  -- a lapsed place (its waiter gone): dropped
      redis.call('lrem', KEYS[3], 0, waiter)
      redis.call('zrem', KEYS[4], waiter)
      redis.call('hdel', KEYS[5], waiter)
    else
      ahead = ahead + 1
      first_keep = first_keep or keep
      if ahead >= free then
        break
      end
    end
  end
  if ahead < free then
    redis.call('lrem', KEYS[3], 0, ARGV[1])
    redis.call('zrem', KEYS[4], ARGV[1])
    redis.call('hdel', KEYS[5], ARGV[1])
    local token = redis.call('incr', KEYS[2])
    redis.call('hset', permit, ARGV[1], 1, '__fence__', token)
    redis.call('pexpire', permit, lease)
    redis.call('sadd', KEYS[1], ARGV[1])
    return {1, token, 1}
  end
  wait = math.min(first_keep - now, 1000)
end
if margin then
  enter_line(KEYS[3], KEYS[4], KEYS[5], ARGV[1], math.max(wait, 0) + margin)
end
return {0, wait}
