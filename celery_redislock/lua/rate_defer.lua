-- rate_defer(keys=[deferred list, registry, schedule of each limit],
--            args=[entry, then per limit: increment_us, tolerance_us])
--   -> {1, 0, now_us} admitted at once: the call's slot is booked (gcra.lua, max wait 0)
--   -> {0, wait_us}  deferred: the entry appended to the key's deferred list; wait_us: until
--                    the list's head is due (-1: behind others already deferred)
-- A key with deferred calls admits none at once: a call joins the end of its line, so the
-- line drains in arrival order (rate_drain.lua). The registry (a sorted set of deferred
-- lists) scores each list by when its head is due, in ms on this server's clock (a call
-- joining a line brings a score later than that back to it). A key of
-- another type where the list or registry belongs is junk: it is replaced.
if #KEYS < 3 or #ARGV ~= 1 + 2 * (#KEYS - 2) then
  return redis.error_reply(
    'ERR redislock: rate_defer takes an entry, then an increment and a tolerance per key')
end
local entry = ARGV[1]
if #entry == 0 then
  return redis.error_reply('ERR redislock: rate_defer takes a non-empty entry')
end
local schedules = {}
for i = 3, #KEYS do
  schedules[#schedules + 1] = KEYS[i]
end
gcra_limits(schedules, ARGV, 2)  -- every argument checked before the first write
local kinds = {list = true, none = true}
if not kinds[redis.call('type', KEYS[1]).ok] then
  redis.call('del', KEYS[1])
end
local registry_kind = redis.call('type', KEYS[2]).ok
if registry_kind ~= 'zset' and registry_kind ~= 'none' then
  redis.call('del', KEYS[2])
end
if redis.call('llen', KEYS[1]) > 0 then
  redis.call('rpush', KEYS[1], entry)
  -- Registered when its head is due, unless it is already registered at or before then: a
  -- score past that (junk) would keep the line waiting for nothing.
  local _, head_wait, now = gcra(schedules, ARGV, 2, -1)
  local due = math.ceil((now + head_wait) / 1000)
  local scored = tonumber(redis.call('zscore', KEYS[2], KEYS[1]))
  if not scored or scored > due then
    redis.call('zadd', KEYS[2], string.format('%.0f', due), KEYS[1])
  end
  return {0, -1}
end
local admitted, wait, now = gcra(schedules, ARGV, 2, 0)
if admitted then
  return {1, 0, now}
end
redis.call('rpush', KEYS[1], entry)
redis.call('zadd', KEYS[2], string.format('%.0f', math.ceil((now + wait) / 1000)), KEYS[1])
return {0, wait}
