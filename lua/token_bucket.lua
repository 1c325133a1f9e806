-- Token buckets kept as one number each: the instant the bucket is full
-- again, on Redis's own clock, so every Caddy instance that shares this
-- Redis shares one clock. An absent key is a full bucket: keys
-- expire exactly when their bucket has refilled.
--
-- Instants count from 2025-01-01, in whole nanoseconds. The script never
-- holds one in a double: Redis's clock is whole microseconds, and a bucket
-- read is turned into what it owes from now, a duration that a double
-- holds to far below a nanosecond. So a bucket is written back exact to
-- the nanosecond, and never drifts, however many requests it serves. A
-- bucket may give its tokens up to 1 µs early, which absorbs what
-- rounding is left.
--
-- Buckets live many to a Redis hash, which costs Redis about a fifth of
-- a key each: KEYS[i] is `<hash><field>`, the hash's name ending at its
-- first '}' (`<prefix>{<group>}`), so that KEYS[i] has the hash's slot.
-- A bucket is a field, its instant a whole number of nanoseconds since
-- the epoch, in decimal (Redis keeps it as an integer). A hash expires
-- when the last of its buckets is full; until then a bucket that is full
-- again stays (it carries no information), and every new bucket removes
-- any such among three others taken at random, which keeps them to about
-- a third of a hash.
--
-- KEYS[i]      buckets (in one cluster slot), i = 1..n; after them come
--              mq quota keys and ms slot keys (see their sections)
-- ARGV[1]      "take", "refund", "peek" or "release"; or a number k > 1:
--              k takes of one request, one after another (see below)
-- ARGV[2]      "" to read TIME. Caddy always sends ""; tests send an
--              instant (whole µs since 1970) to replay a table of steps.
-- ARGV[4i-1]   full_i: µs to refill KEYS[i] from empty (burst / rate)
-- ARGV[4i]     cost_i: µs the request's tokens are worth (cost / rate)
-- ARGV[4i+1]   ban_i: µs a denial bans KEYS[i] for; 0 for no ban
-- ARGV[4i+2]   delay_i: µs a request may wait for KEYS[i]'s tokens; 0 for
--              none (never with a ban). Negative: the zone's delay is
--              -delay_i, but this request may not wait (take as if 0)
-- ARGV[#ARGV]  ms: the number of slot keys, 0 for none (slot section)
--
-- take    charges every bucket or none (all-or-nothing): a bucket gives
--         cost_i if it would hold it within delay_i (the request then
--         waits out debt_i - full_i); when it denies, each bucket with a
--         ban that lacked the tokens and was not banned yet is banned: it
--         owes ban_i + full_i
-- refund  gives cost_i back to every bucket that is not banned, undoing
--         an earlier take
-- peek    changes nothing
-- release gives back the slots of id (slot section); no buckets
--
-- A bucket owes at most full_i + ban_i + delay_i; with a ban, one that
-- owes more than full_i is banned for the excess. take saves a bucket
-- found owing more (its key's plan changed to a smaller limit) as owing
-- just that: from then on an empty bucket of the request's limit.
--
-- Returns {allowed (1|0), debt_1, ..., debt_n[, repaired[, bans]]}, where
-- debt_i is how long in nanoseconds (rounded, half up) until KEYS[i] is
-- full again after the decision. Only take returns 0.
--
-- k takes decide k requests that arrived together with the same buckets
-- and arguments, in order, at one instant, as k calls would if Redis's
-- clock stood still: the first that a bucket lacks the tokens for is
-- denied, and so is every one after it. Only for buckets without ban or
-- delay, and no quota or slot keys. Returns {m, debt_1, ..., debt_n,
-- cost_1, ..., cost_n[, repaired]}: m were allowed, debt_i is KEYS[i]'s
-- after them (ns, as take's), and cost_i is a take's in ns, so that the
-- j-th allowed owes debt_i - (m - j) cost_i, as it would have alone.
--
-- A bucket key that holds another type (or a value that is not an
-- instant) is taken for a full bucket, and overwritten or deleted by take
-- and refund; repaired is the number of such keys. bans, present when
-- this call started a ban, is a string of n flags, '1' for each key whose
-- ban it started (repaired, then maybe 0, comes before it). With slot
-- keys, the reply ends with one more element, the slot section's reply.
--
-- Calendar quotas, a section of their own: a counter per key and window
-- (a day, a week or a month in a time zone), decided in the same call,
-- all or nothing with the buckets. Lua knows no time zones, so Caddy
-- computes, by its own clock and in the zone's time zone, the window
-- that holds its now, [b1, b2), with the one before, [b0, b1), and the
-- one after, [b2, b3). The script takes Redis's TIME (or ARGV[2]) and
-- picks the one of the three that holds it: the one before when Caddy's
-- clock is ahead, across a boundary Redis's has not reached, the one
-- after when it is behind. So every instance counts in the window of
-- Redis's one clock, whatever its own clock's skew up to a whole window;
-- a TIME outside the three is an error, which fail_mode decides. Only
-- boundaries travel, never an instant that decides: no instance can move
-- a window by its clock.
--
-- A counter is a hash {w = its window's end, n = its count}, expiring at
-- w (PEXPIREAT): a counter of an ended window, or none, is 0. The window
-- is held in the key rather than named by it, so a key is one key per
-- client whatever the window, and a window of a counter found older than
-- the picked one starts again from 0.
--
-- KEYS[n+j]         quota counter keys, j = 1..mq, after the n bucket
--                   keys (and before the slot keys)
-- ARGV[top]         mq, the number of quota keys (always sent, 0 for
--                   none), just before the slot section: top is #ARGV - 1
--                   without slot keys, #ARGV - 2 - 3ms with ms of them
-- ARGV[a+1 .. a+6]  for quota j, where a = top - 1 - 6(mq - j + 1):
--                   limit_j, cost_j, b0_j, b1_j, b2_j, b3_j (ms since 1970)
--
-- take    a quota that lacks cost_j refuses (reply[1] = 0, nothing
--         charged); an allowed request adds cost_j to every counter
-- refund  takes cost_j off a counter of the window that holds now
-- peek    changes nothing
--
-- With mq > 0 the reply always has repaired and bans (an empty string
-- when no ban started), then for each quota j its count after the
-- decision and the milliseconds until its window ends (before the slot
-- section's reply, which is always last).

local epoch = 1735689600 -- 2025-01-01T00:00:00Z, in seconds
local slack = 1 -- µs

-- The script runs once per decision, and Redis pays for every function
-- and table it makes: the common path (buckets only) makes no function
-- and two tables, and the quota and slot sections run only for calls
-- that have such keys.

local mode = ARGV[1]
local now = tonumber(ARGV[2])
if now then
	now = now - epoch * 1000000
else
	local t = redis.call('TIME')
	now = (t[1] - epoch) * 1000000 + t[2]
end
local k = tonumber(mode) -- k takes, or nil
if k then
	mode = 'take'
end
local take = mode == 'take'

local ms = tonumber(ARGV[#ARGV]) or 0 -- slot keys, the last of KEYS
local qtop = ms > 0 and #ARGV - 2 - 3 * ms or #ARGV - 1
local mq = tonumber(ARGV[qtop]) or 0 -- quota keys, before the slot keys
local n = #KEYS - mq - ms

-- Calendar quotas, decided before the buckets charge anything.
local qnow, qdeny, qbad = 0, false, 0
local qkeys, qused, qend, qcost, qstale
if mq > 0 then
	qnow = math.floor(now / 1000) + epoch * 1000 -- ms since 1970
	qkeys, qused, qend, qcost, qstale = {}, {}, {}, {}, {}
	for j = 1, mq do
		local a = qtop - 1 - 6 * (mq - j + 1)
		local limit, cost = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
		local e
		if qnow >= tonumber(ARGV[a + 3]) then
			for t = 4, 6 do
				local b = tonumber(ARGV[a + t])
				if qnow < b then
					e = b
					break
				end
			end
		end
		if not e then
			return redis.error_reply('ERR quota window: Redis TIME is outside the windows Caddy sent (clocks more than a window apart)')
		end
		local key = KEYS[n + j]
		local v = redis.pcall('HMGET', key, 'w', 'n')
		local w, used = nil, 0
		if type(v) == 'table' and v.err then
			qbad = qbad + 1
			if mode ~= 'peek' then
				redis.call('DEL', key)
			end
		else
			w, used = tonumber(v[1]), tonumber(v[2]) or 0
		end
		if w and w >= e then
			e = w -- a window Redis's clock already counted in
		else
			used, qstale[j] = 0, true
		end
		if take and used + cost > limit then
			qdeny = true
		end
		qkeys[j], qused[j], qend[j], qcost[j] = key, used, e, cost
	end
end

-- Buckets: each is read, and what the call does to it decided, before
-- any is written. A bucket's state is its hash, field and flag: flag is
-- 'bad' (it held no instant, or its hash was of another type: a full
-- bucket, repaired), 'short' (it lacked the tokens and starts a ban),
-- 'clamped' (it owed more than it may) or nil.
local reply = { 1, 0 }
local state = { false, false, false } -- hash, field and flag of bucket i at 3i-2, 3i-1, 3i
local wrong -- the hashes found of another type, deleted before a write
for i = 1, n do
	local a = 4 * i - 1
	local full, cost, ban, delay = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
	local wait = math.max(delay, 0) -- how long this request may wait
	delay = math.abs(delay)
	local key = KEYS[i]
	local e = string.find(key, '}', 1, true) or #key
	local h, field = string.sub(key, 1, e), string.sub(key, e + 1)
	local v = redis.pcall('HGET', h, field)
	local d, flag = 0, nil -- µs the bucket owes: an absent one owes none
	if type(v) == 'table' then
		wrong = wrong or {}
		wrong[h], flag = true, 'bad'
	elseif v then
		-- The instant is whole nanoseconds. x, their double, is within
		-- a few hundred of them until 2098, so its microseconds come out
		-- exact once the last three digits are taken off and rounded.
		local x, ns = tonumber(v), tonumber(string.sub(v, -3))
		if x and ns and x >= 0 and x % 1 == 0 then
			d = (math.floor((x - ns) / 1000 + 0.5) - now) + ns / 1000
		else
			flag = 'bad'
		end
	end
	if mode == 'refund' and d > 0 and d <= full + delay then
		d = d - cost
	end
	-- A clock that went back, or a plan that changed to a smaller limit,
	-- must not leave more than a whole bucket and a ban or a delay owed.
	local debt = math.min(math.max(d, 0), full + ban + delay)
	if d > full + ban + delay then
		flag = 'clamped'
	end
	if take and debt + cost > full + wait + slack then
		reply[1] = 0
		if ban > 0 and debt <= full then
			flag = flag == 'bad' and 'bad short' or 'short'
		end
	end
	reply[i + 1] = debt
	state[3 * i - 2], state[3 * i - 1], state[3 * i] = h, field, flag
end

if qdeny then
	reply[1] = 0 -- a quota refuses: no bucket is charged
end

-- k takes: the first m that every bucket holds are allowed. reply keeps
-- the debts before the last of them, which the writes below charge as a
-- take's.
local m
if k then
	m = 0
	local d, cost, full = {}, {}, {}
	for i = 1, n do
		d[i], cost[i], full[i] = reply[i + 1], tonumber(ARGV[4 * i]), ARGV[4 * i - 1] + slack
	end
	while m < k do
		local room = true
		for i = 1, n do
			room = room and d[i] + cost[i] <= full[i]
		end
		if not room then
			break -- this one is denied, and so is every one after it
		end
		for i = 1, n do
			reply[i + 1], d[i] = d[i], d[i] + cost[i]
		end
		m = m + 1
	end
	reply[1] = m > 0 and 1 or 0
end

-- Slots of the zones with concurrency, kept apart from the buckets: a
-- sorted set per key, whose members are the requests holding a slot and
-- whose scores are the instants (µs, as the buckets') their leases end.
-- A lease that has ended is a slot free again, whatever became of the
-- instance that took it; the key itself expires with its last lease.
--
-- KEYS[n+mq+j]         slot keys, j = 1..ms (in the buckets' cluster slot)
-- ARGV[s+3j-2]         limit_j: how many slots KEYS[n+mq+j] has
-- ARGV[s+3j-1]         lease_j: µs a slot is held at most
-- ARGV[s+3j]           dry_j: '1' when a full KEYS[n+mq+j] does not refuse
--                      the request (dry run)
-- ARGV[#ARGV-1]        id: the request's member, unique among instances
-- ARGV[#ARGV]          ms
-- where s = #ARGV - 2 - 3ms.
--
-- take     takes a slot of every key when the buckets allow, or none
--          when one that is not dry is full; a dry key that is full is
--          left as it is
-- peek     changes nothing
-- release  removes id from every key
--
-- The section's reply is {held, free_1, ..., free_ms}: held is a string
-- of ms flags, '1' for each key where id now holds a slot; free_j is how
-- many slots of KEYS[n+mq+j] are free after the decision. A key that is
-- full shows 0 free and no slot held.
local slot_base = #ARGV - 2 - 3 * ms
local slots_used = ms > 0 and {} or nil
for j = 1, ms do
	-- Count the live leases of every slot key, trimming the ended ones,
	-- and refuse the request when a key that is not dry is full and the
	-- buckets allowed it.
	local key = KEYS[n + mq + j]
	local used = 0
	if take then
		-- A key of another type is taken for a key with no slot held,
		-- and deleted: the keys under the prefix are ours.
		local trimmed = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
		if type(trimmed) == 'table' and trimmed.err then
			redis.call('DEL', key)
		end
		used = redis.call('ZCARD', key)
	elseif mode == 'peek' and redis.call('TYPE', key).ok == 'zset' then
		used = redis.call('ZCOUNT', key, '(' .. now, '+inf')
	end
	if take and reply[1] == 1 and used >= tonumber(ARGV[slot_base + 3 * j - 2]) and ARGV[slot_base + 3 * j] ~= '1' then
		reply[1] = 0
	end
	slots_used[j] = used
end

-- Buckets: write. A bucket that owes debt µs is saved as the instant
-- now + debt, rounded to whole nanoseconds, written as the microseconds
-- (now's, which are whole, and debt's) then three digits of nanoseconds.
-- debt <= 0 deletes the bucket. A hash of another type is deleted first.
-- Any other error (a Redis out of memory) ends the script, before it has
-- written anything.
local nowdigits -- now in the instants' digits, for purges
local bans, banned = '', false
local repaired = 0
for i = 1, n do
	local flag = state[3 * i]
	local debt = reply[i + 1]
	local write = true
	if mode == 'refund' then
		-- debt as it is: the tokens were given back above
	elseif take and reply[1] == 1 then
		debt = debt + ARGV[4 * i]
	elseif flag == 'short' or flag == 'bad short' then
		debt = ARGV[4 * i - 1] + ARGV[4 * i + 1]
		banned = true
	elseif take and flag == 'clamped' then
		-- saved as owing no more than it may
	elseif take and flag == 'bad' then
		debt = 0 -- a full bucket: no field
	else
		write = false
	end
	if write then
		local h, field = state[3 * i - 2], state[3 * i - 1]
		if wrong and wrong[h] then
			redis.call('DEL', h)
			wrong[h] = nil
		end
		if debt <= 0 then
			redis.call('HDEL', h, field)
		else
			local us = math.floor(debt)
			local ns = math.floor((debt - us) * 1000 + 0.5)
			if ns == 1000 then
				us, ns = us + 1, 0
			end
			local added = redis.call('HSET', h, field, string.format('%d%03d', now + us, ns))
			local ttl = math.ceil(debt / 1000)
			local left = redis.call('PTTL', h) -- -1: HSET made the hash
			if left < ttl then
				redis.call('PEXPIRE', h, ttl)
			end
			if added == 1 and left >= 0 then
				-- A new bucket in a hash that has others: remove the
				-- buckets full again among three of the hash's, taken at
				-- random. Instants of as many digits compare as strings.
				if not nowdigits then
					nowdigits = string.format('%d000', math.floor(now))
				end
				local r = redis.call('HRANDFIELD', h, 3, 'WITHVALUES')
				for j = 2, #r, 2 do
					local w = r[j]
					if #w < #nowdigits or #w == #nowdigits and w <= nowdigits then
						redis.call('HDEL', h, r[j - 1])
					end
				end
			end
		end
	end
	if flag == 'bad' or flag == 'bad short' then
		repaired = repaired + 1
	end
	-- Whole nanoseconds, as Redis replies integers: at most 100 years
	-- (the longest burst), well within its 64 bits.
	local ns = debt * 1000
	reply[i + 1] = math.floor(ns) + (ns % 1 >= 0.5 and 1 or 0)
end
if banned then
	for i = 1, n do
		local flag = state[3 * i]
		bans = bans .. ((flag == 'short' or flag == 'bad short') and '1' or '0')
	end
end
if repaired > 0 and mode ~= 'peek' or banned then
	reply[n + 2] = repaired
end
if banned then
	reply[n + 3] = bans
end
if m then
	-- k takes: {m, debt_1..debt_n after them, cost_1..cost_n in ns[,
	-- repaired]}; take j <= m owes debt_i - (m - j) cost_i.
	local out = { m }
	for i = 1, n do
		out[i + 1], out[n + i + 1] = reply[i + 1], math.floor(ARGV[4 * i] * 1000 + 0.5)
	end
	if repaired > 0 then
		out[2 * n + 2] = repaired
	end
	return out
end

-- Calendar quotas: count, and reply.
if mq > 0 then
	reply[n + 2] = repaired + qbad
	reply[n + 3] = bans
	for j = 1, mq do
		local key, used, e = qkeys[j], qused[j], qend[j]
		if take and reply[1] == 1 then
			used = used + qcost[j]
			if qstale[j] then
				redis.call('HSET', key, 'w', e, 'n', used)
			else
				redis.call('HINCRBY', key, 'n', qcost[j])
			end
			redis.call('PEXPIREAT', key, e)
		elseif mode == 'refund' and not qstale[j] and used > 0 then
			used = math.max(used - qcost[j], 0)
			if used == 0 then
				redis.call('DEL', key)
			else
				redis.call('HSET', key, 'n', used)
			end
		end
		reply[n + 2 + 2 * j] = used
		reply[n + 3 + 2 * j] = e - qnow
	end
end

-- Slots: take or give back, and reply.
if ms > 0 then
	local slot_id = ARGV[#ARGV - 1]
	local held, out = {}, {}
	for j = 1, ms do
		local key, limit = KEYS[n + mq + j], tonumber(ARGV[slot_base + 3 * j - 2])
		local used = slots_used[j]
		held[j] = '0'
		if mode == 'release' then
			redis.call('ZREM', key, slot_id)
		elseif take and reply[1] == 1 and used < limit then
			local lease = tonumber(ARGV[slot_base + 3 * j - 1])
			redis.call('ZADD', key, now + lease, slot_id)
			used = used + 1
			held[j] = '1'
			-- The key lives as long as its longest lease.
			local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
			redis.call('PEXPIRE', key, math.max(math.ceil((tonumber(last[2]) - now) / 1000), 1))
		end
		out[j + 1] = math.max(limit - used, 0)
	end
	out[1] = table.concat(held)
	reply[#reply + 1] = out
end
return reply
