-- Take or re-enter a reentrant lock in one round trip.
-- KEYS[1]  lock hash: field <owner> = hold count, field "__fence__" = fencing token of this holding
-- KEYS[2]  fence counter: last token handed out for this lock name (never expires)
-- KEYS[3]  optional: "done" marker of the owner (a finished task id); if it exists, take nothing
-- ARGV[1]  owner id (never "__fence__")
-- ARGV[2]  lease in milliseconds (a positive integer)
-- returns  {1, token, hold_count}  taken (hold_count 1, fresh token) or re-entered (same token)
--          {0, pttl}               held by another owner; pttl = ms left on its lease (-1: no expiry)
--          {-1, 0}                 KEYS[3] exists: this owner already finished its work here
local lease = tonumber(ARGV[2])
if not lease or lease <= 0 then
  return redis.error_reply('ERR redislock: lease must be a positive number of milliseconds')
end
if KEYS[3] and redis.call('exists', KEYS[3]) == 1 then
  return {-1, 0}
end
if redis.call('exists', KEYS[1]) == 0 then
  local token = redis.call('incr', KEYS[2])
  redis.call('hset', KEYS[1], ARGV[1], 1, '__fence__', token)
  redis.call('pexpire', KEYS[1], lease)
  return {1, token, 1}
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
  local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  if redis.call('pttl', KEYS[1]) < lease then  -- re-entering never shortens the lease
    redis.call('pexpire', KEYS[1], lease)
  end
  return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), count}
end
return {0, redis.call('pttl', KEYS[1])}
