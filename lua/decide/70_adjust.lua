-- ADJUSTMENTS of plain buckets (op +): many keys of one zone a call, as
-- a zone with sync reconciles them.

if ARGV[2] ~= '0' then
	-- A plain adjustment of n buckets: each is charged its cost, or given
	-- -cost back, refusing nothing, up to full + beyond, as adjust charges a
	-- bucket without ban, scale or override.
	function adjusted()
		local n, s, beyond = tonumber(ARGV[a + 1]), 3 * tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
		a = a + 4
		local full, token = ps[s - 2], ps[s]
		local most, r = full + beyond, #reply
		reply[r + 1] = 1
		for i = 1, n do
			local h, field, cost = KEYS[k], ARGV[a], tonumber(ARGV[a + 1])
			a, k = a + 2, k + 1
			local v, name, bad = load(h, field)
			local d, moved, nothing = 0, false, false -- moved or not, it is written
			if v then
				d, moved, nothing = owed(v, name, full, token, full, false, 0)
			end
			if bad or nothing then
				reply[2] = reply[2] + 1
			end
			local debt = math.min(math.max(d, 0), most)
			if cost >= 0 then
				debt = math.min(debt + cost, most)
			else
				debt = math.max(debt + cost, 0)
			end
			save(h, field, name, debt, '')
			reply[r + 1 + i] = debt
		end
	end
end
