-- A call of one plain take of one bucket (a request that found no call
-- in flight): straight through, making no table but the reply.
if ARGV[3] == '1' and ARGV[7] == '1' and #ARGV == 9 then
	local h, field, full, cost, token = KEYS[1], ARGV[9], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
	local v = redis.pcall('HGET', h, field)
	local bad = type(v) == 'table'
	local d, moved, nothing = 0, false, false
	local out = 0
	if token < 0 then
		token, out = -token, sharedOut(h, field)
	end
	if bad then
		reply[2] = 1
	elseif v then
		d, moved, nothing = owed(v, nil, full, token, full, false, 0)
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
	local clipped = out > debt
	if clipped then
		debt = out
	end
	local ok = debt + cost <= full
	if ok then
		debt = debt + cost
	end
	if ok or bad or nothing or moved or d > full or clipped then
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
		local full, cost, token = ps[s - 2], ps[s - 1], ps[s]
		local v, name, bad = load(h, field)
		local d, moved, nothing = 0, false, false
		local out = 0
		if token < 0 then
			token, out = -token, sharedOut(h, field)
		end
		if v then
			d, moved, nothing = owed(v, name, full, token, full, false, 0)
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
		local clipped = out > debt
		if clipped then
			debt = out
		end
		ok = ok and debt + cost <= full
		pb[i + 1], pb[i + 2], pb[i + 3], pb[i + 4], pb[i + 5], pb[i + 6], pb[i + 7] = debt, cost, name, h, field,
			bad or nothing or moved or d > full or clipped, full
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
