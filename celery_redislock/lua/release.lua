-- Give back a hold; when none is left delete the lock and wake waiters.
-- KEYS[1]  lock hash
-- KEYS[2]  release channel (a message here wakes one waiter per subscribed process)
-- KEYS[3]  optional: "done" marker to set for the owner once its hold is given back
-- ARGV[1]  owner id
-- ARGV[2]  optional mode: "one" (default) one hold; "all" every hold of the owner (a worker
--          releasing for a dead task); "hold" keep the lock, but only for ARGV[3] ms more
-- ARGV[3]  with "hold": milliseconds to keep the lock (a positive integer)
-- ARGV[4]  with KEYS[3]: lifetime of the done marker in milliseconds
-- returns  n >= 0  holds the owner still has (0: given back; lock deleted or left to expire)
--          -1      the lock key is gone (the lease expired)
--          -2      another owner holds the lock (ours expired and was taken); nothing touched
if redis.call('exists', KEYS[1]) == 0 then
  return -1
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return -2
end
local mode = ARGV[2] or 'one'
if mode == 'one' then
  local count = tonumber(redis.call('hget', KEYS[1], ARGV[1]))
  if count > 1 then
    return redis.call('hincrby', KEYS[1], ARGV[1], -1)
  end
end
-- Given back in full. Publish first: the script is atomic, so woken waiters retry after it
-- ends, and a PUBLISH an ACL refuses fails the script before anything was changed.
if mode ~= 'hold' then
  redis.call('publish', KEYS[2], '1')
end
if KEYS[3] then
  redis.call('set', KEYS[3], '1', 'px', ARGV[4])
end
if mode == 'hold' then
  local keep = tonumber(ARGV[3])
  if not keep or keep <= 0 then
    return redis.error_reply('ERR redislock: hold must be a positive number of milliseconds')
  end
  redis.call('hset', KEYS[1], ARGV[1], 1)
  redis.call('pexpire', KEYS[1], keep)
  return 0
end
redis.call('del', KEYS[1])
return 0
