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
-- KEYS[i]      buckets (in one cluster slot)
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

local n = #KEYS
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
return reply
