-- The decision script: the decisions of many requests in one atomic call.
-- Each decision is one request's token buckets, calendar quota counters
-- and concurrency slots, decided all or nothing; the decisions are taken
-- in order, each independent of the others, as separate calls at one
-- instant of Redis's clock would take them.
--
-- A bucket is kept as one number: the instant it is full again, on
-- Redis's own clock, so every Caddy instance that shares this Redis
-- shares one clock. An absent bucket is a full one: buckets expire
-- exactly when they have refilled.
--
-- THE CALL
--
--   ARGV[1]  clock: '' to read TIME; tests send an instant, to replay
--            a table of steps
--   ARGV[2]  the number of decisions that are not plain takes: '0' for
--            a call of plain takes alone, which makes none of the other
--            decisions' functions (a plain adjustment's included)
--   ARGV[3]  np, the number of plain shapes; then 3 values each: full,
--            cost, token (below)
--   then the decisions, one after another, each starting with its op:
--
--   n        a number: a plain take of n buckets; then 2 values each:
--            shape (its index among the plain shapes), field. KEYS: the
--            hash of each bucket.
--   *        a run of plain takes of one bucket (a flood of one key):
--            then r, the takes, and the bucket's shape and field. KEYS:
--            its hash. Decided as r plain takes of it one after another.
--   +        a plain adjustment of n buckets of one plain shape (below)
--            that may owe beyond: then n, the shape, beyond, and 2
--            values a bucket: field, cost. KEYS: the hash of each
--            bucket. Decided as an adjust of them would be.
--   take, adjust
--            then nb, nc, ns (the numbers of buckets, counters and slot
--            sets) and three sections, in that order:
--              buckets  9 values each: field, full, cost, ban, beyond,
--                       wait, scaled, token, soft
--              counters 7 values each: limit, cost, b0, b1, b2, b3, soft
--              slots    id, then 3 values each: limit, lease, soft
--            KEYS: the hash of each bucket and the key of its override
--            (two keys a bucket; the hash again when the caller knows
--            that no key of the zone has an override: then none is
--            read), then the key of each counter and its untagged key
--            (two keys a counter, below), then the key of each slot set.
--   release  then ns and the request's id: its slots go back. KEYS: the
--            ns slot sets.
--
--   A decision's keys share one cluster slot; on a Redis Cluster, so do
--   all the keys of a call. The script touches no other key.
--
-- Units: every duration is whole nanoseconds; every instant (the clock,
-- b0..b3) is whole microseconds since 1970, the resolution of TIME.
--
-- THE REPLY
--
--   {clock, repaired, the result of each decision, in order}
--
--   clock     the clock the call was decided by (µs since 1970)
--   repaired  the keys of another type found, and overwritten by a write
--
--   plain n   allowed, debt_1, ..., debt_n
--   +         1, debt_1, ..., debt_n
--   run of r  allowed_1, debt_1, ..., allowed_r, debt_r: each take's, as
--             a plain take of one bucket replies
--   take, adjust
--             allowed,
--             debt_1, ban_1, token_1, burst_1, ..., (nb buckets)
--             used_1, left_1, short_1, ..., (nc counters)
--             held_1, free_1, ... (ns slot sets)
--   release   the number of sets that held the request's slot
--
--   allowed   1 if the take was allowed, else 0 (adjust: 1); -1 when
--             Redis's clock is outside the quota windows sent (below):
--             nothing was decided, and the rest is 0
--   debt_i    how long until bucket i is full again, after the decision
--   ban_i     1 if this decision started bucket i's ban, else 0; plus 2
--             when bucket i is soft and lacked the tokens
--   token_i   the time of a token of the override that decided bucket i,
--   burst_i   and its burst; 0 and 0 when the bucket's own shape decided
--   used_j    counter j's count in its window, after the decision
--   left_j    how long until that window ends
--   short_j   1 when counter j is soft and lacked the units, else 0
--   held_j    1 if the request holds a slot of set j, else 0
--   free_j    how many slots of set j are free, after the decision
--
-- BUCKETS. A bucket is the field `field` of its hash; its value is the
-- instant it is full again, in whole nanoseconds since 2025-01-01, in
-- decimal (Redis keeps it as an integer). A hash expires when the last
-- of its buckets is full; until then a bucket that is full again stays
-- (it carries nothing), and every new bucket removes any such among three
-- others taken at random, which keeps them to about a third of a hash.
-- Each bucket is read once a call and written once, at its end: the
-- decisions in between see what the earlier ones left.
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
-- A plain bucket is one with no ban, beyond, scale or override: a take
-- of plain buckets alone is sent as a plain decision, its shape once a
-- call, and decided as a take would be; so is an adjustment of buckets
-- of one shape without ban or scale and with no override read, beyond
-- sent once (a reconciliation of a zone with sync: many keys a call).
-- Redis pays for every function and table a call makes, whatever it
-- decides: a call of one plain take of one bucket runs straight through,
-- making only the reply, and the functions of the other decisions are
-- made only by a call that holds one (ARGV[2]).
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
-- take    charges every bucket, counter and slot set, or none. A soft
--         bucket or counter (soft '1': a zone in dry run) that lacks
--         refuses nothing and is charged nothing, and a refusal starts
--         its ban all the same. A bucket
--         gives cost when debt + cost <= full + wait and cost <= full:
--         the request then waits out what it owes beyond full. When the
--         take is refused, each bucket with a ban that lacked the tokens
--         and was not banned yet (it owed at most full), for a cost of at
--         most full, is banned: it owes full + ban.
-- adjust  charges each bucket and counter its cost, refusing nothing: a
--         bucket up to what it may owe, a counter past its limit. A
--         negative cost gives back, and never shortens a ban. No slots.
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
-- A key of another type (or a bucket that holds no instant) is read as
-- full, or empty of slots, and overwritten or deleted by the writes.
-- Any other error (a Redis out of memory) ends the script.

