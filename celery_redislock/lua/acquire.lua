-- acquire(keys=[lock, fence, waiters, claims, wake, done?, void?],
--         args=[owner, lease_ms, margin_ms?, new_token?, mode?, wake_id?, adopted?, attempt?, by?])
--   -> {1, token, count} | {0, ms} | {-1, 0} | {2, ms}
-- Take or re-enter a reentrant lock, fair to the waiters in line (docs/concepts.md,
-- "Wake-on-release"). lock: hash owner -> hold count, "__fence__" -> token; fence: the token
-- counter; waiters, claims, wake: the line (list), its places (owner -> ms kept until), its
-- wake ids (owner -> "<subscriber>:<wait>.<attempt>:<lease>"); done: the owner's done marker
-- (it exists: take nothing); void: with attempt, the sender's void record (the last key).
-- owner: never "__fence__"; margin_ms: join the line when contended, keeping the place this
-- long past the holder's lease ("": a single try); new_token "new-token": re-entry hands out a
-- new token too; mode "task" (one hold per run: an existing hold is left alone, {2, ms}) or
-- "adopt" (take over the hold of `adopted` as one hold) or "first" (a blocked acquire's first
-- attempt: a hold of the owner is a re-entry, never a grant to it); wake_id: a direct grant;
-- attempt: this attempt's number, refused ({0, 0}: not taken) unless above the void record;
-- by: a task run's process ("<node>:<pid>"), kept in "__by__" when it takes the lock.
-- Replies: {1, token, count} taken or re-entered; {0, ms} not taken (the holder's lease left,
-- -1: none, or the wait for the first in line); {-1, 0} done; {2, ms} "task" holds it.
local lease = ms_arg(ARGV[2], 'lease')
local margin = ARGV[3] and ARGV[3] ~= '' and ms_arg(ARGV[3], 'line margin', 0)
local void = ARGV[8] and ARGV[8] ~= '' and KEYS[#KEYS]
if void and (tonumber(redis.call('get', void)) or 0) >= (tonumber(ARGV[8]) or 0) then
  return {0, 0}
end
local done = KEYS[6] ~= void and KEYS[6]
if done and redis.call('exists', done) == 1 then
  return {-1, 0}
end
local present = nil  -- a task's: whether the lock exists, read once (take_or_enter)
if ARGV[5] == 'task' then
  present = redis.call('exists', KEYS[1]) == 1
  local count = present and redis.call('hget', KEYS[1], ARGV[1])
  if count and count ~= '0' then
    return {2, redis.call('pttl', KEYS[1])}
  end
elseif ARGV[5] == 'adopt' and ARGV[7] and ARGV[7] ~= ARGV[1] and redis.call('hexists', KEYS[1], ARGV[7]) == 1 then
  redis.call('hdel', KEYS[1], ARGV[7])
  redis.call('hset', KEYS[1], ARGV[1], 1)
  held_by(KEYS[1], ARGV[9])
  redis.call('pexpire', KEYS[1], lease)
  return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), 1}
end
local function join_line(wait_ms)
  if margin then
    enter_line(KEYS[3], KEYS[4], KEYS[5], ARGV[1], math.max(wait_ms, 0) + margin, ARGV[6], lease)
  end
end
-- A grant to a wait of this owner (docs/concepts.md, "Direct grants") is one hold, not a
-- re-entry: for a blocked attempt after its first, any hold of the owner; else a direct grant
-- to this wait.
local wait = ARGV[6] and string.match(ARGV[6], '^(.*)%.%d+$')
if ARGV[6] and ARGV[6] ~= '' and redis.call('hexists', KEYS[1], ARGV[1]) == 1 and ((margin
    and ARGV[5] ~= 'first') or (wait and redis.call('hget', KEYS[1], '__grant__') == wait)) then
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
local reply = take_or_enter(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], lease,
  ARGV[4] == 'new-token', present)
if not reply then
  reply = {0, redis.call('pttl', KEYS[1])}
  join_line(reply[2])
elseif reply[1] == 0 then
  join_line(0)
elseif ARGV[5] == 'task' then
  held_by(KEYS[1], ARGV[9])
end
return reply
