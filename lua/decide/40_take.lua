-- TAKE AND ADJUST: the decisions of buckets, counters and slot sets
-- (ops take and adjust), in phases: the counters are read and decided,
-- then the buckets, then the slot sets are counted, all before anything
-- is written; then the buckets are saved, the counters counted and the
-- slots taken. A decision's state, for its phases, is in the locals
-- below; its phases are in this file (buckets), counters.lua and
-- slots.lua.
--
-- The functions of the other decisions than plain takes are made only by
-- a call that holds one: Redis pays for each function a call makes,
-- whatever it runs.

local general, release, adjusted -- the ops take and adjust, release, +
local readCounters, writeCounters, countSlots, takeSlots, readBuckets, saveBuckets -- their phases

-- The decision general decides.
local take, adjust -- its op
local nb, nc, ns -- its numbers of buckets, counters and slot sets
local ab, kb -- bucket i's values are ARGV[ab + 9(i-1) ..], its keys KEYS[kb + 2(i-1) ..]
local ac, kc -- counter j's: ARGV[ac + 7(j-1) ..], KEYS[kc + 2(j-1) ..]
local as, ks -- the id is ARGV[as]; set j's: ARGV[as + 1 + 3(j-1) ..], KEYS[ks + j - 1]
local r, cr, sr -- its results are reply[r + 1 ..]; counter j's reply[cr + 3j - 2 ..], set j's reply[sr + 2j - 1 ..]
local allowed -- the take is allowed, as far as decided
local lacked -- the soft buckets without the tokens, by index (made when one is)
local names -- the buckets' names in values, by index
local cused, cend, cstale, cshort -- each counter's count, its window's end, whether it is written whole; the soft counters without the units
local sused -- each slot set's leases in use

if ARGV[2] ~= '0' then
	-- A take or an adjustment of buckets, counters and slot sets.
	function general(op)
		take, adjust = op == 'take', op == 'adjust'
		nb, nc, ns = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
		ab, kb = a + 4, k
		ac, kc = ab + 9 * nb, kb + 2 * nb
		as, ks = ac + 7 * nc, kc + 2 * nc
		a, k = as + (ns > 0 and 1 + 3 * ns or 0), ks + ns
		r = #reply
		for i = r + 1, r + 1 + 4 * nb + 3 * nc + 2 * ns do
			reply[i] = 0
		end
		reply[r + 1] = 1
		cr, sr = r + 1 + 4 * nb, r + 1 + 4 * nb + 3 * nc
		lacked = nil
		if not readCounters() then
			return
		end
		readBuckets()
		allowed = reply[r + 1] == 1
		countSlots()
		saveBuckets()
		writeCounters()
		takeSlots()
	end

	-- readBuckets reads and decides the buckets, before anything is
	-- written. Until the writes, reply[r + 4i - 2 .. r + 4i + 1] hold
	-- bucket i's debt, its state, and the token and burst of its override
	-- (0 and 0 for none); its state is 1 short (it lacked the tokens, and its ban starts),
	-- plus 2 moved (it owed more than it may, or was written under
	-- another limit), plus 4 bad (it held no instant, or its hash was of
	-- another type). The reads leave each bucket's full, cost, ban and
	-- beyond in ARGV as numbers, an override's full and cost in place of
	-- the shape's, and its name in names, for the writes.
	function readBuckets()
		names = {}
		for i = 1, nb do
			local x, h = ab + 9 * (i - 1), KEYS[kb + 2 * (i - 1)]
			local full, cost, ban, beyond = tonumber(ARGV[x + 1]), tonumber(ARGV[x + 2]), tonumber(ARGV[x + 3]), tonumber(ARGV[x + 4])
			local shapefull, token, wait = full, tonumber(ARGV[x + 7]), tonumber(ARGV[x + 5])
			local otoken, oburst = 0, 0
			local okey = KEYS[kb + 2 * (i - 1) + 1]
			local o = okey ~= h and redis.pcall('GET', okey)
			if type(o) == 'string' then
				local c = string.find(o, ':', 1, true)
				local e = c and string.find(o, ':', c + 1, true)
				local t, b = c and tonumber(string.sub(o, 1, c - 1)), e and tonumber(string.sub(o, c + 1, e - 1))
				if t and b and t > 0 and b > 0 then
					if t ~= token then
						cost = cost / token * t
					end
					otoken, oburst, full = t, b, t * b
					if wait < 0 then
						-- A reserve is the same share of the key's own bucket.
						wait = -math.floor(-wait / shapefull * full)
					end
				end
			end
			local v, name, bad = load(h, ARGV[x])
			local d, moved, nothing = owed(v, name, full, token, shapefull, ARGV[x + 6] == '1', otoken)
			local state = (bad or nothing) and 4 or 0
			local most = full + ban + beyond
			local debt = math.min(math.max(d, 0), most)
			if moved or d > most then
				state = state + 2
			end
			if take and (debt + cost > full + wait or cost > full) then
				-- A cost above the whole bucket (a key's own burst below a
				-- cost that comes with each request) is never there, and its
				-- refusal bans no one.
				if ARGV[x + 8] == '1' then
					lacked = lacked or {}
					lacked[i] = true
				else
					reply[r + 1] = 0
				end
				if ban > 0 and debt <= full and cost <= full then
					state = state + 1
				end
			end
			local y = r + 4 * i - 2
			reply[y], reply[y + 1], reply[y + 2], reply[y + 3] = debt, state, otoken, oburst
			ARGV[x + 1], ARGV[x + 2], ARGV[x + 3], ARGV[x + 4], names[i] = full, cost, ban, beyond, name
		end
	end

	-- saveBuckets saves the buckets: one that owes debt as the instant now
	-- + debt; debt <= 0 deletes it.
	function saveBuckets()
		for i = 1, nb do
			local x, y = ab + 9 * (i - 1), r + 4 * i - 2
			local debt, state = reply[y], reply[y + 1]
			local short = state % 2 == 1
			local write = true
			local full, cost, ban = ARGV[x + 1], ARGV[x + 2], ARGV[x + 3]
			if adjust then
				if cost >= 0 then
					debt = math.min(debt + cost, full + ban + ARGV[x + 4])
				elseif ban == 0 or debt <= full then
					debt = math.max(debt + cost, 0)
				else
					write = state >= 2 -- banned: only a repair
				end
			elseif take and allowed and not (lacked and lacked[i]) then
				debt = debt + cost
			elseif short then
				debt = full + ban
			elseif not take or state < 2 then
				write = false -- else saved as read: moved, or a bad one as full
			end
			if write then
				local suffix = ''
				if ARGV[x + 6] == '1' then
					suffix = string.format(':%d', full)
				elseif reply[y + 2] > 0 then
					suffix = string.format(':%d:%d', full, reply[y + 2])
				end
				save(KEYS[kb + 2 * (i - 1)], ARGV[x], names[i], debt, suffix)
			end
			if state >= 4 then
				reply[2] = reply[2] + 1
			end
			reply[y], reply[y + 1] = debt, (short and 1 or 0) + (lacked and lacked[i] and 2 or 0)
		end
	end
end
