-- Prepended to handoff.lua and sweep.lua (see _scripts.PRELUDES): a lock handed to the first
-- parked task (docs/concepts.md, "Parking and hand-over").
-- pop_parked(parked, messages) -> task id, message: the first parked task whose message is
--                                 still kept (popped; ids without one are dropped); nil: none
-- hand_to(lock, fence, dispatched, task_id, lease) -> token: the lock written for task_id,
--   count 0 (handed over, not started: its own acquire takes it up) with a fresh token and
--   `lease`; the hand-over's time recorded in dispatched (task id -> ms) for the sweeper
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
local function hand_to(lock, fence, dispatched, task_id, lease)
  redis.call('hset', dispatched, task_id, now_ms())
  local token = redis.call('incr', fence)
  redis.call('hset', lock, task_id, 0, '__fence__', token)
  redis.call('pexpire', lock, lease)
  return token
end
