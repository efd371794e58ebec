-- Take a snapshot, only when the tenant is not loaded. ARGV: the meta hash's fields and values.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[5])
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
