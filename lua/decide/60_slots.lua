-- SLOTS of the zones with concurrency: a sorted set per key, whose members
-- are the requests holding a slot, and whose scores are the instants (µs
-- since 2025) their leases end. A lease that has ended is a slot free
-- again, whatever became of the instance that took it; the set itself
-- expires with its last lease.
--
--   id     the request's member, unique among instances
--   limit  how many slots the set has
--   lease  how long a slot is held at most
--   soft   '1' when a full set does not refuse the request (dry run)
--
-- take takes a slot of every set when the buckets and counters allow,
-- or none when a set that is not soft is full; a soft set that is full
-- is left as it is.

if ARGV[2] ~= '0' then
	-- countSlots counts the live leases of the slot sets, trimming the
	-- ended ones, and refuses the request when a set that is not soft is
	-- full and the buckets and counters allowed it.
	function countSlots()
		sused = {}
		if take then
			for j = 1, ns do
				local x, key = as + 1 + 3 * (j - 1), KEYS[ks + j - 1]
				local trimmed = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
				if type(trimmed) == 'table' then
					reply[2] = reply[2] + 1
					redis.call('DEL', key)
				end
				local used = redis.call('ZCARD', key)
				if allowed and used >= tonumber(ARGV[x]) and ARGV[x + 2] ~= '1' then
					allowed, reply[r + 1] = false, 0
				end
				sused[j] = used
			end
		end
	end

	-- takeSlots takes the slots, and replies.
	function takeSlots()
		for j = 1, ns do
			local x, key = as + 1 + 3 * (j - 1), KEYS[ks + j - 1]
			local limit = tonumber(ARGV[x])
			local used, held = sused[j] or 0, 0
			if take and allowed and used < limit then
				redis.call('ZADD', key, now + math.floor(ARGV[x + 1] / 1000), ARGV[as])
				used, held = used + 1, 1
				-- The set lives as long as its longest lease.
				local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
				redis.call('PEXPIRE', key, math.max(math.ceil((tonumber(last[2]) - now) / 1000), 1))
			end
			reply[sr + 2 * j - 1], reply[sr + 2 * j] = held, math.max(limit - used, 0)
		end
	end

	-- The slots of one request go back.
	function release()
		local ns, id, n = tonumber(ARGV[a + 1]), ARGV[a + 2], 0
		for j = 0, ns - 1 do
			n = n + redis.call('ZREM', KEYS[k + j], id)
		end
		a, k = a + 3, k + ns
		reply[#reply + 1] = n
	end
end
