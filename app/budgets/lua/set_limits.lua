-- New spend limits. ARGV: limit_day, hard_day, limit_month, hard_month (-1: none).
if redis.call('EXISTS', META) == 0 then return 0 end
local names = {'limit_day', 'hard_day', 'limit_month', 'hard_month'}
for i = 1, 4 do
  if tonumber(ARGV[i]) < 0 then
    redis.call('HDEL', META, names[i])
  else
    redis.call('HSET', META, names[i], ARGV[i])
  end
end
return 1
