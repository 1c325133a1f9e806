-- Sets or removes a key's own limit (an override) and its place in the
-- zone's list of overrides in one step, so that the limit, the list and
-- its count toward max_overrides never disagree, whatever changes of the
-- key run at once (redis_overrides.go).
--
--   KEYS[1]  the zone's list: a sorted set of keys as stored, scored by
--            when their limit ends (ms since 1970; +inf for never)
--   KEYS[2]  the key's own limit (`<token ns>:<burst>:<rate>`), when it
--            shares KEYS[1]'s cluster slot; without it (on Redis Cluster,
--            where the two are in different slots) the caller changes the
--            limit itself, apart, holding the key's lock
--   ARGV[1]  'set' or 'del'
--   ARGV[2]  the key as stored
--   ARGV[3]  now, in ms since 1970: the list's ended limits are dropped
--   set:     ARGV[4] the limit's end (ms since 1970, or '+inf'),
--            ARGV[5] the limit's value, ARGV[6] how long it lasts in ms
--            (0: until removed), ARGV[7] max_overrides
--
-- Returns, for set: 1, or 0 when the key is not listed and the zone has
-- max_overrides overrides already (then nothing changes); for del: 1 when
-- KEYS[2] was there and is removed, else 0.

local list, member = KEYS[1], ARGV[2]
if ARGV[1] == 'del' then
	local n = 0
	if KEYS[2] then
		n = redis.call('DEL', KEYS[2])
	end
	redis.call('ZREM', list, member)
	return n
end

redis.call('ZREMRANGEBYSCORE', list, '-inf', '(' .. ARGV[3])
if not redis.call('ZSCORE', list, member) and redis.call('ZCARD', list) >= tonumber(ARGV[7]) then
	return 0
end
redis.call('ZADD', list, ARGV[4], member)
if KEYS[2] then
	local ttl = tonumber(ARGV[6])
	if ttl > 0 then
		redis.call('SET', KEYS[2], ARGV[5], 'PX', ttl)
	else
		redis.call('SET', KEYS[2], ARGV[5])
	end
end
return 1
