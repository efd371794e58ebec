-- Hold an amount for a request. ARGV: request id, amount, ttl ms, day key, month key.
-- Returns {admitted, reason, prepaid, balance, reserved, spent_day, spent_month, limit_day, hard_day,
-- limit_month, hard_month} ({0, 'not_loaded'} for a tenant that must be loaded first).
if redis.call('EXISTS', META) == 0 then return {0, 'not_loaded'} end
local id, amount, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
expire_holds(now)
roll(ARGV[4], ARGV[5])
local previous = tonumber(redis.call('HGET', HOLDS_N, id) or '0')
local held = num('reserved') - previous
if num('prepaid') == 1 and num('balance') - held - amount < 0 then
  local v = view(); return {0, 'credit', unpack(v)}
end
local periods = {{'day', 'spent_day'}, {'month', 'spent_month'}}
for i = 1, 2 do
  local limit = redis.call('HGET', META, 'limit_' .. periods[i][1])
  local hard = num('hard_' .. periods[i][1]) == 1
  if limit and hard and tonumber(limit) - num(periods[i][2]) - held - amount < 0 then
    local v = view(); return {0, periods[i][1], unpack(v)}
  end
end
redis.call('ZADD', HOLDS, now + ttl, id)
redis.call('HSET', HOLDS_N, id, amount)
redis.call('HSET', META, 'reserved', held + amount)
local keep = ttl + 60000
for i = 2, 3 do
  if redis.call('PTTL', KEYS[i]) < keep then redis.call('PEXPIRE', KEYS[i], keep) end
end
local v = view(); return {1, '', unpack(v)}
