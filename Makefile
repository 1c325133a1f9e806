# Benchmarks (see bench/README.md). Needs Go, redis-server and wrk:
#   apt-get install redis-server wrk
# make bench NOTE="machine shared with CI" adds a note to the results.

.PHONY: bench bench-quick

bench:
	bench/run.sh full $(if $(NOTE),-note "$(NOTE)")

bench-quick:
	bench/run.sh quick $(if $(NOTE),-note "$(NOTE)")
