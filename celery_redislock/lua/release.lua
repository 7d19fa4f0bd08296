-- Give back one hold; at zero delete the lock and wake waiters.
-- KEYS[1]  lock hash
-- KEYS[2]  release channel (a message here wakes one waiter per subscribed process)
-- ARGV[1]  owner id
-- returns  n >= 0  holds the owner still has (0: lock deleted and release published)
--          -1      the lock key is gone (the lease expired)
--          -2      another owner holds the lock (ours expired and was taken); nothing touched
if redis.call('exists', KEYS[1]) == 0 then
  return -1
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return -2
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
  return count
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], '1')
return 0
