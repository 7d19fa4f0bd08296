-- A task's release: give the hold back and hand the lock straight to the first parked task.
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- KEYS[3]  fence counter
-- KEYS[4]  parked queue (list of task ids)
-- KEYS[5]  parked messages (hash task id -> message)
-- KEYS[6]  "done" marker of the releasing task id
-- KEYS[7]  dispatched: hash task id -> ms time its message was last published (for the sweeper)
-- KEYS[8]  waiters of blocking acquires (list), served when no task is parked
-- KEYS[9]  their claims (sorted set owner -> ms its place is kept until)
-- ARGV[1]  releasing task id (the owner)
-- ARGV[2]  mode: "one" one hold; "all" every hold (the worker releasing for a dead process);
--          "unstarted" only a lock handed to this task and not started (hold count 0): the
--          worker dropping a revoked or expired message
-- ARGV[3]  lease in milliseconds for the task the lock is handed to
-- ARGV[4]  lifetime of the done marker in milliseconds (0: do not mark done)
-- Optional look-ahead (task.py: the releasing task was handed its lock through a queue list,
-- and searched that list for the next queued task of this lock):
-- KEYS[10] the queue list (kombu's Redis transport)
-- KEYS[11] the sweeper's registry (sorted set of lock keys with parked tasks)
-- KEYS[12] the queue list's look-ahead chain (a hash: "lock" -> the lock whose tasks are
--          moved ahead in it; that lock's hash names the list in "__chain__" for as long as
--          it is held by a task it was handed to this way: the chain lasts that long)
-- ARGV[5]  that task's id ('': none found, or the search had not finished)
-- ARGV[6]  its message, exactly as it is in KEYS[10]
-- ARGV[7]  the same as a parked envelope (envelope.lua) with a new tag placeholder
-- ARGV[8]  the parking lifetime in milliseconds (as park.lua's): its parked records keep that
-- ARGV[9]  how many messages from the read end of KEYS[10] to look for it in (LPOS MAXLEN:
--          a message fetched meanwhile costs no scan of a long backlog; a lock user without
--          LPOS looks with LREM alone, which scans the whole list when it is gone)
--          (ARGV[5..9] are "" without look-ahead)
-- ARGV[10] the queue lists a parked envelope may be pushed to from here, one a line (the
--          releasing worker's; an entry names its own list, and whoever may write the lock
--          keys may have written it: see envelope.lua's pushable)
-- ARGV[11] the task names it may be for, one a line (the releasing worker's LockedTasks)
-- ARGV[12] optional: the fencing token of the holding to give back ('': the owner's, whichever):
--          a release retried late leaves a later holding of the same run alone (-2)
-- returns  {n}                     n > 0 holds left (-1 lease expired, -2 another owner holds it,
--                                  -3 "unstarted": this task does not hold it at count 0)
--          {0}                     released; nobody parked: waiters notified
--          {0, message, task id, token}  released and handed over: check the message (a parked
--                                  signature, or an envelope not pushed from here) and send it
--                                  now (an envelope with delivery tag "<placeholder>h<token>")
--          {0, nil, task id}       released and handed over to a parked broker envelope: it is
--                                  back at the head of its queue list already (see park.lua)
--          {0, nil, task id, 1}    released and handed to the look-ahead's queued task: its
--                                  message is moved to the head of its queue list
-- Durations and counts are checked before anything is written (args.lua): a bad one must
-- not fail this script halfway, with a parked task popped and handed nothing.
local lease = ms_arg(ARGV[3], 'lease')
local done_ms = ms_arg(ARGV[4], 'done marker lifetime', 0)
local pulled = ARGV[5] and ARGV[5] ~= ''
local keep_ms = pulled and ms_arg(ARGV[8], 'parking lifetime')
local reach = pulled and whole_arg(ARGV[9], 'look-ahead reach', 1, 2147483647)
if ARGV[2] == 'unstarted' and redis.call('hget', KEYS[1], ARGV[1]) ~= '0' then
  return {-3}
end
local exists = redis.call('exists', KEYS[1]) == 1
if exists and redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return {-2}
end
if exists and ARGV[12] and ARGV[12] ~= '' and redis.call('hget', KEYS[1], '__fence__') ~= ARGV[12] then
  return {-2}  -- a later holding of this owner (another copy of the run): a late retry leaves it
end
local code = 0
if not exists then
  code = -1
elseif ARGV[2] == 'one' then
  local count = tonumber(redis.call('hget', KEYS[1], ARGV[1]))
  if count > 1 then
    return {redis.call('hincrby', KEYS[1], ARGV[1], -1)}
  end
end
-- Find the first parked task whose message is still here.
local next_id, message = nil, nil
while true do
  local candidate = redis.call('lpop', KEYS[4])
  if not candidate then
    break
  end
  message = redis.call('hget', KEYS[5], candidate)
  if message then
    next_id = candidate
    break
  end
end
if done_ms > 0 then
  redis.call('set', KEYS[6], '1', 'px', done_ms)
end
redis.call('hdel', KEYS[5], ARGV[1])
redis.call('hdel', KEYS[7], ARGV[1])
redis.call('del', KEYS[1])
if next_id then
  local now = redis.call('time')
  redis.call('hset', KEYS[7], next_id, now[1] * 1000 + math.floor(now[2] / 1000))
  local token = redis.call('incr', KEYS[3])
  -- hold count 0: handed over, not yet started; the task's own acquire makes it 1
  redis.call('hset', KEYS[1], next_id, 0, '__fence__', token)
  redis.call('pexpire', KEYS[1], lease)
  if string.sub(message, 1, 1) == 'E' and pushable(message, KEYS[1], next_id, ARGV[10] or '', ARGV[11] or '') then
    local queue_list, envelope = pushed_envelope(message, token)
    redis.call('rpush', queue_list, envelope)  -- next for BRPOP
    return {code, false, next_id}
  end
  return {code, message, next_id, token}
end
-- Nobody parked: hand the lock to the first blocked waiter still in line, or wake waiters.
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
while true do
  local head = redis.call('lpop', KEYS[8])
  if not head then
    break
  end
  local keep = tonumber(redis.call('zscore', KEYS[9], head) or '0')
  redis.call('zrem', KEYS[9], head)
  redis.call('hdel', KEYS[8] .. ':wake', head)  -- a lock's waiter's wake id (release.lua)
  if keep >= now then
    local token = redis.call('incr', KEYS[3])
    redis.call('hset', KEYS[1], head, 0, '__fence__', token)
    redis.call('pexpire', KEYS[1], 2000)
    redis.call('publish', KEYS[2], head)
    return {code}
  end
end
-- Nobody parked or waiting: hand the lock to the next queued task of this lock (look-ahead),
-- moving its message from where it waits in its queue to the head, if it is still there and
-- its task id has not finished. Parked, it would be handed the lock the same way. Only one
-- lock per queue list is served this way at a time (its "chain"): the tasks of one busy lock
-- overtake the others; several busy locks would take every worker slot in turn and
-- starve the rest of the queue.
local function queued_within(list, message, within)
  local found = redis.pcall('lpos', list, message, 'RANK', -1, 'MAXLEN', within)
  if type(found) == 'table' and found.err then
    return true  -- no LPOS for this user: LREM alone finds out
  end
  return found ~= false  -- then LREM, from the same end, stops where LPOS found it
end
local chain = KEYS[12] and redis.call('hget', KEYS[12], 'lock')
local other = false
if chain and chain ~= KEYS[1] then
  -- pcall: the value names a key; whatever it holds, this release must not fail halfway
  other = redis.pcall('hget', chain, '__chain__') == KEYS[10]
end
if other then
  -- another lock's chain goes on in this list: this one is not served ahead
elseif pulled and redis.call('exists', KEYS[1] .. ':done:' .. ARGV[5]) == 0
    and queued_within(KEYS[10], ARGV[6], reach)
    and redis.call('lrem', KEYS[10], -1, ARGV[6]) == 1 then
  redis.call('hset', KEYS[12], 'lock', KEYS[1])
  redis.call('pexpire', KEYS[12], lease)
  local token = redis.call('incr', KEYS[3])
  redis.call('hset', KEYS[1], ARGV[5], 0, '__fence__', token, '__chain__', KEYS[10])
  redis.call('pexpire', KEYS[1], lease)
  redis.call('hset', KEYS[5], ARGV[5], ARGV[7])  -- the sweeper's copy, as for a parked task
  redis.call('hset', KEYS[7], ARGV[5], now)
  for _, key in ipairs({KEYS[5], KEYS[7]}) do
    if redis.call('pttl', key) < keep_ms then
      redis.call('pexpire', key, keep_ms)
    end
  end
  redis.call('zadd', KEYS[11], t[1], KEYS[1])
  local queue_list, envelope = pushed_envelope(ARGV[7], token)
  redis.call('rpush', queue_list, envelope)
  return {code, false, ARGV[5], 1}
elseif chain == KEYS[1] then
  redis.call('del', KEYS[12])  -- this lock's chain ends: the next busy lock may start one
end
redis.call('publish', KEYS[2], '1')
return {code}
