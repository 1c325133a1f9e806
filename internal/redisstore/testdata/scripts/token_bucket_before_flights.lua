-- The decision script: a request's token buckets, calendar quota counters
-- and concurrency slots, decided all or nothing in one atomic call.
--
-- A bucket is kept as one number: the instant it is full again, on
-- Redis's own clock, so every Caddy instance that shares this Redis
-- shares one clock. An absent bucket is a full one: buckets expire
-- exactly when they have refilled.
--
-- THE CALL
--
--   KEYS     the hash of each bucket and the key of its override (two
--            keys a bucket; the hash again when the caller knows that no
--            key of the zone has an override: then none is read), then
--            the key of each counter and its untagged key (two keys a
--            counter, below), then the key of each slot set, in that
--            order, all in one cluster slot. The script touches no other
--            key.
--   ARGV[1]  op: 'take' or 'adjust'; or a number k > 1, k takes (below);
--            or 'release' (below)
--   ARGV[2]  clock: '' to read TIME; tests send an instant, to replay
--            a table of steps
--   ARGV[3]  nb, the number of buckets
--   ARGV[4]  nc, the number of counters
--   ARGV[5]  ns, the number of slot sets
--   then the three sections, in that order:
--   buckets  8 values each: field, full, cost, ban, beyond, wait, scaled,
--            token
--   counters 6 values each: limit, cost, b0, b1, b2, b3
--   slots    id, then 3 values each: limit, lease, soft
--
-- Units: every duration is whole nanoseconds; every instant (the clock,
-- b0..b3) is whole microseconds since 1970, the resolution of TIME.
--
-- THE REPLY, one layout whatever the call:
--
--   {allowed, repaired,
--    debt_1, ban_1, token_1, burst_1, ..., debt_nb, ban_nb, token_nb, burst_nb,
--    used_1, left_1, ..., used_nc, left_nc,
--    held_1, free_1, ..., held_ns, free_ns,
--    clock}
--
--   allowed   1 if the take was allowed, else 0 (adjust: 1); k takes:
--             how many were allowed
--   repaired  the keys of another type found, and overwritten by a write
--   debt_i    how long until bucket i is full again, after the call
--   ban_i     1 if this call started bucket i's ban, else 0
--   token_i   the time of a token of the override that decided bucket i,
--   burst_i   and its burst; 0 and 0 when the bucket's own shape decided
--   used_j    counter j's count in its window, after the call
--   left_j    how long until that window ends
--   held_j    1 if the request holds a slot of set j, else 0
--   free_j    how many slots of set j are free, after the call
--   clock     the clock the call was decided by (µs since 1970)
--
-- BUCKETS. A bucket is the field `field` of its hash, KEYS[i]; its value
-- is the instant it is full again, in whole nanoseconds since 2025-01-01,
-- in decimal (Redis keeps it as an integer). A hash expires when the last
-- of its buckets is full; until then a bucket that is full again stays
-- (it carries nothing), and every new bucket removes any such among three
-- others taken at random, which keeps them to about a third of a hash.
--
--   full   time to refill the bucket from empty: burst / rate
--   cost   what the request's tokens are worth: cost / rate (adjust:
--          negative to give tokens back)
--   ban    how long a denial bans the bucket for; 0 for no ban
--   beyond how much more than a whole bucket the bucket may owe: a
--          delay's reservations, or the debt adjustments may run up (a
--          cost known after the response); 0 for none (never with a ban)
--   wait   how much of beyond this take may reserve: the delay, or 0 when
--          the request may not wait or the zone has no delay
--   scaled '1' when the zone's limit comes with each request (plans):
--          the bucket is written `<instant>:<full>`, and one written under
--          another full owes the same fraction of this one's bucket (and
--          what it owed beyond it, as it was), so that a change of plan
--          hands back no tokens
--   token  the time of one token: full / burst (cost is counted in them)
--
-- OVERRIDES. A key's own limit, set through the admin API, is the string
-- `<token>:<burst>:<rate as given>` at its key (KEYS, after its bucket's
-- hash), which expires by itself: where it is, its burst and token
-- replace the shape's, full becomes burst * token, and cost the same
-- count of its tokens; ban, beyond and wait stay. A bucket of a zone
-- whose limit is fixed that an override decided is written
-- `<instant>:<full>:<token>`: one read under another limit (the
-- override set, changed, removed or expired), or one without that suffix
-- read under an override, keeps the tokens it had spent: it owes
-- max(0, min(spent, spent + burst - burst_before)) of the new limit's
-- tokens (spent counted in the old limit's tokens, out of its whole
-- bucket), and what it owed beyond its whole bucket as it was. A
-- scaled bucket keeps the fraction it owed, as for a change of plan: an
-- override is one more plan there.
--
-- A bucket owes at most full + ban + beyond; with a ban, one that owes
-- more than full is banned for the excess. One found owing more (its
-- key's limit changed to a smaller one) is read as owing just that: from
-- then on an empty bucket of the request's limit.
--
-- take    charges every bucket, counter and slot set, or none. A bucket
--         gives cost when debt + cost <= full + wait: the request then
--         waits out what it owes beyond full. When the take is refused,
--         each bucket with a ban that lacked the tokens and was not banned
--         yet (it owed at most full) is banned: it owes full + ban.
-- adjust  charges each bucket and counter its cost, refusing nothing: a
--         bucket up to what it may owe, a counter past its limit. A
--         negative cost gives back, and never shortens a ban. No slots.
--
-- k takes decide k takes of one request that arrived together, in order,
-- at one instant, as k calls would if Redis's clock stood still: the
-- first that a bucket lacks the tokens for is refused, and so is every
-- one after it. Only for buckets without ban or beyond, and no counters
-- or slots. allowed is the number m allowed, and debt_i bucket i's after
-- them: the j-th of them (j = 1..m) owes debt_i - (m - j) cost_i, as it
-- would have alone.
--
-- COUNTERS. A calendar quota's counter per key and window (a day, a week
-- or a month in a time zone), decided in the same call, all or nothing
-- with the buckets. Lua knows no time zones, so Caddy sends, by its own
-- clock and in the zone's time zone, the window that holds its now,
-- [b1, b2), with the one before, [b0, b1), and the one after, [b2, b3).
-- The script picks the one of the three that holds Redis's clock: the one
-- before when Caddy's clock is ahead, across a boundary Redis's has not
-- reached, the one after when it is behind. So every instance counts in
-- the window of Redis's one clock, whatever its own clock's skew up to a
-- whole window; a clock outside the three is an error, which fail_mode
-- decides. Only boundaries travel, never an instant that decides.
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
--
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
--
-- release gives back the slots of one request, its own call: KEYS are
-- its slot sets, ARGV[2] the request's id, and the reply {n}, n the sets
-- that held it.
--
-- A key of another type (or a bucket that holds no instant) is read as
-- full, or empty of slots, and overwritten or deleted by the writes.

