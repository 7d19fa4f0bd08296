-- Prepended to the scripts that take a lock (see _scripts.PRELUDES), after args.lua.
-- take_or_enter(lock, fence, waiters, claims, wake, owner, lease, new_token, present)
--   -> {1, token, count}  taken (a free lock: count 1, a fresh token) or re-entered (one more
--                         hold of owner: its token, or a fresh one with new_token; the lease
--                         is extended to `lease` if shorter, never shortened)
--   -> {0, ms}            the lock is free, but another owner's place in line comes first
--                         (ms: how long to wait for it to take the lock, at most 1000)
--   -> nil                another owner holds the lock
-- Places at the head of the line that have lapsed (claims score in the past) are dropped
-- on the way, with their wake ids; the owner's own place at the head goes when it takes it.
-- present: whether the lock exists, when the caller has just read it (nil: it is read here).
-- enter_line(waiters, claims, wake, owner, keep_ms, wake_id, lease)
--   A refused blocked attempt's place in line (joined at the back, or kept where it is),
--   kept keep_ms from now; wake_id: the waiter's, for a direct grant (kept as
--   "<wake_id>:<lease>"), else none.
local function enter_line(waiters, claims, wake, owner, keep_ms, wake_id, lease)
  if redis.call('zadd', claims, now_ms() + keep_ms, owner) == 1 then
    redis.call('rpush', waiters, owner)
  end
  if wake_id and wake_id ~= '' then
    redis.call('hset', wake, owner, wake_id .. ':' .. lease)
    if redis.call('pttl', wake) < keep_ms then
      redis.call('pexpire', wake, keep_ms)
    end
  else
    redis.call('hdel', wake, owner)
  end
end
-- held_by(lock, by): a task run's process, "<node>:<pid>", kept beside its hold ("__by__"), if
--   given; held_by_another(lock, by): whether "__by__" names another process than `by` (a
--   worker releasing for its dead pool process `by` must leave such a hold alone).
local function held_by(lock, by)
  if by and by ~= '' then
    redis.call('hset', lock, '__by__', by)
  end
end
local function held_by_another(lock, by)
  local found = by and by ~= '' and redis.call('hget', lock, '__by__')
  return found and found ~= by
end
local function take_or_enter(lock, fence, waiters, claims, wake, owner, lease, new_token, present)
  if present == nil then
    present = redis.call('exists', lock) == 1
  end
  if not present then
    if redis.call('llen', waiters) > 0 then
      local now = now_ms()
      local head = redis.call('lindex', waiters, 0)
      while head do
        local keep = tonumber(redis.call('zscore', claims, head) or '0')
        if keep >= now and head ~= owner then
          return {0, math.min(keep - now, 1000)}
        end
        redis.call('lpop', waiters)
        redis.call('zrem', claims, head)
        redis.call('hdel', wake, head)
        if keep >= now then
          break  -- the owner's own place: taken up
        end
        head = redis.call('lindex', waiters, 0)
      end
    end
    local token = redis.call('incr', fence)
    redis.call('hset', lock, owner, 1, '__fence__', token)
    redis.call('pexpire', lock, lease)
    return {1, token, 1}
  end
  if redis.call('hexists', lock, owner) == 0 then
    return nil
  end
  local count = redis.call('hincrby', lock, owner, 1)
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
  if new_token then
    return {1, redis.call('incr', fence), count}
  end
  return {1, tonumber(redis.call('hget', lock, '__fence__')), count}
end
