-- Prepended to release.lua and handoff.lua (see _scripts.PRELUDES): a freed lock goes to the
-- first waiter in line (docs/concepts.md, "Wake-on-release").
-- grant_lease(value)  the ms a waiter granted the lock has to take it: value, a duration
--                     (args.lua), or 2000 when nil or ""; checked before the first write
-- grant_first(lock, channel, fence, waiters, claims, wake, grant_ms, direct) -> the waiter
--   granted (its owner id; nil: none)
--   Pops the line up to its first place still kept (lapsed places and their wake ids go) and
--   writes the lock for that waiter with a fresh token (`lock`: the lock's key, or a function
--   of the waiter's owner id giving the key to write: a semaphore's permit of that owner): with `direct` and a wake id, held
--   (count 1, for the shorter of grant_ms and the waiter's lease, "__grant__" naming the
--   wait), told "<token>:<nonce>" on channel:<subscriber> alone (a subscriber part "L...":
--   pushed to the list of that name, the waiter's box, kept grant_ms); else granted (count 0, for
--   grant_ms), its owner id published on channel (and pushed to its box, if its wake id names
--   one: that waiter hears nothing on channel). Its wake id goes either way.
local function grant_lease(value)
  return ms_arg((value ~= '' and value) or '2000', 'grant lease')
end
-- A lone waiter's box (a list it blocks on): the message pushed, kept grant_ms. pcall: a key
-- of another type there (a prefix writer's) costs that waiter its wake-up, not the release.
local function tell_box(box, message, grant_ms)
  if type(redis.pcall('rpush', box, message)) == 'number' then
    redis.call('pexpire', box, grant_ms)
  end
end
local function grant_first(lock, channel, fence, waiters, claims, wake, grant_ms, direct)
  local head = redis.call('lpop', waiters)
  local now = head and now_ms()  -- the clock is read only when someone is in line
  while head do
    local keep = tonumber(redis.call('zscore', claims, head) or '0')
    redis.call('zrem', claims, head)
    local wake_id = redis.call('hget', wake, head)
    if wake_id then
      redis.call('hdel', wake, head)
    end
    if keep >= now then
      if type(lock) == 'function' then
        lock = lock(head)
      end
      local token = redis.call('incr', fence)
      local sub, nonce, lease
      if direct and wake_id then
        sub, nonce, lease = string.match(wake_id, '^([^:]+):([^:]+):(%d+)$')
      end
      if sub then
        local wait = string.match(nonce, '^(.*)%.%d+$')
        redis.call('hset', lock, head, 1, '__fence__', token, '__grant__', sub .. ':' .. wait)
        redis.call('pexpire', lock, math.min(grant_ms, tonumber(lease)))
        if string.sub(sub, 1, 1) == 'L' then
          tell_box(channel .. ':' .. sub, token .. ':' .. nonce, grant_ms)
        else
          redis.call('publish', channel .. ':' .. sub, token .. ':' .. nonce)
        end
      else
        redis.call('hset', lock, head, 0, '__fence__', token)  -- count 0: granted, not taken
        redis.call('pexpire', lock, grant_ms)
        redis.call('publish', channel, head)
        local box = wake_id and string.match(wake_id, '^(L[^:]*):')
        if box then  -- a waiter reading its box hears nothing on channel: wake it there
          tell_box(channel .. ':' .. box, head, grant_ms)
        end
      end
      return head
    end
    head = redis.call('lpop', waiters)
  end
  return nil
end