local epoch = 1735689600000000 -- 2025-01-01T00:00:00Z, in µs since 1970

-- The script runs once per decision, and Redis pays for every function
-- and table it makes: the common path (a take of buckets) makes no
-- function and one table, the reply, and the counter and slot sections
-- run only for calls that have them.

local op = ARGV[1]
if op == 'release' then
	local n = 0
	for i = 1, #KEYS do
		n = n + redis.call('ZREM', KEYS[i], ARGV[2])
	end
	return { n }
end
local k = tonumber(op) -- k takes, or nil
if k then
	op = 'take'
end
local take, adjust = op == 'take', op == 'adjust'
local clock = tonumber(ARGV[2])
if not clock then
	local t = redis.call('TIME')
	clock = t[1] * 1000000 + t[2]
end
local now = clock - epoch -- µs since 2025: the buckets' time line
local nb, nc, ns = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cargs = 5 + 8 * nb -- counter j's values are ARGV[cargs + 6j - 5 ..]
local sargs = cargs + 6 * nc -- the slot section: the id is ARGV[sargs + 1]

-- The reply, made whole at once for the common call (one bucket): a
-- table that grows is copied as it does.
local reply
if nb == 1 and nc + ns == 0 then
	reply = { 1, 0, 0, 0, 0, 0, 0 }
