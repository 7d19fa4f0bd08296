-- renew(keys=[lock of each hold], args=[owner, lease_ms, token per hold]) -> {1 | 0 | -1, ...}
-- Replace the lease of many holds at once (the watchdog's batch, and extend()).
-- Owner-checked; never resurrects a missing key. All keys must share one cluster slot.
--   lease_ms  a whole number from 1 to the longest duration (args.lua); all are checked
--             before any lease is touched
--   token     the holding's fencing token ("": any): a hash of this owner with another
--             token is a later holding of the same owner (its own lease lapsed meanwhile)
-- One reply per key: 1 renewed, 0 lock key gone (expired), -1 held by another owner or
-- another holding of this owner.
if #ARGV ~= 3 * #KEYS then
  return redis.error_reply('ERR redislock: renew takes an owner, a lease and a token per key')
end
local leases = {}
for i = 1, #KEYS do
  leases[i] = ms_arg(ARGV[3 * i - 1], 'lease')
end
local result = {}
for i = 1, #KEYS do
  local lease = leases[i]
  local token = ARGV[3 * i]
  if redis.call('exists', KEYS[i]) == 0 then
    result[i] = 0
  elseif redis.call('hexists', KEYS[i], ARGV[3 * i - 2]) == 0 then
    result[i] = -1
  elseif token ~= '' and redis.call('hget', KEYS[i], '__fence__') ~= token then
    result[i] = -1
  else
    redis.call('pexpire', KEYS[i], lease)
    result[i] = 1
  end
end
return result
