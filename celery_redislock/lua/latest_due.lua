-- latest_due(keys=[latest, registry], args=[stale_ms])
--   -> {0, ms} nothing to send now (ms: until the key's next look; the registry rescored)
--   -> {-1}    no pending call waits to be due: taken out of the registry
--   -> {1, message, owner} the pending call is due: send its message (rescored at now +
--              stale_ms: sent again then if its delivery has not taken it up by then)
-- A drainer's look at one debounced key (latest.lua's hash; docs/concepts.md, "Last call
-- wins"). Several drainers at once are safe: one sends, the others find it sent.
local stale = ms_arg(ARGV[1], 'stale')
local kind = redis.call('type', KEYS[1]).ok
if kind ~= 'hash' then
  redis.call('zrem', KEYS[2], KEYS[1])
  return {-1}
end
local f = redis.call('hmget', KEYS[1], 'p', 'pd', 'pm', 'pq')
local due, sent = tonumber(f[2]), tonumber(f[4])
if not f[1] or not f[3] or not due or due <= 0 then
  redis.call('zrem', KEYS[2], KEYS[1])
  return {-1}
end
local now = now_ms()
if now < due then
  redis.call('zadd', KEYS[2], string.format('%.0f', due), KEYS[1])
  return {0, due - now}
end
if sent and now - sent < stale and sent <= now then
  redis.call('zadd', KEYS[2], string.format('%.0f', sent + stale), KEYS[1])
  return {0, sent + stale - now}
end
redis.call('hset', KEYS[1], 'pq', now)
redis.call('zadd', KEYS[2], now + stale, KEYS[1])
return {1, f[3], f[1]}
