# Benchmarks (see bench/README.md). Needs Go, redis-server and wrk:
#   apt-get install redis-server wrk
# make bench NOTE="machine shared with CI" adds a note to the results.

.PHONY: bench bench-quick bench-adaptive faults masters

bench:
	bench/run.sh full $(if $(NOTE),-note "$(NOTE)")

bench-quick:
	bench/run.sh quick $(if $(NOTE),-note "$(NOTE)")

# The long version of the fault and attack scenarios (docs/development.md,
# "Fault and attack scenarios"); needs Go and redis-server. Writes
# bench/faults/RESULTS.md.
faults:
	bench/faults/run.sh

# How decisions spread over the masters of a 3-master Redis Cluster, and
# the decisions/s of one master pinned to core 1, loaded by the store from
# core 0 (docs/performance.md, "Redis"); needs Go, redis-server and
# taskset. RUNS=n runs each load n times (default 5); SCRIPT=<file> runs
# another version of lua/token_bucket.lua for comparison. Writes
# bench/results/masters.log.
masters:
	RATE_LIMIT_MASTERS=1 RATE_LIMIT_MASTERS_RUNS=$(RUNS) RATE_LIMIT_SCRIPT=$(SCRIPT) \
		taskset -c 0 go test -count=1 -run '^(TestRedisClusterSpread|TestMastersThroughput)$$' -v . \
		| grep -E '^(---|ok|FAIL|\s+redis_cluster_test)' | tee bench/results/masters.log

# The load scenario of `concurrency adaptive` (docs/adaptive.md): a test
# upstream behind Caddy with the adaptive zone, under closed-loop clients;
# needs Go. ROUNDS=n rounds of each run (default 3). Writes
# bench/results/adaptive.md, adaptive.json and adaptive_*.png.
bench-adaptive:
	bench/adaptive/run.sh $(if $(ROUNDS),-rounds $(ROUNDS)) $(if $(NOTE),-note "$(NOTE)")
