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
-- returns  {n}                     n > 0 holds left (-1 lease expired, -2 another owner holds it,
--                                  -3 "unstarted": this task does not hold it at count 0)
--          {0}                     released; nobody parked: waiters notified
--          {0, message, task id}   released and handed over: publish message now
--          {0, nil, task id}       released and handed over to a parked broker envelope: it is
--                                  back at the head of its queue list already (see park.lua)
if ARGV[2] == 'unstarted' and redis.call('hget', KEYS[1], ARGV[1]) ~= '0' then
  return {-3}
end
local exists = redis.call('exists', KEYS[1]) == 1
if exists and redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return {-2}
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
if tonumber(ARGV[4]) > 0 then
  redis.call('set', KEYS[6], '1', 'px', ARGV[4])
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
  redis.call('pexpire', KEYS[1], ARGV[3])
  if string.sub(message, 1, 1) == 'E' then  -- a broker envelope (envelope.lua)
    local queue_list, envelope = pushed_envelope(message, token)
    redis.call('rpush', queue_list, envelope)  -- next for BRPOP
    return {code, false, next_id}
  end
  return {code, message, next_id}
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
redis.call('publish', KEYS[2], '1')
return {code}
