-- ARGV: window, queue stale (ms). Returns {requests, reset_requests, tokens, reset_tokens, leases, queued}.
-- Read-only, unlike admit's expiry pass: it counts what that pass would keep, so a peek writes nothing.
local window, stale = int_arg(1, 1, MAX_LIMIT_VALUE), int_arg(2, 1, MAX_LIMIT_VALUE)
local now = now_ms()
local horizon = now - window

local function reset(key)
  local last = redis.call('ZRANGE', KEYS[key], -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return math.max(0, tonumber(last[2]) + window - now)
end

local tokens = tonumber(redis.call('GET', KEYS[TOKENS_TOTAL]) or '0')
local gone = redis.call('ZRANGEBYSCORE', KEYS[TOKENS_AT], '-inf', horizon)
for i = 1, #gone, 1000 do
  local amounts = redis.call('HMGET', KEYS[TOKENS_N], unpack(gone, i, math.min(i + 999, #gone)))
  for j = 1, #amounts do tokens = tokens - (tonumber(amounts[j]) or 0) end
end
return {redis.call('ZCOUNT', KEYS[REQUESTS], '(' .. horizon, '+inf'), reset(REQUESTS), tokens,
        reset(TOKENS_AT), weight_of(redis.call('ZRANGEBYSCORE', KEYS[LEASES], '(' .. now, '+inf')),
        redis.call('ZCOUNT', KEYS[QUEUE_SEEN], '(' .. (now - stale), '+inf')}
