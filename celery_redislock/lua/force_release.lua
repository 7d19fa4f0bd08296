-- Operator's release: delete the lock whoever holds it, and hand it to the first waiter in
-- line (or wake waiters).
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- KEYS[3]  fence counter
-- KEYS[4]  waiters (list)
-- KEYS[5]  claims (sorted set owner -> ms its place is kept until)
-- returns  1 if a lock was deleted, 0 if there was none
if redis.call('exists', KEYS[1]) == 0 then
  return 0
end
redis.call('del', KEYS[1])
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
while true do
  local head = redis.call('lpop', KEYS[4])
  if not head then
    break
  end
  local keep = tonumber(redis.call('zscore', KEYS[5], head) or '0')
  redis.call('zrem', KEYS[5], head)
  if keep >= now then
    local token = redis.call('incr', KEYS[3])
    redis.call('hset', KEYS[1], head, 0, '__fence__', token)
    redis.call('pexpire', KEYS[1], 2000)
    redis.call('publish', KEYS[2], head)
    return 1
  end
end
redis.call('publish', KEYS[2], '1')
return 1
