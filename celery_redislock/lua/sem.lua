-- Prepended to the semaphore's scripts (see _scripts.PRELUDES; docs/concepts.md,
-- "Semaphores (at most N per key)"). A semaphore's permits: one hash per holder, the permit
-- key "<permit prefix><owner>" (owner -> hold count, "__fence__" -> token, a lease of its
-- own: renewed by renew.lua like a lock's hash), and the holders set listing their owners.
-- sem_limit(value)                     the limit: a whole number from 1 to 2^31-1
-- live_permits(holders, prefix) -> n, soonest
--   Counts the permits still held (a permit whose lease ran out is dropped from the set on
--   the way); soonest: the shortest lease left among them in ms (nil: none held).
local function sem_limit(value)
  return whole_arg(value, 'limit', 1, 2147483647)
end
local function live_permits(holders, prefix)
  local held, soonest = 0, nil
  for _, holder in ipairs(redis.call('smembers', holders)) do
    local left = redis.call('pttl', prefix .. holder)
    if left == -2 then
      redis.call('srem', holders, holder)
    else
      held = held + 1
      if left >= 0 and (not soonest or left < soonest) then
        soonest = left
      end
    end
  end
  return held, soonest
end
