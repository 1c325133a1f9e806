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
-- KEYS[i]      bucket keys (in one cluster slot)
-- ARGV[1]      "take", "refund" or "peek"
-- ARGV[2]      "" to read TIME. Caddy always sends ""; tests send an
--              instant (µs since 1970) to replay a table of steps.
-- ARGV[3i]     full_i: µs to refill KEYS[i] from empty (burst / rate)
-- ARGV[3i+1]   cost_i: µs the request's tokens are worth (cost / rate)
-- ARGV[3i+2]   ban_i: µs a denial bans KEYS[i] for; 0 for no ban
--
-- take    charges every bucket or none (all-or-nothing); when it denies,
--         each bucket with a ban that lacked the tokens and was not
--         banned yet is banned: it owes ban_i + full_i
-- refund  gives cost_i back to every bucket that is not banned, undoing
--         an earlier take
-- peek    changes nothing
--
-- A bucket owes at most full_i + ban_i; one that owes more than full_i
-- is banned for the excess.
--
-- Returns {allowed (1|0), debt_1, ..., debt_n[, repaired[, bans]]}, where
-- debt_i is how long in nanoseconds (rounded, half up) until KEYS[i] is
-- full again after the decision. Only take returns 0.
--
-- A bucket key that holds another type (or a value that is not an
-- instant) is taken for a full bucket, and overwritten or deleted by take
-- and refund; repaired is the number of such keys. bans, present when
-- this call started a ban, is a string of n flags, '1' for each key whose
-- ban it started (repaired, then maybe 0, comes before it).
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
-- KEYS[n+j]         quota counter keys, after the n bucket keys
-- ARGV[#ARGV]       m, the number of quota keys (always sent, 0 for none);
--                   the bucket keys are the other #KEYS - m
-- ARGV[a+1 .. a+6]  for quota j, where a = #ARGV - 1 - 6(m - j + 1):
--                   limit_j, cost_j, b0_j, b1_j, b2_j, b3_j (ms since 1970)
--
-- take    a quota that lacks cost_j refuses (reply[1] = 0, nothing
--         charged); an allowed request adds cost_j to every counter
-- refund  takes cost_j off a counter of the window that holds now
-- peek    changes nothing
--
-- With m > 0 the reply always has repaired and bans (an empty string
-- when no ban started), then for each quota j its count after the
-- decision and the milliseconds until its window ends.

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

-- save stores a bucket that owes debt µs. (Redis writes a Lua number
-- with 17 significant digits: no precision is lost.)
local function save(key, debt)
	if debt <= 0 then
		redis.call('DEL', key)
	else
		redis.call('SET', key, now + debt, 'PX', math.ceil(debt / 1000))
	end
end

-- load returns a bucket's instant, or nil for a full bucket; bad says the
-- key held something else.
local function load(key)
	local v = redis.pcall('GET', key)
	if type(v) == 'table' and v.err then
		return nil, true
	end
	local f = tonumber(v)
	return f, v and not f
end

-- Calendar quotas, decided before the buckets charge anything.
local m = tonumber(ARGV[#ARGV]) or 0
local n = #KEYS - m
local qnow = math.floor(now / 1000) + epoch * 1000 -- ms since 1970
local qdeny = false
local qkeys, qused, qend, qcost, qstale, qbad = {}, {}, {}, {}, {}, 0
for j = 1, m do
	local a = #ARGV - 1 - 6 * (m - j + 1)
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
for i = 1, n do
	local full, cost, ban = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
	local f
	f, bad[i] = load(KEYS[i])
	f = f or now
	if mode == 'refund' and f > now and f - now <= full then
		f = f - cost
	end
	-- A clock that went back must not leave more than a whole bucket
	-- and a ban owed.
	local debt = math.min(math.max(f - now, 0), full + ban)
	if mode == 'refund' then
		save(KEYS[i], debt)
	elseif mode == 'take' and debt + cost > full + slack then
		reply[1] = 0
		short[i] = ban > 0 and debt <= full
	end
	reply[i + 1] = debt
end

if qdeny then
	reply[1] = 0 -- a quota refuses: no bucket is charged
end

local bans, banned = {}, false
for i = 1, n do
	local debt = reply[i + 1]
	if mode == 'take' and reply[1] == 1 then
		debt = debt + ARGV[3 * i + 1]
		save(KEYS[i], debt)
	elseif short[i] then
		debt = ARGV[3 * i] + ARGV[3 * i + 2]
		save(KEYS[i], debt)
		banned = true
	elseif bad[i] and mode == 'take' then
		redis.call('DEL', KEYS[i]) -- a full bucket: no key
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
if m > 0 then
	reply[n + 2] = repaired + qbad
	reply[n + 3] = banned and table.concat(bans) or ''
	for j = 1, m do
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
return reply
