-- rate(keys=[schedule of each limit], args=[max_wait_us, then per limit: increment_us, tolerance_us])
--   -> {1, wait_us, now_us}  admitted: the call's slot is wait_us after now_us (0: now), and
--                            every limit's schedule has moved past it
--   -> {0, wait_us, now_us}  refused (its slot is more than max_wait_us away): nothing taken;
--                            wait_us: how long until it would be admitted at once
-- GCRA (gcra.lua). increment_us: the call's cost over the limit's rate, rounded up (1 to
-- MAX_US); tolerance_us: the burst over the rate, rounded down, or the increment if that is
-- more.
if #KEYS < 1 or #ARGV ~= 1 + 2 * #KEYS then
  return redis.error_reply(
    'ERR redislock: rate takes a max wait, then an increment and a tolerance per key')
end
local max_wait = us_arg(ARGV[1], 'max wait', 0)
local admitted, wait, now = gcra(KEYS, ARGV, 2, max_wait)
return {admitted and 1 or 0, wait, now}
