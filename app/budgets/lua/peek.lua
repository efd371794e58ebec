-- Read-only: the live holds, spend of the current periods. ARGV: day key, month key.
if redis.call('EXISTS', META) == 0 then return {0} end
local live = redis.call('ZRANGEBYSCORE', HOLDS, '(' .. now_ms(), '+inf')
local reserved = 0
for i = 1, #live do reserved = reserved + tonumber(redis.call('HGET', HOLDS_N, live[i]) or '0') end
local v = view()
v[3] = reserved
if (redis.call('HGET', META, 'day') or '') ~= ARGV[1] then v[4] = 0 end
if (redis.call('HGET', META, 'month') or '') ~= ARGV[2] then v[5] = 0 end
return {1, unpack(v)}
