-- Push a hold's expiry back. ARGV: request id, ttl ms.
if redis.call('ZSCORE', HOLDS, ARGV[1]) then
  redis.call('ZADD', HOLDS, now_ms() + tonumber(ARGV[2]), ARGV[1])
  local keep = tonumber(ARGV[2]) + 60000
  for i = 2, 3 do
    if redis.call('PTTL', KEYS[i]) < keep then redis.call('PEXPIRE', KEYS[i], keep) end
  end
end
return 0
