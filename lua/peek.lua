-- Reads buckets, counters and slot sets as the decision script
-- (lua/decide/) would find them, changing nothing: for the admin
-- API. It reads one decision, whose op is 'peek': KEYS and ARGV are as
-- the decision script's for a call of that one decision (ARGV[1] the
-- clock, ARGV[2] '1' and ARGV[3] '0', ARGV[4] 'peek', then nb, nc, ns
-- and the sections), and so is the reply's layout:
--
--   {clock, repaired, 1, debt_1, 0, token_1, burst_1, ..., used_1, left_1, 0, ..., 0, free_1, ...}
--
-- where debt_i is what bucket i owes, at most full + ban + beyond (of its
-- override when it has one: token_i and burst_i, else 0 and 0; a bucket
-- of a zone with a fixed limit carried over to it, as the decision script
-- would carry it; a scaled one as written, under whichever plan), used_j
-- counter j's count in the window that holds Redis's clock (0 when it
-- has none) and left_j how long until that window ends, free_j how many
-- slots of set j no live lease holds, and repaired the keys of another
-- type (read as full, or empty).

local epoch = 1735689600000000 -- 2025-01-01T00:00:00Z, in µs since 1970

local clock = tonumber(ARGV[1])
if not clock then
	local t = redis.call('TIME')
	clock = t[1] * 1000000 + t[2]
end
local now = clock - epoch
local nb, nc, ns = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cargs, sargs = 7 + 9 * nb, 7 + 9 * nb + 7 * nc
local reply = { clock, 0, 1 }

local function bad()
	reply[2] = reply[2] + 1
end

for i = 1, nb do
	local a = 9 * i - 1
	local full, token = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 7])
	local otoken, oburst = 0, 0
	local o = KEYS[2 * i] ~= KEYS[2 * i - 1] and redis.pcall('GET', KEYS[2 * i])
	if type(o) == 'string' then
		local c = string.find(o, ':', 1, true)
		local e = c and string.find(o, ':', c + 1, true)
		local t, b = c and tonumber(string.sub(o, 1, c - 1)), e and tonumber(string.sub(o, c + 1, e - 1))
		if t and b and t > 0 and b > 0 then
			otoken, oburst, full = t, b, t * b
		end
	end
	local v = redis.pcall('HGET', KEYS[2 * i - 1], ARGV[a])
	local d = 0
	if type(v) == 'table' then
		bad()
	elseif v then
		local c, sf, st = string.find(v, ':', 1, true), nil, nil
		if c then
			local r = string.sub(v, c + 1)
			v = string.sub(v, 1, c - 1) -- as written, under whichever plan
			local e = string.find(r, ':', 1, true)
			if e then
				sf, st = tonumber(string.sub(r, 1, e - 1)), tonumber(string.sub(r, e + 1))
			end
		end
		local x, frac = tonumber(v), tonumber(string.sub(v, -3))
		if x and frac and x >= 0 and x % 1 == 0 then
			d = (math.floor((x - frac) / 1000 + 0.5) - now) * 1000 + frac
		else
			bad()
		end
		if d > 0 and ARGV[a + 6] ~= '1' and (st or otoken > 0) then
			local f0, t0 = tonumber(ARGV[a + 1]), token
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
				d = y + d - part
			end
		end
	end
	local most = full + ARGV[a + 3] + ARGV[a + 4]
	reply[4 * i], reply[4 * i + 1], reply[4 * i + 2], reply[4 * i + 3] = math.min(math.max(d, 0), most), 0, otoken, oburst
end

for j = 1, nc do
	local a = cargs + 7 * (j - 1)
	local e = tonumber(ARGV[a + 6]) -- the window that holds the clock, or the last
	for b = a + 4, a + 6 do
		if clock < tonumber(ARGV[b]) then
			e = tonumber(ARGV[b])
			break
		end
	end
	local v = redis.pcall('HMGET', KEYS[2 * nb + 2 * j - 1], 'w', 'n')
	local used = 0
	if v.err then
		bad()
	else
		local w = tonumber(v[1])
		if w and w * 1000 >= e then
			e, used = w * 1000, tonumber(v[2]) or 0
		elseif not w then -- what the untagged key counted in this window, as the decision script reads it
			local u = redis.pcall('HMGET', KEYS[2 * nb + 2 * j], 'w', 'n')
			if not u.err and tonumber(u[1]) and tonumber(u[1]) * 1000 == e then
				used = tonumber(u[2]) or 0
			end
		end
	end
	reply[1 + 4 * nb + 3 * j], reply[2 + 4 * nb + 3 * j], reply[3 + 4 * nb + 3 * j] = used, math.max(e - clock, 0) * 1000, 0
end

for j = 1, ns do
	local key, used = KEYS[2 * nb + 2 * nc + j], 0
	if redis.call('TYPE', key).ok == 'zset' then
		used = redis.call('ZCOUNT', key, '(' .. now, '+inf')
	end
	reply[2 + 4 * nb + 3 * nc + 2 * j], reply[3 + 4 * nb + 3 * nc + 2 * j] = 0, math.max(ARGV[sargs + 3 * j - 1] - used, 0)
end

return reply
