// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command caddy-peer is Caddy with its standard modules and
// github.com/mholt/caddy-ratelimit, the benchmark's point of comparison.
// That plugin registers the same module ID and directive (rate_limit) as
// ours, so it lives in its own module and binary. It also carries
// bench_wait (wait.go), the throughput phase's floor for a limiter that
// waits for a server.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-ratelimit"
)

func main() {
	caddycmd.Main()
}
