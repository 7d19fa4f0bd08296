-- rate_resend(keys=[sending], args=[member, stale_ms]) -> 1 | 0
-- Claims a deferred call taken for sending (rate_drain.lua) but not confirmed sent within
-- stale_ms (its drainer died): 1, and it is scored now (the claimant sends it and removes
-- it); 0 if it is gone or not stale (another drainer has it). One claimant at a time.
local stale = ms_arg(ARGV[2], 'stale')
local score = redis.pcall('zscore', KEYS[1], ARGV[1])
if type(score) ~= 'string' then
  return 0
end
local now = now_ms()
if tonumber(score) > now - stale then
  return 0
end
redis.call('zadd', KEYS[1], string.format('%.0f', now), ARGV[1])
return 1
