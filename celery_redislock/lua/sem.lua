-- Prepended to the semaphore's scripts (see _scripts.PRELUDES; docs/concepts.md,
-- "Semaphores (at most N per key)"). A semaphore's permits: one hash per holder, the permit
-- key "<permit prefix><owner>" (owner -> hold count, "__fence__" -> token, a lease of its
-- own: renewed by renew.lua like a lock's hash), and the holders set listing their owners.
-- sem_limit(value)                     the limit: a whole number from 1 to 2^31-1
-- live_permits(holders, prefix) -> n, soonest
--   Counts the permits still held (a permit whose lease ran out is dropped from the set on
--   the way); soonest: the shortest lease left among them in ms (nil: none held).
-- parked_head(parked, messages, limits, prefix) -> the first parked task still waiting and its
--   limit (limits: task id -> the limit it parked with; 1 if missing or not a limit: anyone
--   may have written it); nil: none. Dropped on the way: ids whose message is gone (as
--   pop_parked does), and ids that hold a permit (another copy of the run took one: its
--   parked entry is done; one handed a permit keeps its message for the sweeper).
-- parked_fits(parked, messages, limits, held, prefix) -> whether the first parked task may be
--   handed a permit while `held` are held (fewer than its own limit), and its limit
-- take_permit(holders, fence, waiters, claims, wake, owner, lease, limit, prefix, margin, parked)
--   -> {1, token, count} | {0, ms}
--   Take or re-enter a permit, fair to the line of waiters: an owner holding a permit
--   re-enters it (count + 1, its token; the lease extended to `lease` if shorter); a permit
--   granted or handed to it (count 0) is taken up; otherwise a permit is taken (a fresh
--   token) when fewer than `limit` are held and fewer places still kept are ahead of the
--   owner in line than permits are free. Refused: {0, ms}, the wait for a change (the
--   shortest lease left of the permits held; or, with permits free but others first in line,
--   the wait for the first of them, at most 1000); with `margin`, the owner joins the line
--   (or keeps its place), kept that long past the wait. With `parked` ({parked, messages,
--   limits}: a task run's attempt), parked tasks come first: a permit is taken only when no
--   task is parked or the owner is the first parked (its entry then goes).
-- give_permit(holders, prefix, owner, count, token, lease, limit) -> the permit written for owner
--   (its hash: owner -> count, "__fence__" -> token, "__limit__" -> the limit it was taken
--   under, which `celery redislock` shows; the lease), entered in the holders set
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
local function parked_head(parked, messages, limits, prefix)
  while true do
    local head = redis.call('lindex', parked, 0)
    if not head then
      return nil
    end
    local count = redis.call('hget', prefix .. head, head)
    if redis.call('hexists', messages, head) == 1 and not count then
      local value = redis.call('hget', limits, head)
      local n = value and string.match(value, '^%d+$') and tonumber(value)
      return head, (n and n >= 1 and n <= 2147483647 and n) or 1
    end
    redis.call('lpop', parked)
    if count and count ~= '0' then  -- another copy of its run took a permit: it runs
      redis.call('hdel', messages, head)
      redis.call('hdel', limits, head)
    end
  end
end
local function parked_fits(parked, messages, limits, held, prefix)
  local head, limit = parked_head(parked, messages, limits, prefix)
  return head ~= nil and held < limit, limit
end
local function give_permit(holders, prefix, owner, count, token, lease, limit)
  local permit = prefix .. owner
  redis.call('hset', permit, owner, count, '__fence__', token, '__limit__', limit)
  redis.call('pexpire', permit, lease)
  redis.call('sadd', holders, owner)
  return permit
end
local function take_permit(holders, fence, waiters, claims, wake, owner, lease, limit, prefix, margin, parked)
  local permit = prefix .. owner
  local count = redis.call('hget', permit, owner)
  if count then
    if count == '0' then  -- granted or handed over: taken up
      count = 1
      redis.call('hset', permit, owner, 1)
    else
      count = redis.call('hincrby', permit, owner, 1)
    end
    if redis.call('pttl', permit) < lease then
      redis.call('pexpire', permit, lease)
    end
    redis.call('sadd', holders, owner)
    return {1, tonumber(redis.call('hget', permit, '__fence__')), tonumber(count)}
  end
  local held, soonest = live_permits(holders, prefix)
  local free = limit - held
  local wait = soonest or 1000
  local head = free > 0 and parked and parked_head(parked[1], parked[2], parked[3], prefix)
  if head and head ~= owner then
    free = 0  -- parked tasks first (first come, first served)
  end
  if free > 0 then
    local now = now_ms()
    local ahead, first_keep = 0, nil
    for _, waiter in ipairs(redis.call('lrange', waiters, 0, -1)) do
      if waiter == owner then
        break
      end
      local keep = tonumber(redis.call('zscore', claims, waiter) or '0')
      if keep < now then  -- a lapsed place (its waiter gone): dropped
        redis.call('lrem', waiters, 0, waiter)
        redis.call('zrem', claims, waiter)
        redis.call('hdel', wake, waiter)
      else
        ahead = ahead + 1
        first_keep = first_keep or keep
        if ahead >= free then
          break
        end
      end
    end
    if ahead < free then
      redis.call('lrem', waiters, 0, owner)
      redis.call('zrem', claims, owner)
      redis.call('hdel', wake, owner)
      if head then  -- the first parked task itself (another copy of it): its entry goes
        redis.call('lpop', parked[1])
        redis.call('hdel', parked[2], owner)
        redis.call('hdel', parked[3], owner)
      end
      local token = redis.call('incr', fence)
      give_permit(holders, prefix, owner, 1, token, lease, limit)
      return {1, token, 1}
    end
    wait = math.min(first_keep - now, 1000)
  end
  if margin then
    enter_line(waiters, claims, wake, owner, math.max(wait, 0) + margin)
  end
  return {0, wait}
end
