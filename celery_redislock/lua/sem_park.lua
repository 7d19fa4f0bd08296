-- sem_park(keys=[holders, fence, done, parked, messages, dispatched, waiters, claims, wake,
--                limits, registry],
--          args=[owner, lease_ms, message, keep_ms, behind?, limit, permit_prefix])
--   -> {1, token, count} | {3, ms} | {0, ms} | {-1, 0} | {2, 0}
-- park.lua for a limited task (docs/concepts.md, "Parking and hand-over"): take a permit
-- (sem.lua's take_permit), or park the task until a release hands it one. Keys as park.lua's
-- (holders in the lock's place: the semaphore's identity key, which the registry and parked
-- envelopes name); limits: parked task id -> the limit it parked with (a hand-over to it
-- waits until fewer are held), kept as long as the parked records. ARGV as park.lua's, then the task's limit and
-- the permit key prefix. Parked tasks come first (take_permit). "behind": park only when every
-- permit is held (by others) or other tasks are parked first.
-- Last call wins: as park.lua's, with keys latest and debounce registry after registry, and
-- args task_id, sent_us, quiet_ms, max_ms after the permit key prefix.
-- Replies as park.lua's: {1, token, count} taken (or a hand-over to it taken up); {3, ms}
-- this task id holds a permit (another delivery of the run); {0, ms} parked (ms: the wait
-- for a change); {-1, 0} it finished; {2, 0} "behind": a permit is free, or this task id's.
local lease = ms_arg(ARGV[2], 'lease')
local keep_for = ms_arg(ARGV[4], 'parking lifetime')
local limit = sem_limit(ARGV[6])
local prefix = ARGV[7]
if redis.call('exists', KEYS[3]) == 1 then
  return {-1, 0}
end
local held = redis.call('hget', prefix .. ARGV[1], ARGV[1])
if ARGV[5] == 'behind' and (held or (live_permits(KEYS[1], prefix) < limit
    and (parked_head(KEYS[4], KEYS[5], KEYS[10], prefix) or ARGV[1]) == ARGV[1])) then
  return {2, 0}
end
if held and held ~= '0' then
  return {3, redis.call('pttl', prefix .. ARGV[1])}  -- another delivery of this run holds it
end
local latest, evicted, first, sent = KEYS[12], false, nil, nil
if latest then
  local gate
  gate, evicted, first, sent = latest_enter(latest, KEYS[13], ARGV[1], ARGV[8], ARGV[9], ARGV[10],
    ARGV[11], ARGV[3], keep_for,
    function(owner) return redis.call('hexists', prefix .. owner, owner) == 1 end,
    function(owner)
      redis.call('lrem', KEYS[4], 0, owner)
      redis.call('hdel', KEYS[5], owner)
      redis.call('hdel', KEYS[6], owner)
      redis.call('hdel', KEYS[10], owner)
    end)
  if gate then
    return gate
  end
end
local reply = take_permit(KEYS[1], KEYS[2], KEYS[7], KEYS[8], KEYS[9], ARGV[1], lease, limit, prefix,
  nil, {KEYS[4], KEYS[5], KEYS[10]})
if reply[1] == 1 then
  if latest then
    latest_after(latest, ARGV[1], ARGV[8], sent, first, true, keep_for)
    return latest_reply(latest, reply, ARGV[8], evicted)
  end
  return reply  -- taken, or handed to this task (count 0) and taken up
end
if latest then
  latest_after(latest, ARGV[1], ARGV[8], sent, first, false, keep_for)
end
enqueue(KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[3])
redis.call('hset', KEYS[10], ARGV[1], limit)
redis.call('zadd', KEYS[11], math.floor(now_ms() / 1000), KEYS[1])
for _, key in ipairs({KEYS[4], KEYS[5], KEYS[6], KEYS[10]}) do
  redis.call('pexpire', key, keep_for)
end
if latest then
  return latest_reply(latest, reply, ARGV[8], evicted)
end
return reply
