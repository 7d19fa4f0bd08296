-- Prepended to the rate scripts (see _scripts.PRELUDES), after args.lua.
-- gcra(schedules, args, from, max_wait) -> admitted, wait_us, now_us
--   GCRA over every limit at once (docs/concepts.md, "Rate limiters"). schedules: each
--   limit's schedule key; args[from + 2(i-1)], args[from + 2i - 1]: limit i's increment_us
--   and tolerance_us. A schedule holds its limit's theoretical arrival time (TAT):
--   microseconds on this server's clock (TIME). A call is due once TAT + increment -
--   tolerance has come for every limit; its slot is the latest of these (or now). If the
--   slot is at most max_wait away it is booked (each TAT becomes max(TAT, slot) +
--   increment); else nothing is taken (max_wait -1: only asks when). A schedule expires
--   once its TAT has passed (an idle limit is a missing key). A schedule that is not a
--   whole number of microseconds within reach (now + 2 * MAX_US: no admitted call books
--   further) is read as full, the burst just spent (TAT = now + tolerance), and rewritten so.
local function gcra_store(key, tat, now)
  -- Kept 1 ms past its TAT: a key's expiry is counted from the script's start, a little
  -- before now_us, and must not end before the TAT.
  redis.call('set', key, string.format('%.0f', tat), 'px',
    string.format('%.0f', math.ceil((tat - now) / 1000) + 1))
end

local function gcra_limits(schedules, args, from)
  local increments, tolerances = {}, {}
  for i = 1, #schedules do
    increments[i] = us_arg(args[from + 2 * (i - 1)], 'increment')
    tolerances[i] = us_arg(args[from + 2 * i - 1], 'tolerance', increments[i])
  end
  return increments, tolerances
end

local function gcra(schedules, args, from, max_wait)
  local increments, tolerances = gcra_limits(schedules, args, from)
  local now = now_us()
  local tats, wait = {}, 0
  for i = 1, #schedules do
    local value = redis.pcall('get', schedules[i])
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
      gcra_store(schedules[i], tat, now)
    end
    tats[i] = tat
    wait = math.max(wait, tat + increments[i] - tolerances[i] - now)
  end
  if wait > max_wait then
    return false, wait, now
  end
  local slot = now + wait
  for i = 1, #schedules do
    gcra_store(schedules[i], math.max(tats[i], slot) + increments[i], now)
  end
  return true, wait, now
end
