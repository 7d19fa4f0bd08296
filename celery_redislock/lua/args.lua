-- Prepended to every script that takes a number or reads the clock (see _scripts.PRELUDES).
-- Each script checks all of its numeric arguments with these before its first write: a bad
-- one fails the script with an error reply, and nothing is written.
-- now_us(), now_ms()                 the server's clock (TIME): the only place it is read
-- whole_arg(value, what, low, high)  the number: a plain decimal integer from low to high
-- ms_arg(value, what, low)           a duration in milliseconds, from low (1 unless given)
--                                    to the package's longest duration (_core.MAX_SECONDS
--                                    in ms, filled in when the script is loaded)
-- us_arg(value, what, low)           the same in microseconds (MAX_US: that longest
--                                    duration in microseconds)
local MAX_US = MAX_MS * 1000
local function whole_arg(value, what, low, high)
  local n = type(value) == 'string' and string.match(value, '^%d+$') and tonumber(value)
  if not n or n < low or n > high then
    error({err = 'ERR redislock: ' .. what .. ' must be a whole number from ' .. low .. ' to '
      .. high .. ', got ' .. tostring(value)})
  end
  return n
end
local function ms_arg(value, what, low)
  return whole_arg(value, what .. ' (ms)', low or 1, MAX_MS)
end
local function us_arg(value, what, low)
  return whole_arg(value, what .. ' (us)', low or 1, MAX_US)
end
local function now_us()
  local t = redis.call('time')
  return t[1] * 1000000 + t[2]
end
local function now_ms()
  return math.floor(now_us() / 1000)
end
