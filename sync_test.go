// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"testing"
)

func TestSyncCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		input   string
		wantErr string
		line    int
	}{
		{
			name: "not a duration",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync often
	}
}`,
			wantErr: "invalid sync 'often': expected a duration such as 100ms",
			line:    4,
		},
		{
			name: "too short",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100us
	}
}`,
			wantErr: "invalid sync 100µs: must be 1ms to 1m",
			line:    4,
		},
		{
			name: "no argument",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync
	}
}`,
			wantErr: "wrong argument count",
			line:    4,
		},
		{
			name: "with delay",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
		delay 1s
	}
	store redis
}`,
			wantErr: "zone a: sync cannot go with delay",
			line:    6,
		},
		{
			name: "with concurrency",
			input: `rate_limit {
	zone a {
		rate 1r/s
		concurrency 4
		sync 100ms
	}
	store redis
}`,
			wantErr: "zone a: sync cannot go with concurrency",
			line:    6,
		},
		{
			name: "without a rate",
			input: `rate_limit {
	zone a {
		quota 10 per day
		sync 100ms
	}
	store redis
}`,
			wantErr: "zone a: sync needs a rate",
			line:    5,
		},
		{
			name: "on the local store",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
	}
}`,
			wantErr: "zone a: sync needs the Redis store",
			line:    6,
		},
		{
			name: "on the local store, said",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
	}
	store local
}`,
			wantErr: "zone a: sync needs the Redis store",
			line:    7,
		},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

func TestSyncValidate(t *testing.T) {
	const redis = `"store":{"backend":"redis"}`
	for _, tc := range []struct {
		name, json, wantErr string
	}{
		{"ok", `{"zones":[{"name":"a","rate":"1r/s","sync":"100ms"}],` + redis + `}`, ""},
		{"plans", `{"zones":[{"name":"a","rate":"{r}","burst":"{b}","sync":"100ms"}],` + redis + `}`, ""},
		{"local store", `{"zones":[{"name":"a","rate":"1r/s","sync":"100ms"}]}`, "zone a: sync needs the Redis store"},
		{"too long", `{"zones":[{"name":"a","rate":"1r/s","sync":"2m"}],` + redis + `}`, "invalid sync 2m0s: must be 1ms to 1m"},
		{"ban", `{"zones":[{"name":"a","rate":"1r/s","ban":"1m","sync":"100ms"}],` + redis + `}`, "sync cannot go with ban"},
		{"count", `{"zones":[{"name":"a","rate":"1r/s","count":{"status_code":[401]},"sync":"100ms"}],` + redis + `}`, "sync cannot go with count"},
		{"usage", `{"zones":[{"name":"a","rate":"1r/s","usage":{"header":"X-Used"},"sync":"100ms"}],` + redis + `}`, "sync cannot go with usage"},
		{"quota", `{"zones":[{"name":"a","rate":"1r/s","quota":10,"quota_period":"day","sync":"100ms"}],` + redis + `}`, "sync cannot go with quota"},
	} {
		t.Run(tc.name, func(t *testing.T) { checkValidate(t, tc.json, tc.wantErr) })
	}
}
