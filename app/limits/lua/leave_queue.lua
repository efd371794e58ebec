-- ARGV: request id, wake channel, tenant.
if redis.call('ZREM', KEYS[QUEUE], ARGV[1]) == 1 then wake_waiters(ARGV[2], ARGV[3]) end
redis.call('ZREM', KEYS[QUEUE_SEEN], ARGV[1])
return 0
