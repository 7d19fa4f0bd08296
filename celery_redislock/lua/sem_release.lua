-- sem_release(keys=[holders, channel, fence, waiters, claims, wake],
--             args=[owner, mode?, unused, unused, grant_ms?, token?, limit, permit_prefix]) -> n
-- Give back one hold of the owner's permit (sem.lua); when none is left, the permit is freed
-- and, if fewer than limit permits are then held, handed to the first waiter in line
-- (grant.lua, not direct: count 0 for grant_ms, its owner id published on channel); with
-- nobody in line, "1" is published. A freed permit goes to one waiter: a release wakes as
-- many waiters as permits it frees. ARGV as release.lua's (mode "one", the default, or
-- "leave": a waiter giving up its place, and a permit granted to it meanwhile), then the
-- releasing caller's limit and the permit key prefix (as sem_acquire.lua's).
-- Reply (release.lua's codes): n >= 0 holds the owner still has (0: freed); -1 the permit is
-- gone (its lease ran out); -2 the permit has another token (token given); -3 "leave": the
-- waiter held nothing.
local mode = (ARGV[2] and ARGV[2] ~= '' and ARGV[2]) or 'one'
local grant_ms = grant_lease(ARGV[5])
local limit = sem_limit(ARGV[7])
local prefix = ARGV[8]
local permit = prefix .. ARGV[1]
local count = redis.call('hget', permit, ARGV[1])
if mode == 'leave' then
  redis.call('lrem', KEYS[4], 0, ARGV[1])
  redis.call('zrem', KEYS[5], ARGV[1])
  redis.call('hdel', KEYS[6], ARGV[1])
  if count ~= '0' then
    return -3
  end
elseif mode == 'one' then
  if not count then
    return -1
  end
  if ARGV[6] and ARGV[6] ~= '' and redis.call('hget', permit, '__fence__') ~= ARGV[6] then
    return -2
  end
  if tonumber(count) > 1 then
    return redis.call('hincrby', permit, ARGV[1], -1)
  end
else
  return redis.error_reply('ERR redislock: unknown semaphore release mode ' .. mode)
end
redis.call('del', permit)
redis.call('srem', KEYS[1], ARGV[1])
local held = live_permits(KEYS[1], prefix)
if held < limit then
  local function permit_of(owner)
    redis.call('hset', prefix .. owner, '__limit__', limit)
    return prefix .. owner
  end
  local head = grant_first(permit_of, KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], grant_ms, false)
  if head then
    redis.call('sadd', KEYS[1], head)
  elseif redis.call('llen', KEYS[4]) == 0 then
    redis.call('publish', KEYS[2], '1')
  end
end
return 0
