-- Shared by every script. Lua 5.1's unpack() overflows the C stack past ~8000 values: big batches go in
-- chunks. Server time, in ms: the one clock every replica agrees on.
local REQUESTS, TOKENS_AT, TOKENS_N, TOKENS_TOTAL, LEASES, QUEUE, QUEUE_SEEN = 1, 2, 3, 4, 5, 6, 7
local LEASES_N, DELIVERING = 8, 9

-- ARGV[i] as an integer in [lo, hi], or an error reply before the script has written anything.
local function int_arg(i, lo, hi)
  local n = tonumber(ARGV[i])
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then
    error({err = 'INVALID_ARGUMENT_PREFIX: ARGV[' .. i .. '] = ' .. tostring(ARGV[i]) ..
      ' is not an integer in [' .. lo .. ', ' .. hi .. ']'})
  end
  return n
end

-- Wake the tenant's waiters on other replicas, only when it has any.
local function wake_waiters(channel, tenant)
  if redis.call('ZCARD', KEYS[QUEUE]) > 0 then redis.call('PUBLISH', channel, tenant) end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function chunked(cmd, key, ids)
  for i = 1, #ids, 1000 do
    redis.call(cmd, key, unpack(ids, i, math.min(i + 999, #ids)))
  end
end

-- One expiry for every key of the tenant, never shortened (a lease may have been granted a longer TTL).
local function keep_alive(ms)
  for i = 1, #KEYS do
    local left = redis.call('PTTL', KEYS[i])
    if left > ms then ms = left end
  end
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ms) end
end

-- Sequences held by the leases named in ids (a lease without a weight, from before weights, holds one).
local function weight_of(ids)
  local sum = 0
  for i = 1, #ids, 1000 do
    local weights = redis.call('HMGET', KEYS[LEASES_N], unpack(ids, i, math.min(i + 999, #ids)))
    for j = 1, #weights do sum = sum + (tonumber(weights[j]) or 1) end
  end
  return sum
end
