-- A credit entry, counted exactly once in any order. ARGV: delta, version (the entry's place in the
-- tenant's ledger). Meta's `version`: every entry up to it is counted; CREDITS: those above it counted
-- already, because they arrived before an earlier one.
local version = tonumber(ARGV[2])
if redis.call('EXISTS', META) == 0 or version <= num('version') then return 0 end
if redis.call('SISMEMBER', CREDITS, ARGV[2]) == 1 then return 0 end
if num('prepaid') == 0 then redis.call('DEL', META, CREDITS); return 0 end
redis.call('HINCRBY', META, 'balance', tonumber(ARGV[1]))
redis.call('SADD', CREDITS, ARGV[2])
local counted = num('version')
while redis.call('SREM', CREDITS, string.format('%d', counted + 1)) == 1 do counted = counted + 1 end
redis.call('HSET', META, 'version', counted)
return 1
