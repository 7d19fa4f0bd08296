-- rate(keys=[schedule of each limit], args=[max_wait_us, then per limit: increment_us, tolerance_us])
--   -> {1, wait_us, now_us}  admitted: the call's slot is wait_us after now_us (0: now), and
--                            every limit's schedule has moved past it
--   -> {0, wait_us, now_us}  refused (its slot is more than max_wait_us away): nothing taken;
--                            wait_us: how long until it would be admitted at once
-- GCRA over every limit at once (docs/concepts.md, "Rate limiters"). A schedule holds its
-- limit's theoretical arrival time (TAT): microseconds on this server's clock (TIME). A call
-- is due once TAT + increment - tolerance has come for every limit; its slot is the latest
-- of these (or now), and each TAT becomes max(TAT, slot) + increment. A schedule expires
-- once its TAT has passed (an idle limit is a missing key).
-- increment_us: the call's cost over the limit's rate, rounded up (1 to MAX_US);
-- tolerance_us: the burst over the rate, rounded down, or the increment if that is more.
-- A schedule that is not a whole number of microseconds within reach (now + 2 * MAX_US: no
-- admitted call books further) is read as full, the burst just spent (TAT = now +
-- tolerance), and rewritten so.
if #KEYS < 1 or #ARGV ~= 1 + 2 * #KEYS then
  return redis.error_reply(
    'ERR redislock: rate takes a max wait, then an increment and a tolerance per key')
end
local max_wait = us_arg(ARGV[1], 'max wait', 0)
local increments, tolerances = {}, {}
for i = 1, #KEYS do
  increments[i] = us_arg(ARGV[2 * i], 'increment')
  tolerances[i] = us_arg(ARGV[2 * i + 1], 'tolerance', increments[i])
end
local clock = redis.call('time')
local now = clock[1] * 1000000 + clock[2]

local function store(key, tat)
  -- Kept 1 ms past its TAT: a key's expiry is counted from the script's start, a little
  -- before now_us, and must not end before the TAT.
  redis.call('set', key, string.format('%.0f', tat), 'px',
    string.format('%.0f', math.ceil((tat - now) / 1000) + 1))
end

local tats, wait = {}, 0
for i = 1, #KEYS do
  local value = redis.pcall('get', KEYS[i])
  local tat = nil
  if value == false then
    tat = now
  elseif type(value) == 'string' and #value <= 16 and string.match(value, '^%d+$') then
    tat = tonumber(value)
    if tat > now + 2 * MAX_US then
      tat = nil
    end
  end
  if not tat then
    tat = now + tolerances[i]
    store(KEYS[i], tat)
  end
  tats[i] = tat
  wait = math.max(wait, tat + increments[i] - tolerances[i] - now)
end
if wait > max_wait then
  return {0, wait, now}
end
local slot = now + wait
for i = 1, #KEYS do
  store(KEYS[i], math.max(tats[i], slot) + increments[i])
end
return {1, wait, now}
