-- A credit entry, counted exactly once in any order. ARGV: delta, version (the entry's place in the
-- tenant's ledger), how long a notice for a tenant not loaded is remembered (ms). Meta's `version`: every
-- entry up to it is counted; CREDITS: those above it counted already, because they arrived before an
-- earlier one.
local UNSEEN = KEYS[6]
local version = tonumber(ARGV[2])
if redis.call('EXISTS', META) == 0 or num('prepaid') == 0 then
  -- Not loaded, or it just became prepaid (its balance is the database's to say): leave the version, so
  -- a load whose snapshot predates this entry is refused and reads again.
  redis.call('DEL', META, CREDITS)
  local newest = math.max(version, tonumber(redis.call('GET', UNSEEN) or '0'))
  redis.call('SET', UNSEEN, newest, 'PX', ARGV[3])
  return 0
end
if version <= num('version') then return 0 end
if redis.call('SISMEMBER', CREDITS, ARGV[2]) == 1 then return 0 end
redis.call('HINCRBY', META, 'balance', tonumber(ARGV[1]))
redis.call('SADD', CREDITS, ARGV[2])
local counted = num('version')
while redis.call('SREM', CREDITS, string.format('%d', counted + 1)) == 1 do counted = counted + 1 end
redis.call('HSET', META, 'version', counted)
return 1
