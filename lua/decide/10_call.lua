-- The decision script: the decisions of many requests in one atomic call.
-- Each decision is one request's token buckets, calendar quota counters
-- and concurrency slots, decided all or nothing; the decisions are taken
-- in order, each independent of the others, as separate calls at one
-- instant of Redis's clock would take them.
--
-- A bucket is kept as one number: the instant it is full again, on
-- Redis's own clock, so every Caddy instance that shares this Redis
-- shares one clock. An absent bucket is a full one: buckets expire
-- exactly when they have refilled.
--
-- THE CALL
--
--   ARGV[1]  clock: '' to read TIME; tests send an instant, to replay
--            a table of steps
--   ARGV[2]  the number of decisions that are not plain takes: '0' for
--            a call of plain takes alone, which makes none of the other
--            decisions' functions (a plain adjustment's included)
--   ARGV[3]  np, the number of plain shapes; then 3 values each: full,
--            cost, token (below; a negative token: of a zone with share,
--            see 20_buckets.lua)
--   then the decisions, one after another, each starting with its op:
--
--   n        a number: a plain take of n buckets; then 2 values each:
--            shape (its index among the plain shapes), field. KEYS: the
--            hash of each bucket.
--   *        a run of plain takes of one bucket (a flood of one key):
--            then r, the takes, and the bucket's shape and field. KEYS:
--            its hash. Decided as r plain takes of it one after another.
--   +        a plain adjustment of n buckets of one plain shape (below)
--            that may owe beyond: then n, the shape, beyond, and 2
--            values a bucket: field, cost. KEYS: the hash of each
--            bucket. Decided as an adjust of them would be.
--   take, adjust
--            then nb, nc, ns (the numbers of buckets, counters and slot
--            sets) and three sections, in that order:
--              buckets  9 values each: field, full, cost, ban, beyond,
--                       wait, scaled, token, soft (wait < 0: a
--                       reserve, below)
--              counters 7 values each: limit, cost, b0, b1, b2, b3, soft
--              slots    id, then 3 values each: limit, lease, soft
--            KEYS: the hash of each bucket and the key of its override
--            (two keys a bucket; the hash again when the caller knows
--            that no key of the zone has an override: then none is
--            read), then the key of each counter and its untagged key
--            (two keys a counter, below), then the key of each slot set.
--   release  then ns and the request's id: its slots go back. KEYS: the
--            ns slot sets.
--
--   A decision's keys share one cluster slot; on a Redis Cluster, so do
--   all the keys of a call. The script touches no other key.
--
-- Units: every duration is whole nanoseconds; every instant (the clock,
-- b0..b3) is whole microseconds since 1970, the resolution of TIME.
--
-- THE REPLY
--
--   {clock, repaired, the result of each decision, in order}
--
--   clock     the clock the call was decided by (µs since 1970)
--   repaired  the keys of another type found, and overwritten by a write
--
--   plain n   allowed, debt_1, ..., debt_n
--   +         1, debt_1, ..., debt_n
--   run of r  allowed_1, debt_1, ..., allowed_r, debt_r: each take's, as
--             a plain take of one bucket replies
--   take, adjust
--             allowed,
--             debt_1, ban_1, token_1, burst_1, ..., (nb buckets)
--             used_1, left_1, short_1, ..., (nc counters)
--             held_1, free_1, ... (ns slot sets)
--   release   the number of sets that held the request's slot
--
--   allowed   1 if the take was allowed, else 0 (adjust: 1); -1 when
--             Redis's clock is outside the quota windows sent (below):
--             nothing was decided, and the rest is 0
--   debt_i    how long until bucket i is full again, after the decision
--   ban_i     1 if this decision started bucket i's ban, else 0; plus 2
--             when bucket i is soft and lacked the tokens
--   token_i   the time of a token of the override that decided bucket i,
--   burst_i   and its burst; 0 and 0 when the bucket's own shape decided
--   used_j    counter j's count in its window, after the decision
--   left_j    how long until that window ends
--   short_j   1 when counter j is soft and lacked the units, else 0
--   held_j    1 if the request holds a slot of set j, else 0
--   free_j    how many slots of set j are free, after the decision
--
-- A key of another type (or a bucket that holds no instant) is read as
-- full, or empty of slots, and overwritten or deleted by the writes.
-- Any other error (a Redis out of memory) ends the script.

local epoch = 1735689600000000 -- 2025-01-01T00:00:00Z, in µs since 1970

local clock = tonumber(ARGV[1])
if not clock then
	local t = redis.call('TIME')
	clock = t[1] * 1000000 + t[2]
end
local now = clock - epoch -- µs since 2025: the buckets' time line

local reply = { clock, 0 } -- reply[2]: the keys found of another type

local values, saved, order, wrong -- (below)
