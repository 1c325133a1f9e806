-- THE DISPATCH: the decisions in order, then each bucket written once.

while a <= #ARGV do
	local op = ARGV[a]
	local n = op == '1' and 1 or tonumber(op)
	if n then
		a = a + 1
		plain(n)
	elseif op == '*' then
		a = a + 2
		plain(1, tonumber(ARGV[a - 1]))
	elseif op == '+' then
		adjusted()
	elseif op == 'release' then
		release()
	elseif op == 'share' then
		share()
	else
		general(op)
	end
end

-- The buckets written, each once. A hash of another type is deleted
-- first.
for i = 1, #order, 3 do
	local name, h, field = order[i], order[i + 1], order[i + 2]
	if wrong and wrong[h] then
		redis.call('DEL', h)
		wrong[h] = nil
	end
	write(h, field, values[name], saved[name])
end

return reply