local epoch = 1735689600000000 -- 2025-01-01T00:00:00Z, in µs since 1970

local clock = tonumber(ARGV[1])
if not clock then
	local t = redis.call('TIME')
	clock = t[1] * 1000000 + t[2]
end
local now = clock - epoch -- µs since 2025: the buckets' time line

local reply = { clock, 0 } -- reply[2]: the keys found of another type

local values, saved, order, wrong -- (below)

-- owed is what the bucket name of value v owes now under the call's limit, of
-- whole bucket full and token token (shapefull and token the shape's,
-- otoken > 0 an override's token), whether that moved it (it was written
-- under another limit), and whether v held no instant.
local function owed(v, name, full, token, shapefull, scaled, otoken)
	if not v then
		return 0, false, false
	end
	-- A bucket written under a limit other than the call's says so:
	-- `<instant>:<full>` (scaled), `<instant>:<full>:<token>` (an
	-- override's).
	local suffix, d = v, v
	if type(v) == 'number' then
		suffix = saved[name]
	end
	local c, sf, st = string.find(suffix, ':', 1, true), nil, nil
	if c then
		local r = string.sub(suffix, c + 1)
		local e = string.find(r, ':', 1, true)
		if e then
			sf, st = tonumber(string.sub(r, 1, e - 1)), tonumber(string.sub(r, e + 1))
		else
			sf = tonumber(r)
		end
	end
	if type(v) == 'string' then
		if c then
			v = string.sub(v, 1, c - 1)
		end
		-- x, the instant's double, is within a few hundred nanoseconds of
		-- it until 2098, so its microseconds come out exact once the last
		-- three digits are taken off and rounded: d is then exact.
		local x, frac = tonumber(v), tonumber(string.sub(v, -3))
		if not (x and frac and x >= 0 and x % 1 == 0) then
			return 0, false, true
		end
		d = (math.floor((x - frac) / 1000 + 0.5) - now) * 1000 + frac
	end
	if d <= 0 then
		return d, false, false
	end
	if scaled then
		if sf and sf > 0 and sf ~= full then
			-- Written under another limit (the key's plan changed): it owes
			-- the same fraction of this one's bucket, and what it owed
			-- beyond its whole bucket as it was.
			local part = math.min(d, sf)
			return math.floor(part / sf * full) + d - part, true, false
		end
	elseif st or otoken > 0 then
		-- A change of the key's own limit: the bucket keeps the tokens it
		-- had spent, counted in the tokens of the limit that wrote it (its
		-- suffix's, else the call's shape), up to the new burst.
		local f0, t0 = shapefull, token
		if sf and st and sf > 0 and st > 0 then
			f0, t0 = sf, st
		end
		local t1 = otoken > 0 and otoken or token
		if f0 ~= full or t0 ~= t1 then
			local part = math.min(d, f0)
			local y = math.max(0, math.min(part, part + full / t1 * t0 - f0))
			if t0 ~= t1 then
				y = math.floor(y / t0 * t1)
			end
			return y + d - part, true, false
		end
	end
	return d, false, false
end

-- write makes v (from now, a number, or false) what the bucket field of
-- hash h owes, under the limit of suffix: v <= 0 or false deletes it.
local nowdigits -- now in the instants' digits, for purges
-- PEXPIRE's NX and GT (Redis 7.0, Valkey) set the expiry without reading it.
local expiryflags = (redis.REDIS_VERSION_NUM or 0) >= 0x070000
local function write(h, field, v, suffix)
	if not v or v <= 0 then
		redis.call('HDEL', h, field)
		return
	end
	local us = math.floor(v / 1000)
	local added = redis.call('HSET', h, field, string.format('%d%03d', now + us, v - us * 1000) .. suffix)
	-- The hash lives as long as its longest debt: whether it had an
	-- expiry (did HSET make it?) tells a new bucket among others.
	local ttl, others = math.ceil(v / 1000000), false
	if expiryflags then
		if added == 0 or redis.call('PEXPIRE', h, ttl, 'NX') == 0 then
			others = added == 1
			redis.call('PEXPIRE', h, ttl, 'GT')
		end
	else
		local left = redis.call('PTTL', h) -- -1: HSET made the hash
		if left < ttl then
			redis.call('PEXPIRE', h, ttl)
		end
		others = added == 1 and left >= 0
	end
	if others then
		-- A new bucket in a hash that has others: remove the buckets full
		-- again among three of the hash's, taken at random. Instants of as
		-- many digits compare as strings.
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

-- A call of one plain take of one bucket (a request that found no call
-- in flight): straight through, making no table but the reply.
if ARGV[3] == '1' and ARGV[7] == '1' and #ARGV == 9 then
	local h, field, full, cost = KEYS[1], ARGV[9], tonumber(ARGV[4]), tonumber(ARGV[5])
	local v = redis.pcall('HGET', h, field)
	local bad = type(v) == 'table'
	local d, moved, nothing = 0, false, false
	if bad then
		reply[2] = 1
	elseif v then
		d, moved, nothing = owed(v, nil, full, tonumber(ARGV[6]), full, false, 0)
		if nothing then
			reply[2] = 1
		end
	end
	local debt = d
	if debt < 0 then
		debt = 0
	elseif debt > full then
		debt = full
	end
	local ok = debt + cost <= full
	if ok then
		debt = debt + cost
	end
	if ok or bad or nothing or moved or d > full then
		if bad then
			redis.call('DEL', h)
		end
		write(h, field, debt, '')
	end
	reply[3], reply[4] = ok and 1 or 0, debt
	return reply
end

-- The plain shapes: full, cost and token of shape s at ps[3s - 2 ..].
local np = ARGV[3] == '1' and 1 or tonumber(ARGV[3])
local ps = {}
for i = 1, 3 * np do
	ps[i] = tonumber(ARGV[3 + i])
end
local a, k = 4 + 3 * np, 1 -- the next decision's first value in ARGV, and key in KEYS

-- The buckets the call has read, by hash .. field (a hash ends with its
-- tag's '}', which no key prefix holds): in values, the value each has
-- once the decisions so far are taken: false for none, a string as read,
-- or, once a decision has saved it, what it owes from now (a number); in
-- saved, the suffix of the limit each saved one is saved under; and in
-- order, the name, hash and field of each saved one, in the order first
-- saved. wrong holds the hashes found of another type, deleted before a
-- write. (Few tables, and few closures: each costs a call, whatever it
-- decides.)
values, saved, order = {}, {}, {}

-- load is the value of the bucket field of hash h, its name in values,
-- and whether its hash was found of another type (read as full).
local function load(h, field)
	local name = h .. field
	local v = values[name]
	if v ~= nil then
		return v, name, false
	end
	v = redis.pcall('HGET', h, field)
	local bad = type(v) == 'table'
	if bad then
		wrong = wrong or {}
		wrong[h], v = true, false
	end
	values[name] = v
	return v, name, bad
end

-- save makes debt (from now) what the bucket owes, under the limit of
-- suffix, and none for debt <= 0; it is written when the call ends.
local function save(h, field, name, debt, suffix)
	if not saved[name] then
		local n = #order
		order[n + 1], order[n + 2], order[n + 3] = name, h, field
	end
	saved[name] = suffix
	values[name] = debt > 0 and debt
end

-- A plain take of n buckets, or a run of takes of one (n = 1): as many
-- takes of it one after the other, each with its own result. The scratch
-- pb holds, 7 values a bucket, each one's debt, cost, name, hash, field,
-- whether it must be written even if the take is refused (it moved, or
-- held no instant), and full.
local pb = {}
local function plain(n, takes)
	local ok = true
	for i = 0, 7 * (n - 1), 7 do
		local s, h, field = ARGV[a], KEYS[k], ARGV[a + 1]
		s = 3 * (s == '1' and 1 or tonumber(s)) -- most calls have one shape: no strtod
		a, k = a + 2, k + 1
		local full, cost = ps[s - 2], ps[s - 1]
		local v, name, bad = load(h, field)
		local d, moved, nothing = 0, false, false
		if v then
			d, moved, nothing = owed(v, name, full, ps[s], full, false, 0)
		end
		if bad or nothing then
			reply[2] = reply[2] + 1
		end
		local debt = d
		if debt < 0 then
			debt = 0
		elseif debt > full then
			debt = full
		end
		ok = ok and debt + cost <= full
		pb[i + 1], pb[i + 2], pb[i + 3], pb[i + 4], pb[i + 5], pb[i + 6], pb[i + 7] = debt, cost, name, h, field,
			bad or nothing or moved or d > full, full
	end
	local r = #reply
	if takes then
		local debt, cost, full, write = pb[1], pb[2], pb[7], pb[6]
		for j = 1, takes do
			local allowed = debt + cost <= full
			if allowed then
				debt, write = debt + cost, true
			end
			reply[r + 2 * j - 1], reply[r + 2 * j] = allowed and 1 or 0, debt
		end
		if write then
			save(pb[4], pb[5], pb[3], debt, '')
		end
		return
	end
	reply[r + 1] = ok and 1 or 0
	for i = 0, 7 * (n - 1), 7 do
		local debt = pb[i + 1]
		if ok then
			debt = debt + pb[i + 2]
		end
		if ok or pb[i + 6] then
			save(pb[i + 4], pb[i + 5], pb[i + 3], debt, '')
		end
		reply[r + 2 + i / 7] = debt
	end
end

-- The functions of the other decisions, made only by a call that holds
-- one: Redis pays for each function a call makes, whatever it runs.
local general, release, adjusted
if ARGV[2] ~= '0' then
	-- A plain adjustment of n buckets: each is charged its cost, or given
	-- -cost back, refusing nothing, up to full + beyond, as adjust charges a
	-- bucket without ban, scale or override.
	function adjusted()
		local n, s, beyond = tonumber(ARGV[a + 1]), 3 * tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
		a = a + 4
		local full, token = ps[s - 2], ps[s]
		local most, r = full + beyond, #reply
		reply[r + 1] = 1
		for i = 1, n do
			local h, field, cost = KEYS[k], ARGV[a], tonumber(ARGV[a + 1])
			a, k = a + 2, k + 1
			local v, name, bad = load(h, field)
			local d, moved, nothing = 0, false, false -- moved or not, it is written
			if v then
				d, moved, nothing = owed(v, name, full, token, full, false, 0)
			end
			if bad or nothing then
				reply[2] = reply[2] + 1
			end
			local debt = math.min(math.max(d, 0), most)
			if cost >= 0 then
				debt = math.min(debt + cost, most)
			else
				debt = math.max(debt + cost, 0)
			end
			save(h, field, name, debt, '')
			reply[r + 1 + i] = debt
		end
	end

	-- A take or an adjustment of buckets, counters and slot sets.
	function general(op)
		local take, adjust = op == 'take', op == 'adjust'
		local nb, nc, ns = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
		local ab, kb = a + 4, k -- bucket i's values are ARGV[ab + 9(i-1) ..], its keys KEYS[kb + 2(i-1) ..]
		local ac, kc = ab + 9 * nb, kb + 2 * nb -- counter j's: ARGV[ac + 7(j-1) ..], KEYS[kc + 2(j-1) ..]
		local as, ks = ac + 7 * nc, kc + 2 * nc -- the id is ARGV[as]; set j's: ARGV[as + 1 + 3(j-1) ..], KEYS[ks + j - 1]
		a, k = as + (ns > 0 and 1 + 3 * ns or 0), ks + ns
		local r = #reply -- the decision's results are reply[r + 1 ..]
		for i = r + 1, r + 1 + 4 * nb + 3 * nc + 2 * ns do
			reply[i] = 0
		end
		reply[r + 1] = 1
		local cr, sr = r + 1 + 4 * nb, r + 1 + 4 * nb + 3 * nc -- counter j's results are reply[cr + 3j - 2 ..], set j's reply[sr + 2j - 1 ..]
		local lacked -- the soft buckets without the tokens, by index (made when one is)

		-- Counters, read and decided before anything is written.
		local cused, cend, cstale, cshort = {}, {}, {}, nil -- cshort: the soft counters without the units
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
				return
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

		-- Buckets, read and decided before anything is written. Until the
		-- writes, reply[r + 4i - 2 .. r + 4i + 1] hold bucket i's debt, its
		-- state, and the token and burst of its override (0 and 0 for none);
		-- its state is 1 short (it lacked the tokens, and its ban starts),
		-- plus 2 moved (it owed more than it may, or was written under
		-- another limit), plus 4 bad (it held no instant, or its hash was of
		-- another type). The reads leave each bucket's full, cost, ban and
		-- beyond in ARGV as numbers, an override's full and cost in place of
		-- the shape's, and its name in names, for the writes.
		local names = {}
		for i = 1, nb do
			local x, h = ab + 9 * (i - 1), KEYS[kb + 2 * (i - 1)]
			local full, cost, ban, beyond = tonumber(ARGV[x + 1]), tonumber(ARGV[x + 2]), tonumber(ARGV[x + 3]), tonumber(ARGV[x + 4])
			local shapefull, token = full, tonumber(ARGV[x + 7])
			local otoken, oburst = 0, 0
			local okey = KEYS[kb + 2 * (i - 1) + 1]
			local o = okey ~= h and redis.pcall('GET', okey)
			if type(o) == 'string' then
				local c = string.find(o, ':', 1, true)
				local e = c and string.find(o, ':', c + 1, true)
				local t, b = c and tonumber(string.sub(o, 1, c - 1)), e and tonumber(string.sub(o, c + 1, e - 1))
				if t and b and t > 0 and b > 0 then
					if t ~= token then
						cost = cost / token * t
					end
					otoken, oburst, full = t, b, t * b
				end
			end
			local v, name, bad = load(h, ARGV[x])
			local d, moved, nothing = owed(v, name, full, token, shapefull, ARGV[x + 6] == '1', otoken)
			local state = (bad or nothing) and 4 or 0
			local most = full + ban + beyond
			local debt = math.min(math.max(d, 0), most)
			if moved or d > most then
				state = state + 2
			end
			if take and (debt + cost > full + tonumber(ARGV[x + 5]) or cost > full) then
				-- A cost above the whole bucket (a key's own burst below a
				-- cost that comes with each request) is never there, and its
				-- refusal bans no one.
				if ARGV[x + 8] == '1' then
					lacked = lacked or {}
					lacked[i] = true
				else
					reply[r + 1] = 0
				end
				if ban > 0 and debt <= full and cost <= full then
					state = state + 1
				end
			end
			local y = r + 4 * i - 2
			reply[y], reply[y + 1], reply[y + 2], reply[y + 3] = debt, state, otoken, oburst
			ARGV[x + 1], ARGV[x + 2], ARGV[x + 3], ARGV[x + 4], names[i] = full, cost, ban, beyond, name
		end
		local allowed = reply[r + 1] == 1

		-- Slot sets: count the live leases, trimming the ended ones, and refuse
		-- the request when a set that is not soft is full and the buckets and
		-- counters allowed it.
		local sused = {}
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

		-- Buckets: save. A bucket that owes debt is saved as the instant now +
		-- debt; debt <= 0 deletes it.
		for i = 1, nb do
			local x, y = ab + 9 * (i - 1), r + 4 * i - 2
			local debt, state = reply[y], reply[y + 1]
			local short = state % 2 == 1
			local write = true
			local full, cost, ban = ARGV[x + 1], ARGV[x + 2], ARGV[x + 3]
			if adjust then
				if cost >= 0 then
					debt = math.min(debt + cost, full + ban + ARGV[x + 4])
				elseif ban == 0 or debt <= full then
					debt = math.max(debt + cost, 0)
				else
					write = state >= 2 -- banned: only a repair
				end
			elseif take and allowed and not (lacked and lacked[i]) then
				debt = debt + cost
			elseif short then
				debt = full + ban
			elseif not take or state < 2 then
				write = false -- else saved as read: moved, or a bad one as full
			end
			if write then
				local suffix = ''
				if ARGV[x + 6] == '1' then
					suffix = string.format(':%d', full)
				elseif reply[y + 2] > 0 then
					suffix = string.format(':%d:%d', full, reply[y + 2])
				end
				save(KEYS[kb + 2 * (i - 1)], ARGV[x], names[i], debt, suffix)
			end
			if state >= 4 then
				reply[2] = reply[2] + 1
			end
			reply[y], reply[y + 1] = debt, (short and 1 or 0) + (lacked and lacked[i] and 2 or 0)
		end

		-- Counters: count, and reply.
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

		-- Slots: take, and reply.
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

while a <= #ARGV do
	local op = ARGV[a]
	local n = op == '1' and 1 or tonumber(op)
	if n then
		a = a + 1
		plain(n)
	elseif op == '*' then
		a = a + 2
		plain(1, tonumber(ARGV[a - 1]))
	elseif op == '+' then
		adjusted()
	elseif op == 'release' then
		release()
	else
		general(op)
	end
end

-- The buckets written, each once. A hash of another type is deleted
-- first.
for i = 1, #order, 3 do
	local name, h, field = order[i], order[i + 1], order[i + 2]
	if wrong and wrong[h] then
		redis.call('DEL', h)
		wrong[h] = nil
	end
	write(h, field, values[name], saved[name])
end

return reply
