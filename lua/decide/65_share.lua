-- SHARES (op share): a bucket of a zone with share, whose instances each
-- spend a share of its tokens taken in advance (docs/share.md). One
-- decision is one instance's touch of one bucket: a request's cost, a
-- report of what it spent of its share, a grant of more, or the return
-- of what it did not spend.
--
--   share   then 10 values: field, full, token, cost, holder, known,
--           spent, want, ttl, ret. KEYS: the bucket's hash.
--
--   full, token  the bucket's shape, as a plain bucket's (no ban,
--                beyond, scale or override: a zone with share has none)
--   cost    the request's cost, taken from the bucket, not from a
--           share; 0 for none; negative gives that much back (a request
--           another zone refused)
--   holder  the instance's share of the bucket: an id unique among
--           instances and shares (`<instance>:<epoch>`), holding no '|',
--           ';' or ','
--   known   the tokens granted to the holder so far, as it knows them; a
--           holder that knows some and that Redis has no record of has
--           been written off: it is granted nothing more
--   spent   the tokens of its share it has spent so far, as it reports
--           them: a count that only grows, so that a repeated or late
--           report changes nothing
--   want    how much more it asks to be granted
--   ttl     how long its share lasts, from this touch
--   ret     '1': it gives back what it did not spend and holds no share
--           any more (it stopped spending when it sent this)
--
-- Every amount is a duration of refill, in whole nanoseconds, as a
-- bucket's debt is.
--
-- THE REPLY: allowed, debt, granted, left, out
--
--   allowed  1 if the bucket had the cost, else 0 (charged nothing)
--   debt     how long until the bucket is full again, after the decision
--   granted  the tokens granted to the holder so far (0 for none: no
--            share); the holder may spend granted - spent
--   left     how long its share lasts in Redis (0 for none)
--   out      the tokens granted to all the holders and not yet reported
--            spent, after the decision
--
-- THE STATE. Beside the bucket, the field `<field>#` of its hash holds
-- its holders: `<until>:<holder>|<granted>|<spent>|<until>;...`, each
-- until an instant in the buckets' digits (nanoseconds since 2025), the
-- first the last of them, so that a purge (see write) reads the field as
-- a bucket full again when the last share ends, and never sooner.
--
-- THE INVARIANT. out is the sum of granted - spent over the live holders:
-- at least what they may still spend, since a holder only spends what it
-- was granted and reports less than it spent. At every touch the bucket
-- owes at least out (its tokens plus out are at most its burst), so that
-- the tokens in the bucket and in every share together never exceed the
-- burst, and rise by no more than the refill: over any span, no more is
-- admitted than one exact bucket would. Refill hidden behind the shares
-- is lost, not returned. A holder whose share ended without its return
-- (it died, or its return was lost) is written off whole: its granted -
-- spent leaves out, and nothing comes back to the bucket but by refill.
-- A holder stops spending before Redis's end of its share: it counts its
-- ttl from when it sent the touch, Redis from when it decided it.

local share -- the op

