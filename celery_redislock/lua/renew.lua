-- Replace the lease of many holds at once (the watchdog's batch, and extend()).
-- Owner-checked; never resurrects a missing key. All keys must share one cluster slot.
-- KEYS[i]      lock hash of hold i
-- ARGV[2i-1]   owner id of hold i
-- ARGV[2i]     new lease of hold i in milliseconds (a positive integer)
-- returns      array, one per key: 1 renewed, 0 lock key gone (expired), -1 held by another owner
local result = {}
for i = 1, #KEYS do
  local lease = tonumber(ARGV[2 * i])
  if not lease or lease <= 0 then
    return redis.error_reply('ERR redislock: lease must be a positive number of milliseconds')
  end
  if redis.call('exists', KEYS[i]) == 0 then
    result[i] = 0
  elseif redis.call('hexists', KEYS[i], ARGV[2 * i - 1]) == 0 then
    result[i] = -1
  else
    redis.call('pexpire', KEYS[i], lease)
    result[i] = 1
  end
end
return result
