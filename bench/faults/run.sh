#!/usr/bin/env bash
# The long version of the fault and attack scenarios (faults_test.go):
# bench/faults/run.sh, or make faults. Writes bench/faults/RESULTS.md.
# Needs Go and redis-server (apt-get install redis-server), or the server
# that RATE_LIMIT_REDIS_SERVER names.
set -uo pipefail
cd "$(dirname "$0")/../.."

results=bench/faults/RESULTS.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export XDG_CONFIG_HOME="$tmp/config" XDG_DATA_HOME="$tmp/data"
export RATELIMIT_FAULTS=long RATELIMIT_FAULTS_REPORT="$PWD/$results.part"
rm -f "$results.part"

echo "building bench/bin/caddy ..."
go build -o bench/bin/caddy ./cmd/caddy || exit 1
caddy="$PWD/bench/bin/caddy"
log=bench/bin/faults-test.log # the whole test log, for a closer look
: >"$log"

status=0
cmds=()
# quoted prints a command as a shell would read it back, paths relative
# to the repository's root.
quoted() {
	local out=() a
	for a in "$@"; do
		a=${a//$PWD\//}
		case $a in
		*[!A-Za-z0-9_./=:-]*) out+=("'$a'") ;;
		*) out+=("$a") ;;
		esac
	done
	echo "${out[*]}"
}
run() {
	cmds+=("$(quoted "$@")")
	echo "+ ${cmds[-1]}"
	"$@" 2>&1 | tee -a "$log" | grep -E '^\s*(=== RUN|--- |faults_test.go:[0-9]+: figures:|ok|FAIL|PASS)'
	[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
start=$(date +%s) load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# Scenarios 1, 4 and 5 watch a Caddy process of their own; scenario 2
# runs in the test binary under the race detector; scenario 3 needs no
# Caddy.
run env RATELIMIT_FAULTS_CADDY="$caddy" go test -count=1 -timeout 30m -v -run '^TestFault(RedisOutages|FrozenAsCachedDenialRunsOut)$' .
run go test -race -count=1 -timeout 30m -v -run '^TestFaultReloadsUnderFlood$' .
run go test -count=1 -timeout 30m -v -run '^TestFaultHostileKeys$' .
run env RATELIMIT_FAULTS_CADDY="$caddy" go test -count=1 -timeout 30m -v -run '^TestFault(OneKeyFlood|RotatingKeys)$' .
minutes=$(( ($(date +%s) - start + 59) / 60 )) load_after=$(cut -d' ' -f1-3 /proc/loadavg)

{
	echo "# Fault and attack scenarios: results of the long version"
	echo
	echo "Run with \`make faults\` (bench/faults/run.sh) on $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench/faults' || echo ' plus uncommitted changes'), in about $minutes minutes."
	echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'); $(go version | cut -d' ' -f3); $("${RATE_LIMIT_REDIS_SERVER:-redis-server}" --version | cut -d' ' -f1,3 | tr -d 'v='); load average $load_before before the run, $load_after after."
	echo "The commands it ran, each with RATELIMIT_FAULTS=long (the long version) and RATELIMIT_FAULTS_REPORT (this file), from the repository's root:"
	echo
	echo '```sh'
	printf '%s\n' "${cmds[@]}"
	echo '```'
	if [ $status -ne 0 ]; then
		echo
		echo "**Some scenarios failed**: their tables say so, and the failures are listed at the end."
	fi
	cat "$results.part"
	if [ $status -ne 0 ]; then
		echo
		echo "## Failures"
		echo
		echo '```'
		grep -E '^\s+faults_test.go:[0-9]+: ' "$log" | grep -vE 'faults_test.go:[0-9]+: (figures|log): ' | sed 's/^ *//' | sort | uniq -c | sort -rn | head -40
		echo '```'
	fi
} >"$results"
rm -f "$results.part"
echo "results in $results, the whole test log in $log"
exit $status
