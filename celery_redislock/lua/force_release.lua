-- Operator's release: delete the lock whoever holds it and wake waiters.
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- returns  1 if a lock was deleted, 0 if there was none
if redis.call('exists', KEYS[1]) == 1 then
  redis.call('publish', KEYS[2], '1')  -- first: a refused PUBLISH changes nothing
  redis.call('del', KEYS[1])
  return 1
end
return 0
