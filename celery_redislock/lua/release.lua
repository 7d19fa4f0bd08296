-- release(keys=[lock, channel, fence, waiters, claims, wake, done?],
--         args=[owner, mode?, hold_ms_or_wait?, done_ms?, grant_ms?, token?]) -> n
-- Give back a hold; when none is left, hand the lock to the first waiter in line (grant.lua),
-- or delete it and publish "1" on channel (docs/concepts.md, "Wake-on-release"). Keys as
-- acquire.lua's; channel: the release channel; done: a done marker to set for the owner once
-- its hold is given back, for done_ms. mode: "one" (default) one hold; "all" every hold of the
-- owner; "hold" keep the lock hold_ms more (unrenewed); "leave" a waiter giving up: leave the
-- line, and pass on a lock granted to it (to the wait "<subscriber>:<wait>" named by the third
-- argument, if direct); "force" whoever holds it (owner unused). grant_ms: a waiter granted
-- the lock has that long to take it (default 2000); token: only the holding with this
-- fencing token (another holding of the owner is left alone, -2).
-- Reply: n >= 0 holds the owner still has (0: given back); -1 the lock is gone (the lease
-- expired); -2 another owner holds it, nothing touched; -3 "leave": the waiter held nothing.
local mode = ARGV[2] or 'one'
local hold_ms = mode == 'hold' and ms_arg(ARGV[3], 'hold')
local done_ms = KEYS[7] and ARGV[4] and ms_arg(ARGV[4], 'done marker lifetime')
local grant_ms = grant_lease(ARGV[5])
if mode == 'leave' then
  redis.call('lrem', KEYS[4], 0, ARGV[1])
  redis.call('zrem', KEYS[5], ARGV[1])
  redis.call('hdel', KEYS[6], ARGV[1])
  local count = redis.call('hget', KEYS[1], ARGV[1])
  local direct = count and ARGV[3] and redis.call('hget', KEYS[1], '__grant__') == ARGV[3]
  if direct and tonumber(count) > 1 then
    -- granted directly to this wait, and counted more than once since (not expected: a
    -- waiting thread or task holds nothing): give back the grant's hold alone
    redis.call('hdel', KEYS[1], '__grant__')
    return redis.call('hincrby', KEYS[1], ARGV[1], -1)
  end
  if count ~= '0' and not direct then
    return -3
  end
elseif mode == 'force' then
  if redis.call('exists', KEYS[1]) == 0 then
    return -1
  end
else
  -- One HGET answers the usual case (the owner's count); the rarer ones need one more call.
  local count = redis.call('hget', KEYS[1], ARGV[1])
  if not count then
    return redis.call('exists', KEYS[1]) == 0 and -1 or -2
  end
  if ARGV[6] and ARGV[6] ~= '' and redis.call('hget', KEYS[1], '__fence__') ~= ARGV[6] then
    return -2
  end
  if mode == 'one' and tonumber(count) > 1 then
    return redis.call('hincrby', KEYS[1], ARGV[1], -1)
  end
end
if done_ms then
  redis.call('set', KEYS[7], '1', 'px', done_ms)
end
if hold_ms then
  redis.call('hset', KEYS[1], ARGV[1], 1)
  redis.call('hdel', KEYS[1], '__chain__')  -- kept, not running: no look-ahead chain (handoff.lua)
  redis.call('pexpire', KEYS[1], hold_ms)
  return 0
end
redis.call('del', KEYS[1])
if not grant_first(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], grant_ms, true) then
  redis.call('publish', KEYS[2], '1')
end
return 0
