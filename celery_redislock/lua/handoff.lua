-- handoff(keys=[lock, channel, fence, parked, messages, done, dispatched, waiters, claims, wake,
--               queue_list?, registry?, chain?, next_done?],
--         args=[owner, mode, lease_ms, done_ms, next_id, next_raw, next_entry, keep_ms, reach,
--   lists, tasks, token?, grant_ms?, run_on?, by?]) -> {code, message?, task id?, token or 1?}
-- A task's release: the lock goes to the first parked task, else the first waiter in line, else
-- the next queued task (look-ahead), else nobody (concepts.md, "Parking and hand-over"). Keys
-- as park.lua's, release.lua's; done: the owner's done marker. Look-ahead (next_id not ""):
-- queue_list holds next_id's message next_raw; registry: the sweeper's; chain: the list's chain
-- (hash "lock" -> the lock served ahead); next_done: next_id's marker.
-- owner: the releasing task id; mode: "one" one hold, "all" every hold, "unstarted" only a
-- hand-over to it (count 0), "unrun" parked.lua's unrun, "dead" its dead_run_on (owner: a dead
-- process's tag) then as a lapsed lease's release; lease_ms: the next task's; done_ms: the
-- marker's lifetime (0: none); next_entry: next_raw as a parked envelope; keep_ms: the parking
-- lifetime; reach: how far from the read end to look for next_raw; lists, tasks: where a parked
-- envelope may be pushed (envelope.lua); token: only the holding with this fencing token;
-- grant_ms: release.lua's; run_on: the releasing process's tag ("<node>:<pid>"; "": none) when
-- it may run the task handed the lock itself (lists "" then); by: the dead process "all" is for.
-- Replies: {n} holds left (n > 0), or -1 lease expired, -2 another owner's or holding's, -3 not
-- handed to it ("unstarted"); {0} released; {0, message, task id, token} handed over: check and
-- send the message (envelope tag "<placeholder>h<token>"); {0, nil, task id} handed over, its
-- envelope pushed back; {0, nil, task id, 1} handed to the look-ahead's task, moved. Numbers
-- are checked before any write: no parked task is popped and handed nothing.
local lease = ms_arg(ARGV[3], 'lease')
local done_ms = ms_arg(ARGV[4], 'done marker lifetime', 0)
local pulled = ARGV[5] and ARGV[5] ~= ''
local keep_ms = pulled and ms_arg(ARGV[8], 'parking lifetime')
local reach = pulled and whole_arg(ARGV[9], 'look-ahead reach', 1, 2147483647)
local grant_ms = grant_lease(ARGV[13])
local run_on = ARGV[14] ~= nil and ARGV[14] ~= '' and ARGV[14]
-- One read of the lock's few fields answers what follows (its owner's count, its token).
local fields = redis.call('hgetall', KEYS[1])
local count, fence
for i = 1, #fields, 2 do
  if fields[i] == ARGV[1] then
    count = fields[i + 1]
  elseif fields[i] == '__fence__' then
    fence = fields[i + 1]
  end
end
if ARGV[2] == 'unstarted' and count ~= '0' then return {-3} end
if ARGV[2] == 'all' and held_by_another(KEYS[1], ARGV[15]) then return {-2} end
if ARGV[2] == 'unrun' then return unrun(KEYS[1], KEYS[7], ARGV[1], count, fence, ARGV[12]) end
local dead = ARGV[2] == 'dead' and dead_run_on(KEYS[1], KEYS[4], KEYS[5], KEYS[7], ARGV[1])
if ARGV[2] == 'dead' and not dead then return {-2} elseif dead then fields = {} end
local exists = #fields > 0
if exists and not count then  -- another owner's: this run's lease ran out
  if ARGV[2] == 'one' then ran_on_over(KEYS[5], KEYS[7], ARGV[1]) end
  return {-2}
end
if exists and ARGV[12] and ARGV[12] ~= '' and fence ~= ARGV[12] then
  return {-2}  -- a later holding of this owner (another copy of the run): a late retry leaves it
end
local code = exists and 0 or -1
if exists and ARGV[2] == 'one' and tonumber(count) > 1 then
  return {redis.call('hincrby', KEYS[1], ARGV[1], -1)}
end
run_over(KEYS[6], done_ms, KEYS[5], KEYS[7], ARGV[1])
redis.call('del', KEYS[1])
local message, next_id, token = serve_parked(KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[7], lease,
  KEYS[1], ARGV[10] or '', ARGV[11] or '', run_on)
if next_id then return {code, message, next_id, token} end
if grant_first(KEYS[1], KEYS[2], KEYS[3], KEYS[8], KEYS[9], KEYS[10], grant_ms, false) then
  return {code}
end
local chain = KEYS[13] and redis.call('hget', KEYS[13], 'lock')  -- look-ahead: one lock per list
if chain and chain ~= KEYS[1] and redis.pcall('hget', chain, '__chain__') == KEYS[11] then
  -- another lock's chain goes on in this list: this one is not served ahead
elseif pulled and redis.call('exists', KEYS[14]) == 0
    and list_pcall(KEYS[11], 'lpos', ARGV[6], 'RANK', -1, 'MAXLEN', reach) ~= false
    and list_pcall(KEYS[11], 'lrem', -1, ARGV[6]) == 1 then
  redis.call('hset', KEYS[13], 'lock', KEYS[1])
  redis.call('pexpire', KEYS[13], lease)
  local token = hand_to(KEYS[1], KEYS[3], KEYS[7], ARGV[5], lease, run_on)
  redis.call('hset', KEYS[1], '__chain__', KEYS[11])
  redis.call('hset', KEYS[5], ARGV[5], ARGV[7])  -- the sweeper's copy, as for a parked task
  for _, key in ipairs({KEYS[5], KEYS[7]}) do  -- kept as long as parked records, at least
    if redis.call('pttl', key) < keep_ms then redis.call('pexpire', key, keep_ms) end
  end
  redis.call('zadd', KEYS[12], math.floor(now_ms() / 1000), KEYS[1])
  if run_on then  -- as a parked task's hand-over: the worker checks it, and runs or sends it
    return {code, ARGV[7], ARGV[5], token}
  end
  local queue_list, envelope = pushed_envelope(ARGV[7], token)
  list_call(queue_list, 'rpush', envelope)
  return {code, false, ARGV[5], 1}
elseif chain == KEYS[1] then
  redis.call('del', KEYS[13])  -- this lock's chain ends: the next busy lock may start one
end
redis.call('publish', KEYS[2], '1')
return {code}
