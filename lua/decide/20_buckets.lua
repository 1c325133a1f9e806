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
--          the request may not wait or the zone has no delay; or, for a
--          zone with reserves (never with a delay or a ban), -kept: the
--          take must leave kept of the whole bucket to the classes above
--          the request's, as if its whole bucket were full - kept
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
-- SHARES. A plain shape whose token is sent negative is of a zone with
-- share (65_share.lua): a plain take of its bucket first clips it by the
-- shares out (it owes at least what they hold), and writes it clipped.

-- OVERRIDES. A key's own limit, set through the admin API, is the string
-- `<token>:<burst>:<rate as given>` at its key (KEYS, after its bucket's
-- hash), which expires by itself: where it is, its burst and token
-- replace the shape's, full becomes burst * token, and cost the same
-- count of its tokens; ban, beyond and wait stay, but a reserve (wait
-- < 0) keeps the same share of the key's own bucket: wait becomes
-- -floor(-wait / full * the override's full). A bucket of a zone
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

-- sharedOut is what the shares of the bucket field of hash h hold at
-- now: the tokens granted to the holders whose shares have not ended,
-- less what they reported spent (see 65_share.lua's state).
local function sharedOut(h, field)
	local v = redis.pcall('HGET', h, field .. '#')
	if type(v) ~= 'string' then
		return 0
	end
	local c = string.find(v, ':', 1, true)
	if not c then
		return 0
	end
	local out, at = 0, now * 1000
	for g, s, u in string.gmatch(string.sub(v, c + 1), '|(%d+)|(%d+)|(%d+)') do
		if tonumber(u) > at then
			out = out + tonumber(g) - tonumber(s)
		end
	end
	return out
end
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
