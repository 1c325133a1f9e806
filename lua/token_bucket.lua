-- Token buckets kept as one number each: the instant the bucket is full
-- again, in microseconds of Redis's own clock, so every Caddy instance that
-- shares this Redis shares one clock. An absent key is a full bucket: keys
-- expire exactly when their bucket has refilled.
--
-- Instants count from 2025-01-01 rather than 1970, as redis_rate does, so
-- that Lua's doubles keep them to a hundredth of a microsecond (instead of
-- a quarter). A bucket may give its tokens up to 1 µs early, which absorbs
-- what rounding is left.
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
-- ARGV[1]      "take", "refund", "peek" or "release"
-- ARGV[2]      "" to read TIME. Caddy always sends ""; tests send an
--              instant (µs since 1970) to replay a table of steps.
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

local mode = ARGV[1]
local now = tonumber(ARGV[2])
if now then
	now = now - epoch * 1000000
else
	local t = redis.call('TIME')
	now = (t[1] - epoch) * 1000000 + t[2]
end

-- split names a bucket's hash and field.
local function split(key)
	local e = string.find(key, '}', 1, true) or #key
	return string.sub(key, 1, e), string.sub(key, e + 1)
end

-- encode writes instant f (µs) in whole nanoseconds, exactly: the
-- instants are sums of whole microseconds (TIME) and whole nanoseconds
-- (the zones' times), and f is within half a nanosecond of its sum.
-- Doubles cannot hold the nanoseconds since the epoch, so the digits are
-- written in two parts.
local function encode(f)
	local sign = ''
	if f < 0 then
		sign, f = '-', -f
	end
	local us = math.floor(f)
	local ns = math.floor((f - us) * 1000 + 0.5)
	if ns == 1000 then
		us, ns = us + 1, 0
	end
	if us == 0 then
		return sign .. string.format('%d', ns)
	end
	return sign .. string.format('%d%03d', us, ns)
end

-- decode reads what encode wrote, back to the same f; nil for anything
-- else.
local function decode(v)
	local sign, digits = string.match(v, '^(%-?)(%d+)$')
	if not digits then
		return nil
	end
	local f = (tonumber(string.sub(digits, 1, -4)) or 0) + tonumber(string.sub(digits, -3)) / 1000
	if sign == '-' then
		f = -f
	end
	return f
end

-- purge removes the buckets that are full again among three of hash h's,
-- taken at random, and any that do not hold an instant.
local function purge(h)
	local r = redis.call('HRANDFIELD', h, 3, 'WITHVALUES')
	for j = 1, #r, 2 do
		local f = decode(r[j + 1])
		if not f or f <= now then
			redis.call('HDEL', h, r[j])
		end
	end
end

-- wrong holds the hashes that load found of another type.
local wrong = {}

-- save stores a bucket that owes debt µs; debt <= 0 deletes it. A hash
-- of another type is deleted first. Any other error (a Redis out of
-- memory) ends the script, before it has written anything.
local function save(key, debt)
	local h, field = split(key)
	if wrong[h] then
		redis.call('DEL', h)
		wrong[h] = nil
	end
	if debt <= 0 then
		redis.call('HDEL', h, field)
		return
	end
	local added = redis.call('HSET', h, field, encode(now + debt))
	local ms = math.ceil(debt / 1000)
	if redis.call('PTTL', h) < ms then
		redis.call('PEXPIRE', h, ms)
	end
	if added == 1 then
		purge(h)
	end
end

-- load returns a bucket's instant, or nil for a full bucket; bad says the
-- bucket held something else, or its hash was of another type.
local function load(key)
	local h, field = split(key)
	local v = redis.pcall('HGET', h, field)
	if type(v) == 'table' and v.err then
		wrong[h] = true
		return nil, true
	end
	if not v then
		return nil, false
	end
	local f = decode(v)
	return f, not f
end

-- Calendar quotas, decided before the buckets charge anything.
local ms = tonumber(ARGV[#ARGV]) or 0 -- slot keys, the last of KEYS
local qtop = ms > 0 and #ARGV - 2 - 3 * ms or #ARGV - 1
local mq = tonumber(ARGV[qtop]) or 0 -- quota keys, before the slot keys
local n = #KEYS - mq - ms
local qnow = math.floor(now / 1000) + epoch * 1000 -- ms since 1970
local qdeny = false
local qkeys, qused, qend, qcost, qstale, qbad = {}, {}, {}, {}, {}, 0
for j = 1, mq do
	local a = qtop - 1 - 6 * (mq - j + 1)
	local limit, cost = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
	local e
	if qnow >= tonumber(ARGV[a + 3]) then
		for k = 4, 6 do
			local b = tonumber(ARGV[a + k])
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
	if mode == 'take' and used + cost > limit then
		qdeny = true
	end
	qkeys[j], qused[j], qend[j], qcost[j] = key, used, e, cost
end

local reply = { 1 }
local bad = {}
local repaired = 0
local short = {}
local clamped = {}
for i = 1, n do
	local a = 4 * i - 1
	local full, cost, ban, delay = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
	local wait = math.max(delay, 0) -- how long this request may wait
	delay = math.abs(delay)
	local f
	f, bad[i] = load(KEYS[i])
	f = f or now
	if mode == 'refund' and f > now and f - now <= full + delay then
		f = f - cost
	end
	-- A clock that went back, or a plan that changed to a smaller limit,
	-- must not leave more than a whole bucket and a ban or a delay owed.
	local debt = math.min(math.max(f - now, 0), full + ban + delay)
	clamped[i] = f - now > full + ban + delay
	if mode == 'refund' then
		save(KEYS[i], debt)
	elseif mode == 'take' and debt + cost > full + wait + slack then
		reply[1] = 0
		short[i] = ban > 0 and debt <= full
	end
	reply[i + 1] = debt
end

if qdeny then
	reply[1] = 0 -- a quota refuses: no bucket is charged
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
local slot_id = ARGV[#ARGV - 1]

local function slot_arg(j, k)
	return tonumber(ARGV[slot_base + 3 * j - 3 + k])
end

-- take_slots counts the live leases of every slot key, trimming the
-- ended ones, and refuses the request (reply[1] = 0) when a key that is
-- not dry is full and the buckets allowed it. It returns the counts.
local function take_slots()
	local used = {}
	for j = 1, ms do
		local key = KEYS[n + mq + j]
		if mode == 'take' then
			-- A key of another type is taken for a key with no slot
			-- held, and deleted: the keys under the prefix are ours.
			local trimmed = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
			if type(trimmed) == 'table' and trimmed.err then
				redis.call('DEL', key)
			end
			used[j] = redis.call('ZCARD', key)
		elseif mode == 'peek' and redis.call('TYPE', key).ok == 'zset' then
			used[j] = redis.call('ZCOUNT', key, '(' .. now, '+inf')
		else
			used[j] = 0
		end
		if mode == 'take' and reply[1] == 1 and used[j] >= slot_arg(j, 1) and ARGV[slot_base + 3 * j] ~= '1' then
			reply[1] = 0
		end
	end
	return used
end

-- commit_slots takes the slots when the request is allowed, or gives
-- them back (release), and returns the section's reply.
local function commit_slots(used)
	local held, out = {}, {}
	for j = 1, ms do
		local key, limit = KEYS[n + mq + j], slot_arg(j, 1)
		held[j] = '0'
		if mode == 'release' then
			redis.call('ZREM', key, slot_id)
		elseif mode == 'take' and reply[1] == 1 and used[j] < limit then
			local lease = slot_arg(j, 2)
			redis.call('ZADD', key, now + lease, slot_id)
			used[j] = used[j] + 1
			held[j] = '1'
			-- The key lives as long as its longest lease.
			local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
			redis.call('PEXPIRE', key, math.max(math.ceil((tonumber(last[2]) - now) / 1000), 1))
		end
		out[j + 1] = math.max(limit - used[j], 0)
	end
	out[1] = table.concat(held)
	return out
end

local slots = take_slots()

local bans, banned = {}, false
for i = 1, n do
	local debt = reply[i + 1]
	if mode == 'take' and reply[1] == 1 then
		debt = debt + ARGV[4 * i]
		save(KEYS[i], debt)
	elseif short[i] then
		debt = ARGV[4 * i - 1] + ARGV[4 * i + 1]
		save(KEYS[i], debt)
		banned = true
	elseif clamped[i] and mode == 'take' then
		save(KEYS[i], debt)
	elseif bad[i] and mode == 'take' then
		save(KEYS[i], 0) -- a full bucket: no field
	end
	if bad[i] then
		repaired = repaired + 1
	end
	bans[i] = short[i] and '1' or '0'
	-- Whole nanoseconds, as Redis replies integers: at most 100 years
	-- (the longest burst), well within its 64 bits.
	local ns = debt * 1000
	local whole = math.floor(ns)
	if ns - whole >= 0.5 then
		whole = whole + 1
	end
	reply[i + 1] = whole
end
if repaired > 0 and mode ~= 'peek' or banned then
	reply[n + 2] = repaired
end
if banned then
	reply[n + 3] = table.concat(bans)
end

-- Calendar quotas: count, and reply.
if mq > 0 then
	reply[n + 2] = repaired + qbad
	reply[n + 3] = banned and table.concat(bans) or ''
	for j = 1, mq do
		local key, used, e = qkeys[j], qused[j], qend[j]
		if mode == 'take' and reply[1] == 1 then
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
if ms > 0 then
	reply[#reply + 1] = commit_slots(slots)
end
return reply
