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
-- ARGV[4i-1]   full_i: µs to refill KEYS[i] from empty (burst / rate)
-- ARGV[4i]     cost_i: µs the request's tokens are worth (cost / rate)
-- ARGV[4i+1]   ban_i: µs a denial bans KEYS[i] for; 0 for no ban
-- ARGV[4i+2]   delay_i: µs a request may wait for KEYS[i]'s tokens; 0 for
--              none (never with a ban). Negative: the zone's delay is
--              -delay_i, but this request may not wait (take as if 0)
--
-- take    charges every bucket or none (all-or-nothing): a bucket gives
--         cost_i if it would hold it within delay_i (the request then
--         waits out debt_i - full_i); when it denies, each bucket with a
--         ban that lacked the tokens and was not banned yet is banned: it
--         owes ban_i + full_i
-- refund  gives cost_i back to every bucket that is not banned, undoing
--         an earlier take
-- peek    changes nothing
--
-- A bucket owes at most full_i + ban_i + delay_i; with a ban, one that
-- owes more than full_i is banned for the excess.
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

local n = #KEYS
local reply = { 1 }
local bad = {}
local repaired = 0
local short = {}
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
	-- A clock that went back must not leave more than a whole bucket
	-- and a ban or a delay owed.
	local debt = math.min(math.max(f - now, 0), full + ban + delay)
	if mode == 'refund' then
		save(KEYS[i], debt)
	elseif mode == 'take' and debt + cost > full + wait + slack then
		reply[1] = 0
		short[i] = ban > 0 and debt <= full
	end
	reply[i + 1] = debt
end

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
return reply
