-- sweep(keys=[lock, channel, fence, parked, messages, unused, dispatched, registry?],
--       args=[lease_ms, stale_ms, reach?]) -> {0} | {-1} | {1, message, task id, tag}
-- The worker's safety net for parked tasks, run every few seconds per lock with parked tasks
-- (docs/concepts.md, "The sweeper"): hands a lock whose holder vanished (lease expired) to
-- the first parked task, and sends again a handed-over task not started stale_ms after its
-- hand-over, unless its envelope still waits in its queue list (its lease is renewed then).
-- Keys as handoff.lua's (unused: its done marker's slot); registry: the sweeper's sorted set,
-- this lock dropped from it when nothing is parked or dispatched any more (in the same step:
-- a task parking meanwhile is not dropped with it). lease_ms: the lease of a task the lock
-- is handed to; stale_ms: when a hand-over counts as lost; reach: how many messages from a
-- queue list's read end to look for a pushed envelope in (default 1000).
-- Replies: {0} nothing to do, tasks still parked; {-1} nothing parked or dispatched: forget
-- this lock; {1, message, task id, tag} check this message and send it now (a parked
-- envelope with delivery tag "<placeholder>h<tag>": tag "<token>" for a hand-over, as
-- handoff.lua's, or "<token>s<ms>" for a re-send at <ms>, the time in dispatched).
local lease = ms_arg(ARGV[1], 'lease')
local stale_ms = ms_arg(ARGV[2], 'hand-over staleness')
local reach = whole_arg(ARGV[3] or '1000', 'queue reach', 1, 2147483647)
local now = now_ms()
if redis.call('exists', KEYS[1]) == 0 then
  local next_id, message = pop_parked(KEYS[4], KEYS[5])
  if next_id then
    return {1, message, next_id, hand_to(KEYS[1], KEYS[3], KEYS[7], next_id, lease)}
  end
end
-- Whether the envelope pushed for this hand-over (tag "<token>") or re-sent at <sent> (tag
-- "<token>s<sent>") still waits within `reach` of its queue list's read end (LPOS MAXLEN;
-- pcall: a lock user without LPOS just sends it again).
local function still_queued(message, token, sent)
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
local dispatched = redis.call('hgetall', KEYS[7])
for i = 1, #dispatched, 2 do
  local task_id = dispatched[i]
  if redis.call('hget', KEYS[1], task_id) == '0' then
    if now - tonumber(dispatched[i + 1]) > stale_ms then
      local message = redis.call('hget', KEYS[5], task_id)
      if message then  -- (its record gone: nothing to send; the hand-over's lease runs out)
        redis.call('pexpire', KEYS[1], lease)  -- the hand-over's lease, renewed either way
        local token = redis.call('hget', KEYS[1], '__fence__') or '0'
        if not still_queued(message, token, dispatched[i + 1]) then
          redis.call('hset', KEYS[7], task_id, now)  -- the time a re-sent copy's tag names
          return {1, message, task_id, token .. 's' .. now}
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
