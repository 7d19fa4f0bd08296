-- Replace the lease of many holds at once (the watchdog's batch, and extend()).
-- Owner-checked; never resurrects a missing key. All keys must share one cluster slot.
-- KEYS[i]      lock hash of hold i
-- ARGV[2i-1]   owner id of hold i
-- ARGV[2i]     new lease of hold i in milliseconds (a whole number from 1 to the longest
--              duration: args.lua); all are checked before any lease is touched
-- returns      array, one per key: 1 renewed, 0 lock key gone (expired), -1 held by another owner
if #ARGV ~= 2 * #KEYS then
  return redis.error_reply('ERR redislock: renew takes an owner and a lease per key')
end
local leases = {}
for i = 1, #KEYS do
  leases[i] = ms_arg(ARGV[2 * i], 'lease')
end
local result = {}
for i = 1, #KEYS do
  local lease = leases[i]
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
