-- Admit a fencing token at a protected resource, rejecting stale holders.
-- KEYS[1]  the resource's highest admitted token (never expires)
-- KEYS[2]  optional: a key to SET to ARGV[2] atomically when the token is admitted
-- ARGV[1]  fencing token (a positive integer)
-- ARGV[2]  optional: value for KEYS[2]
-- returns  1 admitted (token >= highest seen; highest updated), 0 rejected as stale
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
