-- Prepended to the scripts that hand a lock or permit to a parked task (see _scripts.PRELUDES;
-- docs/concepts.md, "Parking and hand-over"), after envelope.lua.
-- pop_parked(parked, messages) -> task id, message: the first parked task whose message is
--                                 still kept (popped; ids without one are dropped); nil: none
-- hand_to(lock, fence, dispatched, task_id, lease) -> token: the hold written for task_id,
--   count 0 (handed over, not started: its own acquire takes it up) with a fresh token and
--   `lease`; the hand-over's time recorded in dispatched (task id -> ms) for the sweeper.
--   lock: the lock's key, or a function of the task id writing the hold (a semaphore's
--   permit) and returning its key.
-- serve_parked(lock, fence, parked, messages, dispatched, lease, lock_key, lists, tasks)
--   -> nil (nobody parked) | false, task id (its envelope pushed back to its queue list) |
--      message, task id, token (the worker checks and sends the message)
--   The first parked task, handed the hold (hand_to); lock_key: the key parked envelopes
--   name (envelope.lua's pushable).
-- enqueue(parked, messages, dispatched, task_id, message): park task_id with its message, at
--   the back of the line, unless it is parked already (a second copy of the same task parking;
--   one handed over and not started, in dispatched, parks again)
-- run_over(done, done_ms, messages, dispatched, task_id): the end of task_id's run: its done
--   marker set for done_ms (0: none), its parked and hand-over records gone
-- resend_stale(hold_of, messages, dispatched, lease, stale_ms, reach, now)
--   -> nil | message, task id, tag: a handed-over task not started stale_ms after its
--   hand-over whose envelope no longer waits in its queue list, to send again (its hold's
--   lease renewed; tag "<token>s<now>"). hold_of(task id): the key its hold is in. A task id
--   whose hold was taken up (or is gone) leaves dispatched.
local function pop_parked(parked, messages)
  while true do
    local task_id = redis.call('lpop', parked)
    if not task_id then
      return nil
    end
    local message = redis.call('hget', messages, task_id)
    if message then
      return task_id, message
    end
  end
end
local function enqueue(parked, messages, dispatched, task_id, message)
  if redis.call('hsetnx', messages, task_id, message) == 1 or redis.call('hdel', dispatched, task_id) == 1 then
    redis.call('hset', messages, task_id, message)
    redis.call('rpush', parked, task_id)
  end
end
local function run_over(done, done_ms, messages, dispatched, task_id)
  if done_ms > 0 then
    redis.call('set', done, '1', 'px', done_ms)
  end
  redis.call('hdel', messages, task_id)
  redis.call('hdel', dispatched, task_id)
end
local function hand_to(lock, fence, dispatched, task_id, lease)
  redis.call('hset', dispatched, task_id, now_ms())
  local token = redis.call('incr', fence)
  if type(lock) == 'function' then
    lock(task_id, token, lease)
  else
    redis.call('hset', lock, task_id, 0, '__fence__', token)
    redis.call('pexpire', lock, lease)
  end
  return token
end
local function serve_parked(lock, fence, parked, messages, dispatched, lease, lock_key, lists, tasks)
  local next_id, message = pop_parked(parked, messages)
  if not next_id then
    return nil
  end
  local token = hand_to(lock, fence, dispatched, next_id, lease)
  if string.sub(message, 1, 1) == 'E' and pushable(message, lock_key, next_id, lists, tasks) then
    local queue_list, envelope = pushed_envelope(message, token)
    redis.call('rpush', queue_list, envelope)  -- next for BRPOP
    return false, next_id
  end
  return message, next_id, token
end
-- Whether the envelope pushed for a hand-over (tag "<token>") or re-sent at <sent> (tag
-- "<token>s<sent>") still waits within `reach` of its queue list's read end (LPOS MAXLEN;
-- pcall: a lock user without LPOS just sends it again).
local function still_queued(message, token, sent, reach)
  if string.sub(message, 1, 1) ~= 'E' then
    return false
  end
  for _, tag in ipairs({token, token .. 's' .. sent}) do
    local queue_list, pushed = pushed_envelope(message, tag)
    local found = queue_list and redis.pcall('lpos', queue_list, pushed, 'RANK', -1, 'MAXLEN', reach)
    if type(found) == 'number' then
      return true
    end
  end
  return false
end
local function resend_stale(hold_of, messages, dispatched, lease, stale_ms, reach, now)
  local handed = redis.call('hgetall', dispatched)
  for i = 1, #handed, 2 do
    local task_id = handed[i]
    local hold = hold_of(task_id)
    if redis.call('hget', hold, task_id) == '0' then
      local sent = tonumber(handed[i + 1])
      if not sent or now - sent > stale_ms then
        local message = redis.call('hget', messages, task_id)
        if message then  -- (its record gone: nothing to send; the hand-over's lease runs out)
          redis.call('pexpire', hold, lease)  -- the hand-over's lease, renewed either way
          local token = redis.call('hget', hold, '__fence__') or '0'
          if not still_queued(message, token, handed[i + 1], reach) then
            redis.call('hset', dispatched, task_id, now)  -- the time a re-sent copy's tag names
            return message, task_id, token .. 's' .. now
          end
        end
      end
    else
      redis.call('hdel', dispatched, task_id)
    end
  end
  return nil
end
