-- A task's acquire in "requeue" mode: take the lock, or park the task behind its holder.
-- A parked task's message is kept here; the holder's release hands the lock to the first
-- parked task and returns its message for the releasing worker to publish at once.
-- KEYS[1]  lock hash
-- KEYS[2]  fence counter
-- KEYS[3]  "done" marker of this task id
-- KEYS[4]  parked queue: list of task ids, oldest first
-- KEYS[5]  parked messages: hash task id -> message (kept until that task finishes)
-- KEYS[6]  dispatched: hash task id -> ms its hand-over was published (see handoff.lua)
-- KEYS[7]  optional: the sweeper's registry (sorted set of lock keys with parked tasks),
--          entered only when the task is parked (single Redis: the key is in another slot)
-- ARGV[1]  task id (the owner)
-- ARGV[2]  lease in milliseconds (a whole number from 1 to the longest duration: args.lua)
-- ARGV[3]  the task's message, to publish again when the lock is handed to it
-- ARGV[4]  lifetime of the parked structures in milliseconds
-- ARGV[5]  optional: "behind" parks only behind another owner's hold and never takes the lock
--          (the worker's main process, before a pool process gets the task)
-- The message is a Celery signature (JSON, published again by whoever hands the lock over)
-- or a broker envelope ("E<list>\n<tag placeholder>\n<envelope>", pushed back to the head
-- of its queue list by handoff.lua itself).
-- returns  {1, token, 1}           taken (or a hand-over to it taken up)
--          {3, pttl}               this task id holds it already (another delivery of the run)
--          {0, pttl}               parked (or already parked) behind the holder
--          {-1, 0}                 this task id already finished
--          {2, 0}                  "behind": the lock is free, or this task id holds it
local lease = ms_arg(ARGV[2], 'lease')
local keep_for = ms_arg(ARGV[4], 'parking lifetime')
if redis.call('exists', KEYS[3]) == 1 then
  return {-1, 0}
end
if ARGV[5] == 'behind' and (redis.call('exists', KEYS[1]) == 0 or redis.call('hexists', KEYS[1], ARGV[1]) == 1) then
  return {2, 0}
end
if redis.call('exists', KEYS[1]) == 0 then
  local token = redis.call('incr', KEYS[2])
  redis.call('hset', KEYS[1], ARGV[1], 1, '__fence__', token)
  redis.call('pexpire', KEYS[1], lease)
  return {1, token, 1}
end
local held = redis.call('hget', KEYS[1], ARGV[1])
if held and held ~= '0' then
  return {3, redis.call('pttl', KEYS[1])}  -- another delivery of this run holds it
end
if held then  -- handed to this task (count 0): taken up
  local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  if redis.call('pttl', KEYS[1]) < lease then
    redis.call('pexpire', KEYS[1], lease)
  end
  return {1, tonumber(redis.call('hget', KEYS[1], '__fence__')), count}
end
-- Queue it unless it is queued already (a second copy of the same task parking).
if redis.call('hsetnx', KEYS[5], ARGV[1], ARGV[3]) == 1 or redis.call('hdel', KEYS[6], ARGV[1]) == 1 then
  redis.call('hset', KEYS[5], ARGV[1], ARGV[3])
  redis.call('rpush', KEYS[4], ARGV[1])
end
if KEYS[7] then
  redis.call('zadd', KEYS[7], redis.call('time')[1], KEYS[1])
end
redis.call('pexpire', KEYS[4], keep_for)
redis.call('pexpire', KEYS[5], keep_for)
redis.call('pexpire', KEYS[6], keep_for)
return {0, redis.call('pttl', KEYS[1])}
