-- rate_drain(keys=[deferred list, registry, sending, schedule of each limit],
--            args=[head entry, mode, then per limit: increment_us, tolerance_us])
--   -> {0}           the list is empty (or not a list): taken out of the registry
--   -> {1}           its head is not the entry given (another drainer took it): nothing done
--   -> {2, wait_us}  the head is not due: rescheduled in the registry at its due time
--   -> {3}           mode 'drop': the head removed (refused by the caller), nothing booked
--   -> {5, now_us}   mode 'pass': the head moved to `sending` as 'admit' does, no slot booked
--                    (the caller found it expired: it is sent on to be dropped by its worker)
--   -> {4, now_us}   mode 'admit': the head's slot booked (at now_us) (gcra.lua, max wait 0), the head
--                    moved from the list to `sending` (member "<list key>\n<entry>", scored
--                    by now in ms) until the caller has sent it; the list rescheduled at
--                    its next head's due time (or taken out of the registry when empty)
-- Several drainers at once are safe: each call acts only on the head it was given.
if #ARGV ~= 2 + 2 * (#KEYS - 3) or #KEYS < 3 then
  return redis.error_reply(
    'ERR redislock: rate_drain takes a head and a mode, then an increment and a tolerance per key')
end
local mode = ARGV[2]
if mode ~= 'admit' and mode ~= 'drop' and mode ~= 'pass' then
  return redis.error_reply('ERR redislock: rate_drain mode must be admit, drop or pass')
end
local schedules = {}
for i = 4, #KEYS do
  schedules[#schedules + 1] = KEYS[i]
end
gcra_limits(schedules, ARGV, 3)
local head = redis.pcall('lindex', KEYS[1], 0)
if type(head) ~= 'string' then
  redis.pcall('zrem', KEYS[2], KEYS[1])
  return {0}
end
if head ~= ARGV[1] then
  return {1}
end
local function ms(us)
  return string.format('%.0f', math.ceil(us / 1000))
end
local function reschedule(at_us)
  if redis.call('llen', KEYS[1]) == 0 then
    redis.call('zrem', KEYS[2], KEYS[1])
  else
    redis.call('zadd', KEYS[2], ms(at_us), KEYS[1])
  end
end
if mode == 'drop' then
  redis.call('lpop', KEYS[1])
  reschedule(now_us())
  return {3}
end
local admitted, wait, now
if mode == 'pass' then
  now = now_us()
else
  admitted, wait, now = gcra(schedules, ARGV, 3, 0)
  if not admitted then
    redis.call('zadd', KEYS[2], ms(now + wait), KEYS[1])
    return {2, wait}
  end
end
redis.call('lpop', KEYS[1])
redis.call('zadd', KEYS[3], ms(now), KEYS[1] .. '\n' .. head)
local _, next_wait = gcra(schedules, ARGV, 3, -1)
reschedule(now + next_wait)
return {mode == 'pass' and 5 or 4, now}
