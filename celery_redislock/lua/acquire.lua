-- Take or re-enter a reentrant lock in one round trip; fair to queued waiters.
-- KEYS[1]  lock hash: field <owner> = hold count, field "__fence__" = fencing token of this holding
-- KEYS[2]  fence counter: last token handed out for this lock name (never expires)
-- KEYS[3]  waiters: list of owners waiting, first come first served
-- KEYS[4]  claims: sorted set owner -> ms (server time) until which its place in line is kept
-- KEYS[5]  optional: "done" marker of the owner (a finished task id); if it exists, take nothing
--          (with ARGV[8], only when there are six keys)
-- KEYS[#]  with ARGV[8], the last key: the sender's void record for this owner (a number)
-- ARGV[1]  owner id (never "__fence__")
-- ARGV[2]  lease in milliseconds (a whole number from 1 to the longest duration: args.lua)
-- ARGV[3]  optional: join the line when contended, keeping the place this many ms past the
--          holder's lease (a blocked acquire passes it; a single try does not; "" = no)
-- ARGV[4]  optional: "new-token" hands out a new token on re-entry too (the quorum lock's
--          fresh attempt: the highest token of its majority must be newer than any
--          token written back before it; the hold's stored token is left as it is)
-- ARGV[5]  optional: "task" (a task run's attempt: one run per owner, never re-entered):
--          a hold of this owner that was already taken (count >= 1: another delivery of the
--          same run) is left exactly as it is and reported {2, pttl}; a hand-over to it
--          (count 0) is taken up. "adopt": take over the hold of the owner ARGV[7] (a run
--          that kept the lock across self.retry()) as this owner's one hold, if it is there
-- ARGV[6]  optional: the waiter's wake id "<subscriber>:<wait>.<attempt>" (sent only for
--          the default owner: a thread or task). With ARGV[3], a release may grant it the
--          lock directly (see release.lua); kept with the lease as
--          "<subscriber>:<wait>.<attempt>:<lease>" in KEYS[3]..":wake" (a hash with the
--          same hash tag; its entries go with their places in line, and the hash expires
--          when no waiter has joined for longer than the places are kept). Joining
--          without a wake id drops an old one. A hold of the owner that the client has
--          not counted (a grant) is taken as one hold, not as a re-entry: by a blocked
--          attempt, any; without ARGV[3], the direct grant to the wait ARGV[6] names.
-- ARGV[8]  optional: this attempt's number (1, 2, ... per sender and owner). A sender that
--          gave up on attempts it had no reply to writes the last number it sent to its
--          void record (the last key): an attempt whose number is not above it arrived late
--          and takes nothing ({0, 0}: not taken; its sender no longer waits for it)
-- returns  {1, token, hold_count}  taken (hold_count 1, fresh token) or re-entered (same token;
--                                  the lease is extended to ARGV[2] if shorter, never shortened).
--                                  A waiter granted the lock at a release (count 0) takes it here.
--          {0, ms}                 not taken: ms = the holder's remaining lease (-1: no expiry),
--                                  or how long to wait for the first in line to take a free lock
--          {-1, 0}                 KEYS[5] exists: this owner already finished its work here
--          {2, ms}                 "task": this owner holds it already (ms: its lease left)
local lease = ms_arg(ARGV[2], 'lease')
local margin = ARGV[3] and ARGV[3] ~= '' and ms_arg(ARGV[3], 'line margin', 0)
local void = ARGV[8] and ARGV[8] ~= '' and KEYS[#KEYS]
if void and (tonumber(redis.call('get', void)) or 0) >= (tonumber(ARGV[8]) or 0) then
  return {0, 0}
end
local done = KEYS[5] ~= void and KEYS[5]
if done and redis.call('exists', done) == 1 then
  return {-1, 0}
end
if ARGV[5] == 'task' then
  local count = redis.call('hget', KEYS[1], ARGV[1])
  if count and count ~= '0' then
    return {2, redis.call('pttl', KEYS[1])}
  end
elseif ARGV[5] == 'adopt' and ARGV[7] and ARGV[7] ~= ARGV[1] and redis.call('hexists', KEYS[1], ARGV[7]) == 1 then
  redis.call('hdel', KEYS[1], ARGV[7])
  redis.call('hset', KEYS[1], ARGV[1], 1)
  redis.call('pexpire', KEYS[1], lease)
  return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), 1}
end
local function now_ms()
  local t = redis.call('time')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
local function join_line(wait_ms)
  if margin then
    local keep_ms = math.max(wait_ms, 0) + margin
    if redis.call('zadd', KEYS[4], now_ms() + keep_ms, ARGV[1]) == 1 then
      redis.call('rpush', KEYS[3], ARGV[1])
    end
    local wake = KEYS[3] .. ':wake'
    if ARGV[6] and ARGV[6] ~= '' then
      redis.call('hset', wake, ARGV[1], ARGV[6] .. ':' .. lease)
      if redis.call('pttl', wake) < keep_ms then
        redis.call('pexpire', wake, keep_ms)
      end
    else
      redis.call('hdel', wake, ARGV[1])
    end
  end
end
if redis.call('exists', KEYS[1]) == 0 then
  if redis.call('llen', KEYS[3]) > 0 then
    local now = now_ms()
    local head = redis.call('lindex', KEYS[3], 0)
    while head do  -- drop waiters that stopped refreshing their place (gone or dead)
      local keep = tonumber(redis.call('zscore', KEYS[4], head) or '0')
      if keep >= now then
        break
      end
      redis.call('lpop', KEYS[3])
      redis.call('zrem', KEYS[4], head)
      redis.call('hdel', KEYS[3] .. ':wake', head)
      head = redis.call('lindex', KEYS[3], 0)
    end
    if head and head ~= ARGV[1] then
      join_line(0)
      local keep = tonumber(redis.call('zscore', KEYS[4], head))
      return {0, math.min(keep - now, 1000)}
    end
    if head then
      redis.call('lpop', KEYS[3])
      redis.call('zrem', KEYS[4], head)
      redis.call('hdel', KEYS[3] .. ':wake', head)
    end
  end
  local token = redis.call('incr', KEYS[2])
  redis.call('hset', KEYS[1], ARGV[1], 1, '__fence__', token)
  redis.call('pexpire', KEYS[1], lease)
  return {1, token, 1}
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
  if ARGV[6] and ARGV[6] ~= '' then
    -- A grant to a wait of this owner that the client has not counted: take it as one
    -- hold, not as a re-entry. A blocked attempt (ARGV[3]) takes any hold of its owner so
    -- (its owner is the calling thread or task, which cannot hold a lock it waits for);
    -- any other attempt only a direct grant to the wait ARGV[6] names (a wait whose
    -- leave failed: "__grant__" is "<subscriber>:<wait>").
    local wait = string.match(ARGV[6], '^(.*)%.%d+$')
    if (ARGV[3] and ARGV[3] ~= '') or (wait and redis.call('hget', KEYS[1], '__grant__') == wait) then
      redis.call('hdel', KEYS[1], '__grant__')
      local count = tonumber(redis.call('hget', KEYS[1], ARGV[1]))
      if count == 0 then  -- granted the usual way (count 0): taken up
        count = 1
        redis.call('hset', KEYS[1], ARGV[1], 1)
      end
      if redis.call('pttl', KEYS[1]) < lease then
        redis.call('pexpire', KEYS[1], lease)
      end
      return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), count}
    end
  end
  local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  if redis.call('pttl', KEYS[1]) < lease then
    -- re-entering never shortens the lease
    redis.call('pexpire', KEYS[1], lease)
  end
  if ARGV[4] == 'new-token' then
    return {1, redis.call('incr', KEYS[2]), count}
  end
  return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), count}
end
local pttl = redis.call('pttl', KEYS[1])
join_line(pttl)
return {0, pttl}
