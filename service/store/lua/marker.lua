-- marker.lua: a replica's mark in the Redis process it talks to. Each replica loads its own
-- copy (its id in a comment line appended below, so its SHA is its own) and runs it, keyed
-- by the meta hash (a cluster routes it to the namespace's node), on every (re)connection.
-- Redis keeps scripts in memory only: a restart (from any copy of the data, or empty), a
-- failover to a replica or another server at the address does not know the mark
-- (NOSCRIPT), and the replica merges what it holds (service/store/redis.py).
-- KEYS[1] meta hash (routing only)
-- returns 1
return 1
