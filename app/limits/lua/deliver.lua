-- ARGV: request id, window. Like LimiterState.deliver: only a held lease is marked; it keeps its expiry.
local id, window = ARGV[1], int_arg(2, 1, MAX_LIMIT_VALUE)
local expiry = redis.call('ZSCORE', KEYS[LEASES], id)
if expiry then
  redis.call('SADD', KEYS[DELIVERING], id)
  keep_alive(math.max(window, tonumber(expiry) - now_ms()))
end
return 0
