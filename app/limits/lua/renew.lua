-- ARGV: request id, lease TTL, window. Like LimiterState.renew: no expiry pass, only a held lease moves.
local id, lease_ttl, window = ARGV[1], int_arg(2, 1, MAX_LIMIT_VALUE), int_arg(3, 1, MAX_LIMIT_VALUE)
if redis.call('ZSCORE', KEYS[LEASES], id) then
  redis.call('ZADD', KEYS[LEASES], now_ms() + lease_ttl, id)
  keep_alive(window + lease_ttl)
end
return 0
