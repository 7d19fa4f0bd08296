-- Prepended to the scripts that hand a lock or permit to a parked task (see _scripts.PRELUDES;
-- docs/concepts.md, "Parking and hand-over"), after envelope.lua.
-- pop_parked(parked, messages) -> task id, message: the first parked task whose message is
--                                 still kept (popped; ids without one are dropped); nil: none
-- hand_to(lock, fence, dispatched, task_id, lease, inline?) -> token: the hold written for
--   task_id, count 0 (handed over, not started: its own acquire takes it up) with a fresh token
--   and `lease`; the hand-over's time recorded in dispatched (task id -> ms) for the sweeper.
--   With `inline` (a mutex's run-on: the releasing worker process runs the task itself) the
--   hold is written taken (count 1: that process records it without a round trip) and the
--   record as "i<ms>/<lease>/<inline>" (inline: that process's tag, "<node>:<pid>"): no broker
--   message of the task exists, so its record stays until its run's end (run_over), until that
--   process gives it back (unrun), or until its worker finds it dead (dead_run_on).
--   lock: the lock's key, or a function of the task id writing the hold (a semaphore's
--   permit) and returning its key.
-- serve_parked(lock, fence, parked, messages, dispatched, lease, lock_key, lists, tasks, inline?)
--   -> nil (nobody parked) | false, task id (its envelope pushed back to its queue list) |
--      message, task id, token (the worker checks and sends the message)
--   The first parked task, handed the hold (hand_to); lock_key: the key parked envelopes
--   name (envelope.lua's pushable).
-- enqueue(parked, messages, dispatched, task_id, message): park task_id with its message, at
--   the back of the line, unless it is parked already (a second copy of the same task parking;
--   one handed over and not started, in dispatched, parks again)
-- run_over(done, done_ms, messages, dispatched, task_id): the end of task_id's run: its done
--   marker set for done_ms (0: none), its parked and hand-over records gone
-- unrun(lock, dispatched, task_id, count, fence, token) -> {0} | {-2}: a run-on hand-over
--   (count 1, token) the releasing process does not run after all made a usual one (count 0, a
--   plain hand-over record), to be sent; {-2}: not that hand-over (count, fence: the lock's now)
-- ran_on_over(messages, dispatched, task_id): the end of a run-on run (dispatched "i"/"x")
--   whose release found the lock another owner's (its lease ran out): its records go all the
--   same, so that the sweeper does not park it again for a second run
-- resend_stale(hold_of, messages, dispatched, lease, stale_ms, reach, now, parked, grace_ms, own)
--   -> nil | message, task id, tag: a handed-over task not started stale_ms after its
--   hand-over whose envelope no longer waits in its queue list, to send again (its hold's
--   lease renewed; tag "<token>s<now>"). hold_of(task id): the key its hold is in. A task id
--   whose hold was taken up (or is gone) leaves dispatched, but for a run-on task ("i<ms>"):
--   while its hold is there it stays; once its hold is gone without its run's end (its process
--   died, its lease ran out) it is marked "x<now>", and grace_ms later, if its run's end has
--   still not removed it, it goes back to the head of the parked line (the lock's next holder
--   is then it: a late release of a run that did end, retried in the background, has had
--   that long to say so). grace_ms is at least twice the lease the record names. own: the
--   locks' database (a string; nil: unknown), the only one an envelope's queue list in another
--   database may name to be looked for (envelope.lua's list_pcall; any other: sent again). A run-on
--   record whose run left its done marker (it ended keeping its hold) just goes.
-- A run's done marker beside a mutex's hash, as LockKeys.done names it (the Python side
-- passes the releasing run's own as a key; these are other runs' found in the records).
local function done_key(lock, task_id)
  return lock .. ':done:' .. task_id
end
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
local function unrun(lock, dispatched, task_id, count, fence, token)
  if count ~= '1' or fence ~= token then
    return {-2}
  end
  redis.call('hset', lock, task_id, 0)
  redis.call('hset', dispatched, task_id, now_ms())
  return {0}
end
local function ran_on_over(messages, dispatched, task_id)
  local kind = string.sub(redis.call('hget', dispatched, task_id) or '', 1, 1)
  if kind == 'i' or kind == 'x' then
    run_over('', 0, messages, dispatched, task_id)
  end
end
local function hand_to(lock, fence, dispatched, task_id, lease, inline)
  local at = now_ms()
  redis.call('hset', dispatched, task_id, inline and ('i' .. at .. '/' .. lease .. '/' .. inline) or at)
  local token = redis.call('incr', fence)
  if type(lock) == 'function' then
    lock(task_id, token, lease)
  else
    redis.call('hset', lock, task_id, inline and 1 or 0, '__fence__', token)
    held_by(lock, inline)
    redis.call('pexpire', lock, lease)
  end
  return token
end
local function serve_parked(lock, fence, parked, messages, dispatched, lease, lock_key, lists, tasks,
    inline)
  local next_id, message
  repeat
    next_id, message = pop_parked(parked, messages)
    if not next_id then
      return nil
    end
    -- Run on, the task is taken here, not by its own acquire: that acquire's check of its
    -- done marker is made here (a parked copy of a run that finished is dropped).
    if inline and type(lock) ~= 'function' and redis.call('exists', done_key(lock, next_id)) == 1 then
      redis.call('hdel', messages, next_id)
      redis.call('hdel', dispatched, next_id)
      next_id = nil
    end
  until next_id
  local token = hand_to(lock, fence, dispatched, next_id, lease, inline)
  if string.sub(message, 1, 1) == 'E' and pushable(message, lock_key, next_id, lists, tasks) then
    local queue_list, envelope = pushed_envelope(message, token)
    local pushed = list_pcall(queue_list, 'rpush', envelope)  -- next for BRPOP
    if type(pushed) == 'number' then
      return false, next_id
    end  -- (not pushed: the worker sends it)
  end
  return message, next_id, token
end
-- Whether the envelope pushed for a hand-over (tag "<token>") or re-sent at <sent> (tag
-- "<token>s<sent>") still waits within `reach` of its queue list's read end (LPOS MAXLEN;
-- pcall: a lock user without LPOS just sends it again).
local function still_queued(message, token, sent, reach, own)
  if string.sub(message, 1, 1) ~= 'E' then
    return false
  end
  for _, tag in ipairs({token, token .. 's' .. sent}) do
    local queue_list, pushed = pushed_envelope(message, tag)
    local _, db, list_own = list_place(queue_list or '')
    local found = queue_list and (not db or list_own == own)
      and list_pcall(queue_list, 'lpos', pushed, 'RANK', -1, 'MAXLEN', reach)
    if type(found) == 'number' then
      return true
    end
  end
  return false
end
-- A run-on record, "i<ms>/<lease>/<tag>" (or "x<ms>/<lease>/<tag>": its hold first seen gone at
-- <ms>): kind, ms, lease, the tag of the process running it on; nil for a usual "<ms>".
local function run_on_record(value)
  local kind, ms, lease, tag = string.match(value, '^([ix])(%d+)/?(%d*)/?(.*)$')
  return kind, tonumber(ms), tonumber(lease) or 0, tag
end
-- The run-on records of a dead worker process (tag): each task parked again, first in line (or
-- its records dropped if its run left its done marker), and the lock deleted if one of them held
-- it and "__by__" does not name another process. True if the lock was so freed.
local function dead_run_on(lock, parked, messages, dispatched, tag)
  local handed, freed = redis.call('hgetall', dispatched), false
  for i = 1, #handed, 2 do
    local task_id = handed[i]
    local kind, _, _, who = run_on_record(handed[i + 1])
    if kind and who == tag then
      -- its hold, if the dead process took it (another delivery of the run, in another
      -- process, may hold it now: "__by__" says whose it is)
      if redis.call('hexists', lock, task_id) == 1 and not held_by_another(lock, tag) then
        redis.call('del', lock)
        freed = true
      end
      if redis.call('exists', done_key(lock, task_id)) == 1 then
        run_over('', 0, messages, dispatched, task_id)
      else
        redis.call('hdel', dispatched, task_id)
        if redis.call('hexists', messages, task_id) == 1 then redis.call('lpush', parked, task_id) end
      end
    end
  end
  return freed
end
local function resend_stale(hold_of, messages, dispatched, lease, stale_ms, reach, now, parked,
    grace_ms, own)
  local handed = redis.call('hgetall', dispatched)
  for i = 1, #handed, 2 do
    local task_id = handed[i]
    local hold = hold_of(task_id)
    local count = redis.call('hget', hold, task_id)
    local kind, since, run_lease, tag = run_on_record(handed[i + 1])
    if kind and count and count ~= '0' then
      if kind == 'x' then  -- (taken again: another copy of the run holds it)
        redis.call('hset', dispatched, task_id, 'i' .. now .. '/' .. run_lease .. '/' .. tag)
      end
    elseif kind and not count then
      if redis.call('exists', done_key(hold, task_id)) == 1 then
        run_over('', 0, messages, dispatched, task_id)  -- its run ended (a kept hold ran out)
      elseif kind == 'i' then
        redis.call('hset', dispatched, task_id, 'x' .. now .. '/' .. run_lease .. '/' .. tag)
      elseif now - since > math.max(grace_ms, 2 * run_lease) then
        redis.call('hdel', dispatched, task_id)
        if redis.call('hexists', messages, task_id) == 1 then
          redis.call('lpush', parked, task_id)  -- first in line again
        end
      end
    elseif count == '0' then
      local sent = kind and since or tonumber(handed[i + 1])
      if not sent or now - sent > stale_ms then
        local message = redis.call('hget', messages, task_id)
        if message then  -- (its record gone: nothing to send; the hand-over's lease runs out)
          redis.call('pexpire', hold, lease)  -- the hand-over's lease, renewed either way
          local token = redis.call('hget', hold, '__fence__') or '0'
          if not still_queued(message, token, handed[i + 1], reach, own) then
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
