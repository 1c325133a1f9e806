#!/usr/bin/env bash
# Builds what the benchmark needs and runs it: bench/run.sh [quick|full] [harness flags]
#   quick  under 2 minutes (the default)
#   full   under 10 minutes; the results committed in bench/results/
# Needs Go, redis-server and wrk: apt-get install redis-server wrk
# (RATE_LIMIT_REDIS_SERVER=valkey-server runs another server instead.)
# Extra flags go to the harness, e.g. -note "machine shared with CI" or
# -only noisy,throughput,memory. Results go to bench/results/ (-out to change).
set -euo pipefail
cd "$(dirname "$0")"

mode=${1:-quick}
case $mode in
quick | full) shift || true ;;
-*) mode=quick ;;
*)
	echo "usage: bench/run.sh [quick|full] [harness flags]" >&2
	exit 2
	;;
esac

missing=()
for tool in go "${RATE_LIMIT_REDIS_SERVER:-redis-server}" wrk; do
	command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "missing: ${missing[*]} (Go from https://go.dev/dl/; then: apt-get install redis-server wrk)" >&2
	exit 1
fi

echo "building into bench/bin/ ..."
mkdir -p bin
(cd .. && go build -o bench/bin/caddy ./cmd/caddy) # our Caddy, from the repository's module
(cd peer && go build -o ../bin/caddy-peer .)       # Caddy with github.com/mholt/caddy-ratelimit
go build -o bin/backend ./backend
go build -o bin/harness ./harness

exec bin/harness -mode "$mode" -bin bin -out results "$@"