else
	reply = { 1, 0 }
end

-- Counters, read and decided before anything is written.
local cused, cend, cstale
if nc > 0 then
	cused, cend, cstale = {}, {}, {}
	for j = 1, nc do
		local a = cargs + 6 * (j - 1)
		local e
		if clock >= tonumber(ARGV[a + 3]) then
			for b = a + 4, a + 6 do
				if clock < tonumber(ARGV[b]) then
					e = tonumber(ARGV[b])
					break
				end
			end
		end
		if not e then
			return redis.error_reply('ERR quota window: Redis TIME is outside the windows Caddy sent (clocks more than a window apart)')
		end
		local key = KEYS[2 * nb + 2 * j - 1]
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
			local u = not w and redis.pcall('HMGET', KEYS[2 * nb + 2 * j], 'w', 'n')
			if u and not u.err and tonumber(u[1]) and tonumber(u[1]) * 1000 == e then
				used = tonumber(u[2]) or 0
			end
		end
		if take and used + ARGV[a + 2] > tonumber(ARGV[a + 1]) then
			reply[1] = 0
		end
		cused[j], cend[j] = used, e
	end
end

-- Buckets, read and decided before anything is written. Until the writes,
-- reply[4i - 1 .. 4i + 2] hold bucket i's debt, its state, and the token
-- and burst of its override (0 and 0 for none); its state is 1 short (it
-- lacked the tokens, and its ban starts), plus 2 moved (it owed more than
-- it may, or was written under another limit), plus 4 bad (it held no
-- instant, or its hash was of another type). The reads leave each
-- bucket's full, cost, ban and beyond in ARGV as numbers, an override's
-- full and cost in place of the shape's, for the writes.
local wrong -- the hashes found of another type, deleted before a write
for i = 1, nb do
	local a = 8 * i - 2
	local h = KEYS[2 * i - 1]
	local full, cost, ban, beyond = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
	local shapefull = full
	local otoken, oburst = 0, 0
	local o = KEYS[2 * i] ~= h and redis.pcall('GET', KEYS[2 * i])
	if type(o) == 'string' then
		local c = string.find(o, ':', 1, true)
		local e = c and string.find(o, ':', c + 1, true)
		local t, b = c and tonumber(string.sub(o, 1, c - 1)), e and tonumber(string.sub(o, c + 1, e - 1))
		if t and b and t > 0 and b > 0 then
			local token = tonumber(ARGV[a + 7])
			if t ~= token then
				cost = cost / token * t
			end
			otoken, oburst, full = t, b, t * b
		end
	end
	local v = redis.pcall('HGET', h, ARGV[a])
	local d, state, moved = 0, 0, false -- d: what the bucket owes; an absent one, nothing
	if type(v) == 'table' then
		wrong = wrong or {}
		wrong[h], state = true, 4
	elseif v then
		-- A bucket written under a limit other than the call's says so:
		-- `<instant>:<full>` (scaled), `<instant>:<full>:<token>` (an
		-- override's).
		local c, sf, st = string.find(v, ':', 1, true), nil, nil
		if c then
			local r = string.sub(v, c + 1)
			v = string.sub(v, 1, c - 1)
			local e = string.find(r, ':', 1, true)
			if e then
				sf, st = tonumber(string.sub(r, 1, e - 1)), tonumber(string.sub(r, e + 1))
			else
				sf = tonumber(r)
			end
		end
		-- x, the instant's double, is within a few hundred nanoseconds of
		-- it until 2098, so its microseconds come out exact once the last
		-- three digits are taken off and rounded: d is then exact.
		local x, frac = tonumber(v), tonumber(string.sub(v, -3))
		if x and frac and x >= 0 and x % 1 == 0 then
			d = (math.floor((x - frac) / 1000 + 0.5) - now) * 1000 + frac
		else
			state = 4
		end
		if d <= 0 then
		elseif ARGV[a + 6] == '1' then
			if sf and sf > 0 and sf ~= full then
				-- Written under another limit (the key's plan changed): it owes
				-- the same fraction of this one's bucket, and what it owed
				-- beyond its whole bucket as it was; saved so.
				local part = math.min(d, sf)
				d, moved = math.floor(part / sf * full) + d - part, true
			end
		elseif st or otoken > 0 then
			-- A change of the key's own limit: the bucket keeps the tokens it
			-- had spent, counted in the tokens of the limit that wrote it
			-- (its suffix's, else the call's shape), up to the new burst.
			local f0, t0 = shapefull, tonumber(ARGV[a + 7])
			if sf and st and sf > 0 and st > 0 then
				f0, t0 = sf, st
			end
			local t1 = otoken > 0 and otoken or tonumber(ARGV[a + 7])
			if f0 ~= full or t0 ~= t1 then
				local part = math.min(d, f0)
				local y = math.max(0, math.min(part, part + full / t1 * t0 - f0))
				if t0 ~= t1 then
					y = math.floor(y / t0 * t1)
				end
				d, moved = y + d - part, true
			end
		end
	end
	local most = full + ban + beyond
	local debt = math.min(math.max(d, 0), most)
	if moved or d > most then
		state = state + 2
	end
	if take and debt + cost > full + tonumber(ARGV[a + 5]) then
		reply[1] = 0
		if ban > 0 and debt <= full then
			state = state + 1
		end
	end
	reply[4 * i - 1], reply[4 * i], reply[4 * i + 1], reply[4 * i + 2] = debt, state, otoken, oburst
	ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4] = full, cost, ban, beyond
end

-- k takes: the first m that every bucket holds are allowed. The debts in
-- reply are then those before the last of them, which the writes below
-- charge as a take's.
local m
if k then
	m = 0
	local d, cost, full = {}, {}, {}
	for i = 1, nb do
		d[i], cost[i], full[i] = reply[4 * i - 1], ARGV[8 * i], ARGV[8 * i - 1]
	end
	while m < k do
		local room = true
		for i = 1, nb do
			room = room and d[i] + cost[i] <= full[i]
		end
		if not room then
			break -- this one is refused, and so is every one after it
		end
		for i = 1, nb do
			reply[4 * i - 1], d[i] = d[i], d[i] + cost[i]
		end
		m = m + 1
	end
	reply[1] = m > 0 and 1 or 0
end

-- Slot sets: count the live leases, trimming the ended ones, and refuse
-- the request when a set that is not soft is full and the buckets and
-- counters allowed it.
local sused
if take and ns > 0 then
	sused = {}
	for j = 1, ns do
		local a = sargs + 3 * j - 1
		local key = KEYS[2 * nb + 2 * nc + j]
		local trimmed = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
		if type(trimmed) == 'table' then
			reply[2] = reply[2] + 1
			redis.call('DEL', key)
		end
		local used = redis.call('ZCARD', key)
		if reply[1] == 1 and used >= tonumber(ARGV[a]) and ARGV[a + 2] ~= '1' then
			reply[1] = 0
		end
		sused[j] = used
	end
end

-- Buckets: write. A bucket that owes debt is saved as the instant now +
-- debt, written as its microseconds then three digits of nanoseconds;
-- debt <= 0 deletes it. A hash of another type is deleted first. Any other
-- error (a Redis out of memory) ends the script before it has written
-- anything.
local nowdigits -- now in the instants' digits, for purges
for i = 1, nb do
	local a = 8 * i - 2
	local debt, state = reply[4 * i - 1], reply[4 * i]
	local short, bad = state % 2 == 1, state >= 4
	local write = true
	local full, cost, ban = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
	if adjust then
		if cost >= 0 then
			debt = math.min(debt + cost, full + ban + ARGV[a + 4])
		elseif ban == 0 or debt <= full then
			debt = math.max(debt + cost, 0)
		else
			write = state >= 2 -- banned: only a repair
		end
	elseif take and reply[1] == 1 then
		debt = debt + cost
	elseif short then
		debt = full + ban
	elseif not take or state < 2 then
		write = false -- else saved as read: moved, or a bad one as full
	end
	if write then
		local h, field = KEYS[2 * i - 1], ARGV[a]
		if wrong and wrong[h] then
			redis.call('DEL', h)
			wrong[h] = nil
		end
		if debt <= 0 then
			redis.call('HDEL', h, field)
		else
			local us = math.floor(debt / 1000)
			local instant = string.format('%d%03d', now + us, debt - us * 1000)
			if ARGV[a + 6] == '1' then
				instant = instant .. ':' .. string.format('%d', full)
			elseif reply[4 * i + 1] > 0 then
				instant = string.format('%s:%d:%d', instant, full, reply[4 * i + 1])
			end
			local added = redis.call('HSET', h, field, instant)
			local ttl = math.ceil(debt / 1000000)
			local left = redis.call('PTTL', h) -- -1: HSET made the hash
			if left < ttl then
				redis.call('PEXPIRE', h, ttl)
			end
			if added == 1 and left >= 0 then
				-- A new bucket in a hash that has others: remove the
				-- buckets full again among three of the hash's, taken at
				-- random. Instants of as many digits compare as strings.
				if not nowdigits then
					nowdigits = string.format('%d000', now)
				end
				local r = redis.call('HRANDFIELD', h, 3, 'WITHVALUES')
				for j = 2, #r, 2 do
					local w = r[j]
					local c = string.find(w, ':', 1, true)
					if c then
						w = string.sub(w, 1, c - 1)
					end
					if #w < #nowdigits or #w == #nowdigits and w <= nowdigits then
						redis.call('HDEL', h, r[j - 1])
					end
				end
			end
		end
	end
	if bad then
		reply[2] = reply[2] + 1
	end
	reply[4 * i - 1], reply[4 * i] = debt, short and 1 or 0
end

-- Counters: count, and reply.
for j = 1, nc do
	local a = cargs + 6 * (j - 1)
	local key, used, e, cost = KEYS[2 * nb + 2 * j - 1], cused[j], cend[j], tonumber(ARGV[a + 2])
	-- Numbers are written with %d: Redis would turn one of more than 14
	-- digits into an exponent.
	if take and reply[1] == 1 or adjust and cost > 0 then
		used = used + cost
		local w = string.format('%d', math.ceil(e / 1000))
		if cstale[j] then
			redis.call('HSET', key, 'w', w, 'n', string.format('%d', used))
		else
			redis.call('HINCRBY', key, 'n', ARGV[a + 2])
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
	reply[1 + 4 * nb + 2 * j], reply[2 + 4 * nb + 2 * j] = used, (e - clock) * 1000
end

-- Slots: take, and reply.
for j = 1, ns do
	local a = sargs + 3 * j - 1
	local key, limit = KEYS[2 * nb + 2 * nc + j], tonumber(ARGV[a])
	local used, held = sused and sused[j] or 0, 0
	if take and reply[1] == 1 and used < limit then
		redis.call('ZADD', key, now + math.floor(ARGV[a + 1] / 1000), ARGV[sargs + 1])
		used, held = used + 1, 1
		-- The set lives as long as its longest lease.
		local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
		redis.call('PEXPIRE', key, math.max(math.ceil((tonumber(last[2]) - now) / 1000), 1))
	end
	reply[1 + 4 * nb + 2 * (nc + j)], reply[2 + 4 * nb + 2 * (nc + j)] = held, math.max(limit - used, 0)
end

if m then
	reply[1] = m
end
reply[3 + 4 * nb + 2 * (nc + ns)] = clock
return reply
