-- COUNTERS. A calendar quota's counter per key and window (a day, a week
-- or a month in a time zone), decided in the same call, all or nothing
-- with the buckets. Lua knows no time zones, so Caddy sends, by its own
-- clock and in the zone's time zone, the window that holds its now,
-- [b1, b2), with the one before, [b0, b1), and the one after, [b2, b3).
-- The script picks the one of the three that holds Redis's clock: the one
-- before when Caddy's clock is ahead, across a boundary Redis's has not
-- reached, the one after when it is behind. So every instance counts in
-- the window of Redis's one clock, whatever its own clock's skew up to a
-- whole window; a clock outside the three is an error (allowed -1),
-- which fail_mode decides. Only boundaries travel, never an instant that
-- decides.
--
-- A counter is a hash {w = its window's end in ms since 1970, n = its
-- count}, expiring at w (PEXPIREAT): a counter of an ended window, or
-- none, is 0. The window is held in the key rather than named by it, so
-- a client has one key whatever the window, and a counter found from an
-- older window than the picked one starts again from 0.
--
-- A counter's key names its zone's quota window (its period and time
-- zone), so that zones of one name with quotas of different periods
-- count apart. Builds before that named it by the zone alone: its
-- untagged key. While a counter's key is absent, what the untagged key
-- counted in the very window picked is its count, which the first write
-- carries over; the untagged key is never written, and expires with its
-- window.
--
--   limit  the most units a window holds
--   cost   the units the request counts (adjust: negative to take off)
--
-- take refuses when a counter lacks cost, and counts cost in every
-- counter when it is allowed.

if ARGV[2] ~= '0' then
	-- readCounters reads and decides the counters, before anything is
	-- written. It reports false, with nothing decided, when Redis's clock
	-- is outside the windows sent (clocks more than a window apart).
	function readCounters()
		cused, cend, cstale, cshort = {}, {}, {}, nil
		for j = 1, nc do
			local x = ac + 7 * (j - 1)
			local e
			if clock >= tonumber(ARGV[x + 2]) then
				for b = x + 3, x + 5 do
					if clock < tonumber(ARGV[b]) then
						e = tonumber(ARGV[b])
						break
					end
				end
			end
			if not e then
				reply[r + 1] = -1 -- Redis's clock is outside the windows sent (clocks more than a window apart)
				return false
			end
			local key = KEYS[kc + 2 * (j - 1)]
			local v = redis.pcall('HMGET', key, 'w', 'n')
			local w, used = nil, 0
			if v.err then
				reply[2] = reply[2] + 1
				redis.call('DEL', key)
			else
				w, used = tonumber(v[1]), tonumber(v[2]) or 0
			end
			if w and w * 1000 >= e then
				e = w * 1000 -- a window Redis's clock already counted in
			else
				-- Written whole at the first write: from 0, or from what
				-- the untagged key counted in this window.
				used, cstale[j] = 0, true
				local u = not w and redis.pcall('HMGET', KEYS[kc + 2 * (j - 1) + 1], 'w', 'n')
				if u and not u.err and tonumber(u[1]) and tonumber(u[1]) * 1000 == e then
					used = tonumber(u[2]) or 0
				end
			end
			if take and used + ARGV[x + 1] > tonumber(ARGV[x]) then
				if ARGV[x + 6] == '1' then
					cshort = cshort or {}
					cshort[j] = true
				else
					reply[r + 1] = 0
				end
			end
			cused[j], cend[j] = used, e
		end
		return true
	end

	-- writeCounters counts, and replies.
	function writeCounters()
		for j = 1, nc do
			local x = ac + 7 * (j - 1)
			local key, used, e, cost = KEYS[kc + 2 * (j - 1)], cused[j], cend[j], tonumber(ARGV[x + 1])
			-- Numbers are written with %d: Redis would turn one of more than 14
			-- digits into an exponent.
			if take and allowed and not (cshort and cshort[j]) or adjust and cost > 0 then
				used = used + cost
				local w = string.format('%d', math.ceil(e / 1000))
				if cstale[j] then
					redis.call('HSET', key, 'w', w, 'n', string.format('%d', used))
				else
					redis.call('HINCRBY', key, 'n', ARGV[x + 1])
				end
				redis.call('PEXPIREAT', key, w)
			elseif adjust and cost < 0 and used > 0 then
				used = math.max(used + cost, 0)
				if cstale[j] then -- carried over from the untagged key: written whole, 0 too
					local w = string.format('%d', math.ceil(e / 1000))
					redis.call('HSET', key, 'w', w, 'n', string.format('%d', used))
					redis.call('PEXPIREAT', key, w)
				elseif used == 0 then
					redis.call('DEL', key)
				else
					redis.call('HSET', key, 'n', string.format('%d', used))
				end
			end
			reply[cr + 3 * j - 2], reply[cr + 3 * j - 1], reply[cr + 3 * j] = used, (e - clock) * 1000, cshort and cshort[j] and 1 or 0
		end
	end
end
