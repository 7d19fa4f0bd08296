-- The worker's safety net for parked tasks (run every few seconds per lock with parked tasks).
-- Hands a lock whose holder vanished without releasing (lease expired) to the next parked
-- task, and re-publishes a handed-over task whose message never started it (the releasing
-- worker died before publishing, or the message was lost). A handed-over envelope still
-- waiting in its queue list (busy workers) is not sent again: its lease is renewed.
-- KEYS[1..7]  as handoff.lua: lock, channel, fence, parked queue, parked messages,
--             (unused done marker slot), dispatched
-- KEYS[8]     optional: the registry (sorted set of lock keys) to drop this lock from when
--             nothing is parked or dispatched any more (in the same step: a task parking
--             meanwhile cannot be dropped with it)
-- ARGV[1]     lease in milliseconds for a task the lock is handed to
-- ARGV[2]     milliseconds after which a published hand-over counts as lost
-- ARGV[3]     how many messages from a queue list's read end to look for a pushed envelope in
-- returns     {0}                     nothing to do, tasks still parked
--             {-1}                    nothing parked or dispatched any more: forget this lock
--             {1, message, task id, tag}  check this message and send it now: a parked
--                                     signature, or a parked broker envelope (back to the read
--                                     end of its queue list, with delivery tag
--                                     "<placeholder>h<tag>": tag "<token>" for a hand-over, as
--                                     handoff.lua's, or "<token>s<ms>" for a re-send at <ms>, the
--                                     time the dispatched hash records, so that the next pass
--                                     recognises either while it waits there)
local lease = ms_arg(ARGV[1], 'lease')
local stale_ms = ms_arg(ARGV[2], 'hand-over staleness')
local reach = whole_arg(ARGV[3] or '1000', 'queue reach', 1, 2147483647)
local now = redis.call('time')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
-- The worker checks what it sends (whoever may write the lock keys may have written it):
-- not pushed from here (the sweeper is no hot path).
local function send(message, task_id, tag)
  return {1, message, task_id, tag}
end
if redis.call('exists', KEYS[1]) == 0 then
  while true do
    local next_id = redis.call('lpop', KEYS[4])
    if not next_id then
      break
    end
    local message = redis.call('hget', KEYS[5], next_id)
    if message then
      redis.call('hset', KEYS[7], next_id, now_ms)
      local token = redis.call('incr', KEYS[3])
      redis.call('hset', KEYS[1], next_id, 0, '__fence__', token)
      redis.call('pexpire', KEYS[1], lease)
      return send(message, next_id, token)
    end
  end
end
-- Whether the envelope pushed for this hand-over (tag "<placeholder>h<token>") or re-sent
-- at <sent> (tag "<placeholder>h<token>s<sent>") is still waiting in its queue list: then it
-- is not lost, only not fetched yet. Looked for within `reach` of the read end, where it was
-- pushed (LPOS MAXLEN: a lost one costs no scan of a long backlog; one pushed back farther
-- meanwhile is sent again, and the task's hold absorbs the extra copy).
local function still_queued(message, token, sent)
  if string.sub(message, 1, 1) ~= 'E' then
    return false
  end
  for _, tag in ipairs({token, token .. 's' .. sent}) do
    local queue_list, pushed = pushed_envelope(message, tag)
    -- pcall: a lock user without LPOS (or read access to the queue) just sends it again
    local found = queue_list and redis.pcall('lpos', queue_list, pushed, 'RANK', -1, 'MAXLEN', reach)
    if type(found) == 'number' then
      return true
    end
  end
  return false
end
local dispatched = redis.call('hgetall', KEYS[7])
for i = 1, #dispatched, 2 do
  local task_id = dispatched[i]
  if redis.call('hget', KEYS[1], task_id) == '0' then
    if now_ms - tonumber(dispatched[i + 1]) > stale_ms then
      local message = redis.call('hget', KEYS[5], task_id)
      if message then  -- (its record gone: nothing to send; the hand-over's lease runs out)
        redis.call('pexpire', KEYS[1], lease)  -- the hand-over's lease, renewed either way
        local token = redis.call('hget', KEYS[1], '__fence__') or '0'
        if not still_queued(message, token, dispatched[i + 1]) then
          redis.call('hset', KEYS[7], task_id, now_ms)  -- the time a re-sent copy's tag names
          return send(message, task_id, token .. 's' .. now_ms)
        end
      end
    end
  else
    redis.call('hdel', KEYS[7], task_id)
  end
end
if redis.call('llen', KEYS[4]) == 0 and redis.call('hlen', KEYS[7]) == 0 then
  if KEYS[8] then
    redis.call('zrem', KEYS[8], KEYS[1])
  end
  return {-1}
end
return {0}
