// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command caddy is Caddy with its standard modules and the rate_limit
// handler, as `xcaddy build --with github.com/caddy-tokenbucket/ratelimit`
// would build it.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddy-tokenbucket/ratelimit"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func main() {
	caddycmd.Main()
}
