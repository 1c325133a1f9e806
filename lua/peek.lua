-- Reads buckets, counters and slot sets as the decision script
-- (token_bucket.lua) would find them, changing nothing: for the admin
-- API. KEYS and ARGV are as the decision script's (ARGV[1] is 'peek'),
-- and so is the reply's layout:
--
--   {1, repaired, debt_1, 0, ..., used_1, left_1, ..., 0, free_1, ..., clock}
--
-- where debt_i is what bucket i owes, at most full + ban + beyond, used_j
-- counter j's count in the window that holds Redis's clock (0 when it
-- has none) and left_j how long until that window ends, free_j how many
-- slots of set j no live lease holds, and repaired the keys of another
-- type (read as full, or empty).

local epoch = 1735689600000000 -- 2025-01-01T00:00:00Z, in µs since 1970

local clock = tonumber(ARGV[2])
if not clock then
	local t = redis.call('TIME')
	clock = t[1] * 1000000 + t[2]
end
local now = clock - epoch
local nb, nc, ns = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cargs, sargs = 5 + 7 * nb, 5 + 7 * nb + 6 * tonumber(ARGV[4])
local reply = { 1, 0 }

local function bad()
	reply[2] = reply[2] + 1
end

for i = 1, nb do
	local a = 7 * i - 1
	local v = redis.pcall('HGET', KEYS[i], ARGV[a])
	local d = 0
	if type(v) == 'table' then
		bad()
	elseif v then
		local c = string.find(v, ':', 1, true)
		if c then
			v = string.sub(v, 1, c - 1) -- as written, under whichever plan
		end
		local x, frac = tonumber(v), tonumber(string.sub(v, -3))
		if x and frac and x >= 0 and x % 1 == 0 then
			d = (math.floor((x - frac) / 1000 + 0.5) - now) * 1000 + frac
		else
			bad()
		end
	end
	local most = ARGV[a + 1] + ARGV[a + 3] + ARGV[a + 4]
	reply[1 + 2 * i], reply[2 + 2 * i] = math.min(math.max(d, 0), most), 0
end

for j = 1, nc do
	local a = cargs + 6 * (j - 1)
	local e = tonumber(ARGV[a + 6]) -- the window that holds the clock, or the last
	for b = a + 4, a + 6 do
		if clock < tonumber(ARGV[b]) then
			e = tonumber(ARGV[b])
			break
		end
	end
	local v = redis.pcall('HMGET', KEYS[nb + j], 'w', 'n')
	local used = 0
	if v.err then
		bad()
	else
		local w = tonumber(v[1])
		if w and w * 1000 >= e then
			e, used = w * 1000, tonumber(v[2]) or 0
		end
	end
	reply[1 + 2 * (nb + j)], reply[2 + 2 * (nb + j)] = used, math.max(e - clock, 0) * 1000
end

for j = 1, ns do
	local key, used = KEYS[nb + nc + j], 0
	if redis.call('TYPE', key).ok == 'zset' then
		used = redis.call('ZCOUNT', key, '(' .. now, '+inf')
	end
	reply[1 + 2 * (nb + nc + j)], reply[2 + 2 * (nb + nc + j)] = 0, math.max(ARGV[sargs + 3 * j - 1] - used, 0)
end

reply[3 + 2 * (nb + nc + ns)] = clock
return reply
