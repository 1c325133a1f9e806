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
-- ARGV[1+2i]   full_i: µs to refill KEYS[i] from empty (burst / rate)
-- ARGV[2+2i]   cost_i: µs the request's tokens are worth (cost / rate)
--
-- take    charges every bucket or none (all-or-nothing)
-- refund  gives cost_i back to every bucket, undoing an earlier take
-- peek    changes nothing
--
-- Returns {allowed (1|0), debt_1, ..., debt_n}, where debt_i is how long in
-- µs until KEYS[i] is full again after the decision, as a string (Redis
-- truncates Lua numbers to integers). Only take returns 0.

local epoch = 1735689600 -- 2025-01-01T00:00:00Z, in seconds
local slack = 1 -- µs

local mode = ARGV[1]
local now = tonumber(ARGV[2])
if now then
	now = now - epoch * 1000000
else
	local t = redis.call('TIME')
	now = (tonumber(t[1]) - epoch) * 1000000 + tonumber(t[2])
end

local function store(key, f)
	if f <= now then
		redis.call('DEL', key)
	else
		redis.call('SET', key, string.format('%.17g', f), 'PX', math.ceil((f - now) / 1000))
	end
end

local n = #KEYS
local full, cost, debt = {}, {}, {}
local allowed = 1
for i = 1, n do
	full[i] = tonumber(ARGV[1 + 2 * i])
	cost[i] = tonumber(ARGV[2 + 2 * i])
	local f = tonumber(redis.call('GET', KEYS[i])) or now
	if mode == 'refund' and f > now then
		f = f - cost[i]
	end
	-- A clock that went back must not leave more than a whole bucket owed.
	debt[i] = math.min(math.max(f - now, 0), full[i])
	if mode == 'refund' then
		store(KEYS[i], now + debt[i])
	elseif mode == 'take' and debt[i] + cost[i] > full[i] + slack then
		allowed = 0
	end
end

local reply = { allowed }
for i = 1, n do
	if mode == 'take' and allowed == 1 then
		debt[i] = debt[i] + cost[i]
		store(KEYS[i], now + debt[i])
	end
	reply[i + 1] = string.format('%.17g', debt[i])
end
return reply
