-- ARGV: request id, rpm, tpm, max_concurrent (-1: unlimited), lease TTL, reserve, queued (0/1),
-- window, queue stale, concurrency retry, queued retry (all ms), max waiters (-1: unbounded), wake channel,
-- tenant, sequences (the lease's weight), delivering retry (ms). Returns {admitted, reason, retry_after, requests in window,
-- reset_requests, token total, reset_tokens}.
local id = ARGV[1]
local rpm, tpm = int_arg(2, -1, MAX_LIMIT_VALUE), int_arg(3, -1, MAX_LIMIT_VALUE)
local max_concurrent = int_arg(4, -1, MAX_LIMIT_VALUE)
local lease_ttl, reserve = int_arg(5, 1, MAX_LIMIT_VALUE), int_arg(6, 0, MAX_TOKENS_VALUE)
local queued = int_arg(7, 0, 1) == 1
local window, stale = int_arg(8, 1, MAX_LIMIT_VALUE), int_arg(9, 1, MAX_LIMIT_VALUE)
local concurrency_retry, queued_retry = int_arg(10, 0, MAX_LIMIT_VALUE), int_arg(11, 0, MAX_LIMIT_VALUE)
local max_waiters = int_arg(12, -1, MAX_LIMIT_VALUE)
local channel, tenant = ARGV[13], ARGV[14]
local sequences = int_arg(15, 1, MAX_LIMIT_VALUE)
local delivering_retry = int_arg(16, 0, MAX_LIMIT_VALUE)
local now = now_ms()

local function reset(key)
  local last = redis.call('ZRANGE', KEYS[key], -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

local function total_tokens()
  return tonumber(redis.call('GET', KEYS[TOKENS_TOTAL]) or '0')
end

local function decide(admitted, reason, retry_after)
  keep_alive(window + lease_ttl)
  return {admitted, reason, math.max(0, retry_after), redis.call('ZCARD', KEYS[REQUESTS]), reset(REQUESTS),
          total_tokens(), reset(TOKENS_AT)}
end

-- LimiterState._token_wait: oldest reservations leave the window first; page through them.
local function token_wait(total, allowed)
  local start = 0
  while true do
    local page = redis.call('ZRANGE', KEYS[TOKENS_AT], start, start + 99, 'WITHSCORES')
    if #page == 0 then return window end
    local ids = {}
    for i = 1, #page, 2 do ids[#ids + 1] = page[i] end
    local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(ids))
    for i = 1, #ids do
      total = total - (tonumber(amounts[i]) or 0)
      if total <= allowed then return math.max(1, tonumber(page[2 * i]) + window - now) end
    end
    start = start + 100
  end
end

-- LimiterState._expire
local horizon = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[REQUESTS], '-inf', horizon)
local gone = redis.call('ZRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
if #gone > 0 then
  local sum = 0
  for i = 1, #gone, 1000 do
    local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(gone, i, math.min(i + 999, #gone)))
    for j = 1, #amounts do sum = sum + (tonumber(amounts[j]) or 0) end
  end
  chunked('HDEL', KEYS[TOKENS_N], gone)
  redis.call('ZREMRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
  redis.call('DECRBY', KEYS[TOKENS_TOTAL], sum)
end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[LEASES], '-inf', now)
if #lapsed > 0 then
  chunked('HDEL', KEYS[LEASES_N], lapsed)
  chunked('SREM', KEYS[DELIVERING], lapsed)
  redis.call('ZREMRANGEBYSCORE', KEYS[LEASES], '-inf', now)
end
local stale_waiters = redis.call('ZRANGEBYSCORE', KEYS[QUEUE_SEEN], '-inf', now - stale)
if #stale_waiters > 0 then
  chunked('ZREM', KEYS[QUEUE], stale_waiters)
  chunked('ZREM', KEYS[QUEUE_SEEN], stale_waiters)
end

-- LimiterState._blocked: the first limit in the way, and when trying again can succeed; nil: it fits.
local function blocked()
  if rpm >= 0 and redis.call('ZCARD', KEYS[REQUESTS]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[REQUESTS], 0, 0, 'WITHSCORES')
    local wait = window  -- rpm = 0: no request will ever leave the window to make room
    if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
    return 'requests', wait
  end
  local total = total_tokens()
  if tpm >= 0 and total + reserve > tpm then
    return 'tokens', token_wait(total, tpm - reserve)
  end
  local held = max_concurrent >= 0 and weight_of(redis.call('ZRANGE', KEYS[LEASES], 0, -1)) or 0
  if max_concurrent >= 0 and held + sequences > max_concurrent then
    local delivering = {}
    for _, lease in ipairs(redis.call('SMEMBERS', KEYS[DELIVERING])) do
      if redis.call('ZSCORE', KEYS[LEASES], lease) then delivering[#delivering + 1] = lease end
    end
    if held - weight_of(delivering) + sequences <= max_concurrent then
      return 'delivering', delivering_retry
    end
    return 'concurrency', concurrency_retry
  end
  return nil, 0
end

if tpm >= 0 and reserve > tpm then
  return decide(0, 'too_large', 0)
end
if max_concurrent >= 0 and sequences > max_concurrent then
  return decide(0, 'too_many_sequences', 0)
end
if queued then
  if not redis.call('ZSCORE', KEYS[QUEUE], id) then
    if max_waiters >= 0 and redis.call('ZCARD', KEYS[QUEUE]) >= max_waiters then
      local reason, wait = blocked()
      if not reason then wait = queued_retry end
      return decide(0, 'queue_full', wait)
    end
    -- Arrival order must be strict even for two arrivals in one ms (a ZSET breaks ties by member).
    local arrival = now
    local tail = redis.call('ZRANGE', KEYS[QUEUE], -1, -1, 'WITHSCORES')
    if #tail > 0 and tonumber(tail[2]) >= arrival then arrival = tonumber(tail[2]) + 1 end
    redis.call('ZADD', KEYS[QUEUE], arrival, id)
  end
  redis.call('ZADD', KEYS[QUEUE_SEEN], now, id)
  if redis.call('ZRANGE', KEYS[QUEUE], 0, 0)[1] ~= id then
    return decide(0, 'queued', queued_retry)
  end
end
local reason, wait = blocked()
if reason then
  return decide(0, reason, wait)
end
redis.call('ZREM', KEYS[QUEUE], id)
redis.call('ZREM', KEYS[QUEUE_SEEN], id)
redis.call('ZADD', KEYS[REQUESTS], now, id)
local previous = redis.call('HGET', KEYS[TOKENS_N], id)
if previous then  -- the same id admitted again: its reservation is replaced, not leaked
  redis.call('DECRBY', KEYS[TOKENS_TOTAL], previous)
end
redis.call('ZADD', KEYS[TOKENS_AT], now, id)
redis.call('HSET', KEYS[TOKENS_N], id, reserve)
redis.call('INCRBY', KEYS[TOKENS_TOTAL], reserve)
redis.call('ZADD', KEYS[LEASES], now + lease_ttl, id)
redis.call('HSET', KEYS[LEASES_N], id, sequences)
if queued then wake_waiters(channel, tenant) end  -- the head went: the next one may fit too
return decide(1, '', 0)
