# Benchmarks (see bench/README.md). Needs Go, redis-server and wrk:
#   apt-get install redis-server wrk
# make bench NOTE="machine shared with CI" adds a note to the results.

.PHONY: bench bench-quick faults

bench:
	bench/run.sh full $(if $(NOTE),-note "$(NOTE)")

bench-quick:
	bench/run.sh quick $(if $(NOTE),-note "$(NOTE)")

# The long version of the fault and attack scenarios (README, "Fault and
# attack scenarios"); needs Go and redis-server. Writes
# bench/faults/RESULTS.md.
faults:
	bench/faults/run.sh
