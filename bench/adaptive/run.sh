#!/usr/bin/env bash
# The load scenario of `concurrency adaptive`: bench/adaptive/run.sh
# [flags], or make bench-adaptive. Builds Caddy from this repository into
# bench/bin/ and runs bench/adaptive, which writes bench/results/adaptive.md,
# adaptive.json and the plots. Needs Go. Flags go to the program, e.g.
# -rounds 1, -only 8-workers,upstream-slows, -note "text", -out dir.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bin
echo "building into bench/bin/ ..."
(cd .. && go build -o bench/bin/caddy ./cmd/caddy)
go build -o bin/adaptive ./adaptive
ADAPTIVE_ARGS="$(printf '%q ' "$@")" exec bin/adaptive -caddy bin/caddy -out results "$@"
