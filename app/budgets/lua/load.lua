-- Take a snapshot, only when the tenant is not loaded. ARGV[1]: how many credit entries the snapshot saw;
-- the rest: the meta hash's fields and values. 1: loaded (now, or already); 0: a credit notice newer than
-- the snapshot came while the tenant was not loaded (KEYS[6]), so the snapshot is stale and nothing is taken.
if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
if tonumber(redis.call('GET', KEYS[6]) or '0') > tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[5], KEYS[6])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
