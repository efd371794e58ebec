-- Shared by every budget script: the keys, Redis's clock, holds' expiry and the period roll.
local META, HOLDS, HOLDS_N, SETTLED, CREDITS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function num(field) return tonumber(redis.call('HGET', META, field) or '0') end
local function expire_holds(now)
  local lapsed = redis.call('ZRANGEBYSCORE', HOLDS, '-inf', now)
  for i = 1, #lapsed do
    local amount = tonumber(redis.call('HGET', HOLDS_N, lapsed[i]) or '0')
    redis.call('HINCRBY', META, 'reserved', -amount)
    redis.call('HDEL', HOLDS_N, lapsed[i])
  end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', HOLDS, '-inf', now) end
end
-- A later period key (they sort by time) starts that period's spend at zero.
local function roll(day, month)
  if day > (redis.call('HGET', META, 'day') or '') then
    redis.call('HSET', META, 'day', day, 'spent_day', 0)
  end
  if month > (redis.call('HGET', META, 'month') or '') then
    redis.call('HSET', META, 'month', month, 'spent_month', 0)
  end
end
local function view()
  local f = redis.call('HMGET', META, 'prepaid', 'balance', 'reserved', 'spent_day', 'spent_month',
    'limit_day', 'hard_day', 'limit_month', 'hard_month')
  for i = 1, #f do f[i] = tonumber(f[i] or '-1') end
  return f
end
