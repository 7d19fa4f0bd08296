-- Give back a hold; when none is left, hand the lock to the first waiter in line, or
-- delete it and wake waiters.
-- KEYS[1]  lock hash
-- KEYS[2]  release channel: the new holder's owner id after a hand-over (wakes exactly that
--          waiter), or "1" (wakes one waiter per subscribed process). A waiter that asked
--          for a direct grant ("<subscriber>:<nonce>:<lease>" in the hash KEYS[4]..":wake",
--          same hash tag; nonce "<wait>.<attempt>", new for every attempt) is told on
--          KEYS[2]..":"..<subscriber> alone, with "<token>:<nonce>": only its process wakes,
--          and it counts the grant as acquired if it answers its latest attempt. Such a
--          grant is written as taken (hold count 1) with the shorter of ARGV[5] and the
--          waiter's own lease, and the field "__grant__" = "<subscriber>:<wait>" names the
--          wait (it goes with the lock): a later attempt of that wait takes the grant
--          without counting it twice, and its "leave" passes it on
-- KEYS[3]  fence counter
-- KEYS[4]  waiters (list, first come first served)
-- KEYS[5]  claims (sorted set owner -> ms its place is kept until)
-- KEYS[6]  optional: "done" marker to set for the owner once its hold is given back
-- ARGV[1]  owner id
-- ARGV[2]  optional mode: "one" (default) one hold; "all" every hold of the owner (a worker
--          releasing for a dead task); "hold" keep the lock, but only for ARGV[3] ms more;
--          "leave" a waiter giving up: leave the line, and pass on a lock granted to it;
--          "force" an operator's release: whoever holds the lock (ARGV[1] unused)
-- ARGV[3]  with "hold": milliseconds to keep the lock (1 to the longest duration); with "leave":
--          "<subscriber>:<wait>" of the leaving waiter (a direct grant to it is passed on)
-- ARGV[4]  with KEYS[6]: lifetime of the done marker in milliseconds
-- ARGV[5]  optional: ms a waiter granted the lock has to take it (default, or "": 2000)
-- ARGV[6]  optional: the fencing token of the holding to give back: another holding of the
--          same owner (the release being retried landed, and the owner took the lock
--          afresh) is left alone (-2)
-- returns  n >= 0  holds the owner still has (0: given back; lock handed over, deleted or
--                  left to expire)
--          -1      the lock key is gone (the lease expired)
--          -2      another owner holds the lock (ours expired and was taken); nothing touched
--          -3      "leave": the waiter held nothing
local mode = ARGV[2] or 'one'
local hold_ms = mode == 'hold' and ms_arg(ARGV[3], 'hold')
local done_ms = KEYS[6] and ARGV[4] and ms_arg(ARGV[4], 'done marker lifetime')
local grant_ms = ms_arg((ARGV[5] ~= '' and ARGV[5]) or '2000', 'grant lease')
local wake_key = KEYS[4] .. ':wake'
if mode == 'leave' then
  redis.call('lrem', KEYS[4], 0, ARGV[1])
  redis.call('zrem', KEYS[5], ARGV[1])
  redis.call('hdel', wake_key, ARGV[1])
  local count = redis.call('hget', KEYS[1], ARGV[1])
  local direct = count and ARGV[3] and redis.call('hget', KEYS[1], '__grant__') == ARGV[3]
  if direct and tonumber(count) > 1 then
    -- granted directly to this wait, and counted more than once since (not expected: a
    -- waiting thread or task holds nothing): give back the grant's hold alone
    redis.call('hdel', KEYS[1], '__grant__')
    return redis.call('hincrby', KEYS[1], ARGV[1], -1)
  end
  if count ~= '0' and not direct then
    return -3
  end
elseif mode == 'force' then
  if redis.call('exists', KEYS[1]) == 0 then
    return -1
  end
else
  -- One HGET answers the usual case (the owner's count); the rarer ones need one more call.
  local count = redis.call('hget', KEYS[1], ARGV[1])
  if not count then
    return redis.call('exists', KEYS[1]) == 0 and -1 or -2
  end
  if ARGV[6] and ARGV[6] ~= '' and redis.call('hget', KEYS[1], '__fence__') ~= ARGV[6] then
    return -2
  end
  if mode == 'one' and tonumber(count) > 1 then
    return redis.call('hincrby', KEYS[1], ARGV[1], -1)
  end
end
if done_ms then
  redis.call('set', KEYS[6], '1', 'px', done_ms)
end
if hold_ms then
  redis.call('hset', KEYS[1], ARGV[1], 1)
  redis.call('hdel', KEYS[1], '__chain__')  -- kept, not running: no look-ahead chain (handoff.lua)
  redis.call('pexpire', KEYS[1], hold_ms)
  return 0
end
redis.call('del', KEYS[1])
-- Hand the lock to the first waiter whose place is still kept (the clock is read only
-- when someone is in line).
local head = redis.call('lpop', KEYS[4])
if head then
  local t = redis.call('time')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  while head do
    local keep = tonumber(redis.call('zscore', KEYS[5], head) or '0')
    redis.call('zrem', KEYS[5], head)
    local wake = redis.call('hget', wake_key, head)
    local sub, nonce, lease
    if wake then
      sub, nonce, lease = string.match(wake, '^([^:]+):([^:]+):(%d+)$')
    end
    if keep >= now then
      local token = redis.call('incr', KEYS[3])
      if sub then
        -- a direct grant: taken for the waiter (count 1), which is told alone
        grant_ms = math.min(grant_ms, tonumber(lease))
        local wait = string.match(nonce, '^(.*)%.%d+$')
        redis.call('hset', KEYS[1], head, 1, '__fence__', token, '__grant__', sub .. ':' .. wait)
        redis.call('pexpire', KEYS[1], grant_ms)
        redis.call('hdel', wake_key, head)
        redis.call('publish', KEYS[2] .. ':' .. sub, token .. ':' .. nonce)
        return 0
      end
      if wake then
        redis.call('hdel', wake_key, head)
      end
      redis.call('hset', KEYS[1], head, 0, '__fence__', token)  -- count 0: granted, not yet taken
      redis.call('pexpire', KEYS[1], grant_ms)
      redis.call('publish', KEYS[2], head)
      return 0
    end
    if wake then
      redis.call('hdel', wake_key, head)
    end
    head = redis.call('lpop', KEYS[4])
  end
end
redis.call('publish', KEYS[2], '1')
return 0
