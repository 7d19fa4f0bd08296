-- fence(keys=[highest, target?], args=[token, value?]) -> 1 | 0
-- Admit a fencing token at a protected resource, rejecting stale holders.
--   highest  the resource's highest admitted token (never expires)
--   target   optional: a key to SET to value atomically when the token is admitted
--   token    fencing token (a positive integer)
-- 1: admitted (token >= highest seen; highest updated); 0: rejected as stale.
local token = tonumber(ARGV[1])
if not token or token < 1 then
  return redis.error_reply('ERR redislock: fencing token must be a positive integer')
end
local highest = tonumber(redis.call('get', KEYS[1]) or '0')
if token < highest then
  return 0
end
if token > highest then
  redis.call('set', KEYS[1], token)
end
if #KEYS > 1 then
  redis.call('set', KEYS[2], ARGV[2])
end
return 1
