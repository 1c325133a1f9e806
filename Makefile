# Benchmarks (see bench/README.md). Needs Go, redis-server and wrk:
#   apt-get install redis-server wrk
# make bench NOTE="machine shared with CI" adds a note to the results.

.PHONY: bench bench-quick bench-adaptive faults masters sync share

bench:
	bench/run.sh full $(if $(NOTE),-note "$(NOTE)")

bench-quick:
	bench/run.sh quick $(if $(NOTE),-note "$(NOTE)")

# The long version of the fault and attack scenarios (docs/development.md,
# "Fault and attack scenarios"); needs Go and redis-server. Writes
# bench/faults/RESULTS.md.
faults:
	bench/faults/run.sh

# The load runs of zones with sync (docs/sync.md): one key flooded on 1, 3
# and 5 instances at sync 10ms, 100ms and 1s beside an exact zone, through
# Caddy too, and 2,000 keys under their limit; needs Go and redis-server.
# Writes bench/results/sync.md.
sync:
	RATE_LIMIT_SYNC=1 go test -count=1 -run '^TestSyncLoad$$' -v . | grep -E '^(---|ok|FAIL|\s+sync_test)'

# The load runs of zones with share (docs/share.md): one fresh key flooded
# and trickled on 1, 3 and 5 instances beside an exact zone, 20 floods
# each way on three, ten busy keys' script calls, and the cost a request
# of the local store, share and the exact path, rotated. Writes
# bench/results/share.md.
share:
	RATE_LIMIT_SHARE=1 go test -count=1 -timeout 30m -run '^TestShareLoad$$' -v . | grep -E '^(---|ok|FAIL|\s+share_load_test)'

# How decisions spread over the masters of a 3-master Redis Cluster, and
# the decisions/s of one master pinned to core 1, loaded by the store from
# core 0 (docs/performance.md, "Redis"); needs Go, redis-server and
# taskset. RUNS=n runs each load n times (default 5); SCRIPT=<file> runs
# another version of the decision script (one file, such as an older
# version's lua/token_bucket.lua) for comparison. Writes
# bench/results/masters.log.
masters:
	RATE_LIMIT_MASTERS=1 RATE_LIMIT_MASTERS_RUNS=$(RUNS) RATE_LIMIT_SCRIPT=$(SCRIPT) \
		taskset -c 0 go test -count=1 -run '^(TestClusterSpread|TestMastersThroughput)$$' -v ./internal/redisstore \
		| grep -E '^(---|ok|FAIL|\s+cluster_test)' | tee bench/results/masters.log

# The load scenario of `concurrency adaptive` (docs/adaptive.md): a test
# upstream behind Caddy with the adaptive zone, under closed-loop clients;
# needs Go. ROUNDS=n rounds of each run (default 3). Writes
# bench/results/adaptive.md, adaptive.json and adaptive_*.png.
bench-adaptive:
	bench/adaptive/run.sh $(if $(ROUNDS),-rounds $(ROUNDS)) $(if $(NOTE),-note "$(NOTE)")
