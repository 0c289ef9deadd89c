-- lease.lua: take or renew a lease that one replica at a time holds (the active detector's).
-- KEYS[1] lease key
-- ARGV[1] this replica's id   ARGV[2] lease length ms
-- returns 1 when this replica holds the lease for ARGV[2] ms from now, 0 when another does
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
