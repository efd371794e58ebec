-- A credit entry, counted once: ARGV: delta, version (entries counted).
if redis.call('EXISTS', META) == 0 or tonumber(ARGV[2]) <= num('version') then return 0 end
if num('prepaid') == 0 then redis.call('DEL', META); return 0 end
redis.call('HINCRBY', META, 'balance', tonumber(ARGV[1]))
redis.call('HSET', META, 'version', ARGV[2])
return 1
