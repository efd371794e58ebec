-- ARGV: request id, used tokens, wake channel, tenant. HSET and INCRBY keep the keys' expiry.
local id, used = ARGV[1], int_arg(2, 0, MAX_TOKENS_VALUE)
local reserved = tonumber(redis.call('HGET', KEYS[TOKENS_N], id))
redis.call('ZREM', KEYS[LEASES], id)
redis.call('HDEL', KEYS[LEASES_N], id)
redis.call('SREM', KEYS[DELIVERING], id)
if reserved then  -- still in the window: the minute's total reflects what was really used
  redis.call('HSET', KEYS[TOKENS_N], id, used)
  redis.call('INCRBY', KEYS[TOKENS_TOTAL], used - reserved)
end
wake_waiters(ARGV[3], ARGV[4])
return 0
