-- Prepended to handoff.lua and sweep.lua (see _scripts.PRELUDES): a parked broker envelope
-- is "E<queue list>\n<tag placeholder>\n<envelope JSON>" (task.envelope_entry). Whoever may
-- write the lock keys may have written it: a script pushes one only in the form pushable()
-- checks, and the workers verify its signature when they fetch it (signing.py).
-- envelope_parts(message)          -> queue list, placeholder, envelope JSON (nil: malformed)
-- pushed_envelope(message, tag)    -> queue list, the envelope as pushed: delivery tag
--                                     "<placeholder>h<tag>" (nil: malformed)
-- pushable(message, lock key, task id, lists, tasks) -> whether a hand-over may push it
-- list_pcall(spec, command, ...)   -> redis.pcall(command, <list>, ...) on the queue list spec
--                                     names; list_call: the same, an error raised
-- A queue list is named "<list>" (in the locks' database) or "<list>\r<db>\r<own>": list <list>
-- in database <db> of this server (a Redis broker in another database than the locks', found
-- so by the worker: celery/queuelists.py), <own> the locks' database, selected again after.
local function envelope_parts(message)
  local first = string.find(message, '\n', 1, true)
  local second = first and string.find(message, '\n', first + 1, true)
  if not second then
    return nil
  end
  return string.sub(message, 2, first - 1), string.sub(message, first + 1, second - 1),
    string.sub(message, second + 1)
end
local function pushed_envelope(message, tag)
  local queue_list, placeholder, envelope = envelope_parts(message)
  local at = queue_list and placeholder ~= '' and string.find(envelope, placeholder, 1, true)
  if not at then
    return nil
  end
  return queue_list,
    string.sub(envelope, 1, at - 1) .. placeholder .. 'h' .. tag .. string.sub(envelope, at + #placeholder)
end
-- Whether name is one line of names (lines joined by "\n").
local function listed(name, names)
  return type(name) == 'string' and name ~= '' and not string.find(name, '\n', 1, true)
    and string.find('\n' .. names .. '\n', '\n' .. name .. '\n', 1, true) ~= nil
end
-- Pushed by a hand-over only if it goes to one of `lists` (the releasing worker's queue lists),
-- names a task of `tasks` (its app's LockedTasks: their workers check the signature), and is
-- the entry of this task id under this lock with its placeholder once, as its delivery tag
-- (so that every worker knows it for a hand-over's). Anything else goes back to the worker.
local function pushable(message, lock_key, task_id, lists, tasks)
  local queue_list, placeholder, envelope = envelope_parts(message)
  if not queue_list or not listed(queue_list, lists)
      or not string.match(placeholder, '^rltag' .. string.rep('%x', 16) .. '$') then
    return false
  end
  local at = string.find(envelope, placeholder, 1, true)
  if not at or string.find(envelope, placeholder, at + 1, true) then
    return false
  end
  local ok, decoded = pcall(cjson.decode, envelope)
  if not ok or type(decoded) ~= 'table' or type(decoded.properties) ~= 'table'
      or type(decoded.headers) ~= 'table' then
    return false
  end
  local headers = decoded.headers
  local parked = headers.redislock_parked
  -- task_id: the run's owner, "<id>" or "<id>~n<k>r<k>" (a retry's or replacement's run)
  local id = headers.id
  local run = type(id) == 'string' and (id == task_id or string.sub(task_id, 1, #id + 1) == id .. '~')
  return decoded.properties.delivery_tag == placeholder and run
    and listed(headers.task, tasks) and type(parked) == 'table' and parked.lock == lock_key
    and parked.list == queue_list
end
local function list_place(spec)
  local name, db, own = string.match(spec, '^(.*)\r(%d+)\r(%d+)$')
  return name or spec, db, own
end
local function list_pcall(spec, command, ...)
  local name, db, own = list_place(spec)
  if not db then
    return redis.pcall(command, name, ...)
  end
  local moved = redis.pcall('select', db)
  if type(moved) == 'table' and moved.err then
    return moved
  end
  local reply = redis.pcall(command, name, ...)
  redis.call('select', own)
  return reply
end
local function list_call(spec, command, ...)
  local reply = list_pcall(spec, command, ...)
  if type(reply) == 'table' and reply.err then
    error(reply)
  end
  return reply
end