if ARGV[2] ~= '0' then
	-- holders reads the holders of the bucket field of h at now (ns),
	-- writing off those whose share ended: a list of records {holder,
	-- granted, spent, until}, and the record of holder, if any.
	local function holders(h, field, holder, at)
		local v = redis.pcall('HGET', h, field .. '#')
		local list, mine = {}, nil
		if type(v) ~= 'string' then
			return list, nil
		end
		local c = string.find(v, ':', 1, true)
		if not c then
			return list, nil
		end
		for rec in string.gmatch(string.sub(v, c + 1), '[^;]+') do
			local id, g, s, u = string.match(rec, '^([^|]+)|(%d+)|(%d+)|(%d+)$')
			u = tonumber(u)
			if id and u and u > at then
				local r = { id, tonumber(g), tonumber(s), u }
				list[#list + 1] = r
				if id == holder then
					mine = r
				end
			end
		end
		return list, mine
	end

	-- keep writes the holders of the bucket field of h, or deletes them
	-- when none is left, and has the hash live as long as the last.
	local function keep(h, field, list, at)
		if #list == 0 then
			redis.call('HDEL', h, field .. '#')
			return
		end
		local last, parts = 0, {}
		for i, r in ipairs(list) do
			last = math.max(last, r[4])
			parts[i] = string.format('%s|%d|%d|%d', r[1], r[2], r[3], r[4])
		end
		redis.call('HSET', h, field .. '#', string.format('%d', last) .. ':' .. table.concat(parts, ';'))
		local ttl = math.ceil((last - at) / 1000000)
		if expiryflags then
			if redis.call('PEXPIRE', h, ttl, 'NX') == 0 then
				redis.call('PEXPIRE', h, ttl, 'GT')
			end
		elseif redis.call('PTTL', h) < ttl then
			redis.call('PEXPIRE', h, ttl)
		end
	end

	function share()
		local h, field = KEYS[k], ARGV[a + 1]
		local full, token, cost = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
		local holder, known, spent = ARGV[a + 5], tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
		local want, ttl, ret = tonumber(ARGV[a + 8]), tonumber(ARGV[a + 9]), ARGV[a + 10] == '1'
		a, k = a + 11, k + 1
		local at = now * 1000 -- ns since 2025, as the holders' ends

		local v, name, bad = load(h, field)
		local d, moved, nothing = 0, false, false
		if v then
			d, moved, nothing = owed(v, name, full, token, full, false, 0)
		end
		if bad or nothing then
			reply[2] = reply[2] + 1
		end
		local debt = math.min(math.max(d, 0), full)

		-- A bucket without holders, touched by a take that asks for no
		-- share (most keys, used rarely): a plain take, writing nothing
		-- but the bucket.
		if want == 0 and not ret and cost >= 0 and redis.call('HEXISTS', h, field .. '#') == 0 then
			local allowed = debt + cost <= full
			if allowed then
				debt = debt + cost
			end
			if allowed or bad or nothing or moved or d > full then
				save(h, field, name, debt, '')
			end
			local r = #reply
			reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] = allowed and 1 or 0, debt, 0, 0, 0
			return
		end

		local list, mine = holders(h, field, holder, at)
		if mine and spent > mine[3] then
			mine[3] = math.min(spent, mine[2])
		end
		local out, others = 0, 0
		for _, r in ipairs(list) do
			out = out + r[2] - r[3]
			if r ~= mine then
				others = others + 1
			end
		end
		debt = math.max(debt, out) -- the clip: tokens + out <= burst

		local allowed = 1
		if ret then
			if mine then
				-- What it did not spend goes back, and leaves out.
				local unspent = mine[2] - mine[3]
				out = out - unspent
				debt = math.max(debt - unspent, out)
				for i, r in ipairs(list) do
					if r == mine then
						table.remove(list, i)
						break
					end
				end
				mine = nil
			end
		elseif cost < 0 then
			debt = math.max(debt + cost, out, 0)
		else
			if debt + cost > full then
				allowed = 0
			else
				debt = debt + cost
			end
			if allowed == 1 and want > 0 and (mine or known == 0) then
				-- A fair part of what is left, in whole tokens, and no
				-- more than a quarter of the bucket out in one share;
				-- none when that is less than a request takes: near
				-- empty, every decision is exact.
				local held = mine and mine[2] - mine[3] or 0
				local g = math.min(want, math.floor((full - debt) / (others + 1)), math.floor(full / 4) - held)
				g = math.floor(g / token) * token
				if g >= math.max(cost, token) then
					if not mine then
						mine = { holder, 0, 0, 0 }
						list[#list + 1] = mine
					end
					mine[2], debt, out = mine[2] + g, debt + g, out + g
				end
			end
			if mine then
				-- Never sooner: the holder counts on the end it was told.
				mine[4] = math.max(mine[4], at + ttl)
			end
		end
		save(h, field, name, debt, '') -- clipped, if nothing else

		keep(h, field, list, at)
		local r = #reply
		reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
			allowed, debt, mine and mine[2] or 0, mine and mine[4] - at or 0, out
	end
end
