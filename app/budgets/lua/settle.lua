-- Spend a request's cost and release its hold, once per id. ARGV: request id, cost, day key, month key,
-- settled memory ms.
if redis.call('EXISTS', META) == 0 then return 0 end
local id, cost, memory = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[5])
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', SETTLED, '-inf', now)
if redis.call('ZSCORE', SETTLED, id) then return 0 end
roll(ARGV[3], ARGV[4])
local amount = redis.call('HGET', HOLDS_N, id)
if amount then
  redis.call('HINCRBY', META, 'reserved', -tonumber(amount))
  redis.call('HDEL', HOLDS_N, id)
  redis.call('ZREM', HOLDS, id)
end
if num('prepaid') == 1 then redis.call('HINCRBY', META, 'balance', -cost) end
redis.call('HINCRBY', META, 'spent_day', cost)
redis.call('HINCRBY', META, 'spent_month', cost)
redis.call('ZADD', SETTLED, now + memory, id)
if redis.call('PTTL', SETTLED) < memory then redis.call('PEXPIRE', SETTLED, memory) end
return 1
