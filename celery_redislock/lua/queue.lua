-- queue(keys=[queue list], args=[command, ...]) -> the reply of command (lrange, lrem or rpush)
-- on that queue list (envelope.lua's list_call: a list in another database of this server is
-- named "<list>\r<db>\r<own>"): the worker's own reads and pushes of a queue list of a Redis
-- broker in another database than the locks' (celery/queuelists.py).
local command = ARGV[1]
if command ~= 'lrange' and command ~= 'lrem' and command ~= 'rpush' then
  return redis.error_reply('ERR queue: not a queue list command: ' .. tostring(command))
end
return list_call(KEYS[1], command, unpack(ARGV, 2))
