// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		name  string
		input string
		want  *Handler
	}{
		{
			name:  "one-line form",
			input: `rate_limit {client_ip} 10r/s 20`,
			want: &Handler{Zones: []*Zone{
				{Name: "default", Key: "{client_ip}", Rate: "10r/s", Burst: 20},
			}},
		},
		{
			name: "dry run, metrics off",
			input: `rate_limit {
	zone a {
		rate 1r/s
		dry_run
	}
	dry_run
	disable_metrics
}`,
			want: &Handler{
				Zones:          []*Zone{{Name: "a", Rate: "1r/s", dryRunConfig: dryRunConfig{DryRun: true}}},
				DryRun:         true,
				DisableMetrics: true,
			},
		},
		{
			name: "store redis, every option",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		address   10.0.0.1:6379 10.0.0.2:6379
		username  caddy
		password  {env.REDIS_PASSWORD}
		db        0
		sentinel  mymaster
		tls insecure_skip_verify ca /etc/ssl/redis.pem
		key_prefix "app:rl:"
		hash_keys
		timeout   250ms
		pool_size 20
		fail_mode closed
		disable_over_limit_cache
	}
}`,
			want: &Handler{
				Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}},
				StoreRaw: json.RawMessage(`{"addresses":["10.0.0.1:6379","10.0.0.2:6379"],"backend":"redis",` +
					`"disable_over_limit_cache":true,"fail_mode":"closed","hash_keys":true,"key_prefix":"app:rl:",` +
					`"password":"{env.REDIS_PASSWORD}","pool_size":20,"sentinel":"mymaster",` +
					`"timeout":250000000,"tls":{"ca":"/etc/ssl/redis.pem","insecure_skip_verify":true},"username":"caddy"}`),
			},
		},
		{
			name:  "one-line form without burst",
			input: `rate_limit {remote_host} 100/10s`,
			want: &Handler{Zones: []*Zone{
				{Name: "default", Key: "{remote_host}", Rate: "100/10s"},
			}},
		},
		{
			name: "one-line form with a block",
			input: `rate_limit {client_ip} 1r/m {
	zone extra {
		rate 2r/h
	}
	headers off
}`,
			want: &Handler{
				Zones: []*Zone{
					{Name: "default", Key: "{client_ip}", Rate: "1r/m"},
					{Name: "extra", Rate: "2r/h"},
				},
				Headers: "off",
			},
		},
		{
			name: "zone with every option",
			input: `rate_limit {
	zone api {
		key         {http.request.header.X-Api-Key}
		rate        5r/m
		burst       10
		cost        2
		match {
			method POST
			path /api/*
		}
		ipv4_prefix 24
		ipv6_prefix 48
	}
}`,
			want: &Handler{Zones: []*Zone{{
				Name:  "api",
				Key:   "{http.request.header.X-Api-Key}",
				Rate:  "5r/m",
				Burst: 10,
				Cost:  2,
				MatcherSetsRaw: caddyhttp.RawMatcherSets{{
					"method": json.RawMessage(`["POST"]`),
					"path":   json.RawMessage(`["/api/*"]`),
				}},
				IPv4Prefix: 24,
				IPv6Prefix: 48,
			}}},
		},
		{
			name: "prefix bounds",
			input: `rate_limit {
	zone lo {
		rate 1r/s
		ipv4_prefix 1
		ipv6_prefix 1
	}
	zone hi {
		rate 1r/s
		ipv4_prefix 32
		ipv6_prefix 128
	}
}`,
			want: &Handler{Zones: []*Zone{
				{Name: "lo", Rate: "1r/s", IPv4Prefix: 1, IPv6Prefix: 1},
				{Name: "hi", Rate: "1r/s", IPv4Prefix: 32, IPv6Prefix: 128},
			}},
		},
		{
			name: "rate forms",
			input: `rate_limit {
	zone s {
		rate 0.5r/s
	}
	zone m {
		rate 30r/m
	}
	zone h {
		rate 100r/h
	}
	zone d {
		rate 1000r/d
	}
	zone dur {
		rate 100/10s
	}
	zone rdur {
		rate 3r/1m30s
	}
}`,
			want: &Handler{Zones: []*Zone{
				{Name: "s", Rate: "0.5r/s"},
				{Name: "m", Rate: "30r/m"},
				{Name: "h", Rate: "100r/h"},
				{Name: "d", Rate: "1000r/d"},
				{Name: "dur", Rate: "100/10s"},
				{Name: "rdur", Rate: "3r/1m30s"},
			}},
		},
		{
			name: "store local with max_keys",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys 500
	}
	headers ietf
}`,
			want: &Handler{
				Zones:    []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}},
				StoreRaw: json.RawMessage(`{"backend":"local","max_keys":500}`),
				Headers:  "ietf",
			},
		},
		{
			name: "store local with persist off",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist off
	}
}`,
			want: &Handler{
				Zones:    []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}},
				StoreRaw: json.RawMessage(`{"backend":"local","persist":false}`),
			},
		},
		{
			name: "store local with persist on and an interval",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist on
		persist_interval 1m30s
	}
}`,
			want: &Handler{
				Zones:    []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}},
				StoreRaw: json.RawMessage(`{"backend":"local","persist":true,"persist_interval":90000000000}`),
			},
		},
		{
			name: "store local without a block",
			input: `rate_limit {client_ip} 1r/s {
	store local
}`,
			want: &Handler{
				Zones:    []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}},
				StoreRaw: json.RawMessage(`{"backend":"local"}`),
			},
		},
		{
			name: "headers both",
			input: `rate_limit {client_ip} 1r/s {
	headers both
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Headers: "both"},
		},
		{
			name: "headers legacy",
			input: `rate_limit {client_ip} 1r/s {
	headers legacy
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Headers: "legacy"},
		},
		{
			name: "headers ietf",
			input: `rate_limit {client_ip} 1r/s {
	headers ietf
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Headers: "ietf"},
		},
		{
			name: "headers off",
			input: `rate_limit {client_ip} 1r/s {
	headers off
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Headers: "off"},
		},
		{
			name: "grpc_status unavailable",
			input: `rate_limit {client_ip} 1r/s {
	grpc_status unavailable
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, GRPCStatus: "unavailable"},
		},
		{
			name: "grpc_status off",
			input: `rate_limit {client_ip} 1r/s {
	grpc_status off
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, GRPCStatus: "off"},
		},
		{
			name: "jitter and log_key",
			input: `rate_limit {client_ip} 1r/s {
	jitter 0.25
	log_key
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Jitter: 0.25, LogKey: true},
		},
		{
			name: "jitter bounds",
			input: `rate_limit {
	zone a {
		rate 1r/s
	}
	jitter 1
}`,
			want: &Handler{Zones: []*Zone{{Name: "a", Rate: "1r/s"}}, Jitter: 1},
		},
		{
			name: "caddy-ratelimit window and events",
			input: `rate_limit {
	zone legacy {
		key    {remote_host}
		window 1m
		events 30
	}
}`,
			want: &Handler{Zones: []*Zone{
				{Name: "legacy", Key: "{remote_host}", Window: caddy.Duration(time.Minute), MaxEvents: 30},
			}},
		},
		{
			name: "events before window",
			input: `rate_limit {
	zone legacy {
		events 5
		window 10s
		cost 5
	}
}`,
			want: &Handler{Zones: []*Zone{
				{Name: "legacy", Window: caddy.Duration(10 * time.Second), MaxEvents: 5, Cost: 5},
			}},
		},
		{
			name: "jitter above 1",
			input: `rate_limit {client_ip} 1r/s {
	jitter 10
}`,
			want: &Handler{Zones: []*Zone{{Name: "default", Key: "{client_ip}", Rate: "1r/s"}}, Jitter: 10},
		},
		{
			name: "sweep_interval accepted and ignored",
			input: `rate_limit {
	zone a {
		window 1m
		events 10
	}
	sweep_interval 30s
}`,
			want: &Handler{Zones: []*Zone{{Name: "a", Window: caddy.Duration(time.Minute), MaxEvents: 10}}, SweepInterval: caddy.Duration(30 * time.Second)},
		},
		{
			name: "names caddy-ratelimit accepts",
			input: `rate_limit {
	zone api:v1 {
		window 1s
		events 1
	}
	zone api/v1 {
		window 1s
		events 1
	}
	zone api@host {
		window 1s
		events 1
	}
	zone "a \"b\" é" {
		window 1s
		events 1
	}
}`,
			want: &Handler{Zones: []*Zone{
				{Name: "api:v1", Window: caddy.Duration(time.Second), MaxEvents: 1},
				{Name: "api/v1", Window: caddy.Duration(time.Second), MaxEvents: 1},
				{Name: "api@host", Window: caddy.Duration(time.Second), MaxEvents: 1},
				{Name: `a "b" é`, Window: caddy.Duration(time.Second), MaxEvents: 1},
			}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if got, want := toJSON(t, h), toJSON(t, tc.want); got != want {
				t.Errorf("parsed handler:\n got %s\nwant %s", got, want)
			}
			if err := h.Validate(); err != nil {
				t.Errorf("parsed handler does not validate: %v", err)
			}
		})
	}
}

// toJSON renders v as canonical JSON: object keys sorted, no spaces.
func toJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("marshal %T: %v", v, err)
	}
	var generic any
	if err := json.Unmarshal(b, &generic); err != nil {
		t.Fatalf("unmarshal %s: %v", b, err)
	}
	b, err = json.Marshal(generic)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	return string(b)
}

func TestUnmarshalCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		input   string
		wantErr string
		line    int // of the Testfile line the error must point at
	}{
		// Unknown words, at every level.
		{
			name: "unknown subdirective",
			input: `rate_limit {client_ip} 1r/s {
	bogus 1
}`,
			wantErr: "unrecognized subdirective 'bogus'",
			line:    2,
		},
		{
			name: "unknown zone subdirective",
			input: `rate_limit {
	zone a {
		rate 1r/s
		bogus
	}
}`,
			wantErr: "unrecognized zone subdirective 'bogus'",
			line:    4,
		},
		{
			name: "unknown store subdirective",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys 10
		bogus 1
	}
}`,
			wantErr: "unrecognized store local subdirective 'bogus'",
			line:    4,
		},
		{
			name: "unknown store",
			input: `rate_limit {client_ip} 1r/s {
	store nowhere
}`,
			wantErr: "getting module named 'http.handlers.rate_limit.stores.nowhere'",
			line:    2,
		},

		// Rates.
		{
			name: "missing rate",
			input: `rate_limit {
	zone a {
		key {client_ip}
		burst 5
	}
}`,
			wantErr: "zone a: rate is required",
			line:    5,
		},
		{
			name: "missing rate in an empty zone",
			input: `rate_limit {
	zone a
}`,
			wantErr: "zone a: rate is required",
			line:    2,
		},
		{
			name: "zero rate",
			input: `rate_limit {
	zone a {
		rate 0r/s
	}
}`,
			wantErr: "invalid rate '0r/s': must be positive",
			line:    3,
		},
		{
			name: "negative rate",
			input: `rate_limit {
	zone a {
		rate -5r/s
	}
}`,
			wantErr: "invalid rate '-5r/s': must be positive",
			line:    3,
		},
		{
			name: "unknown rate unit",
			input: `rate_limit {
	zone a {
		rate 10r/x
	}
}`,
			wantErr: "invalid rate '10r/x': unknown unit 'x'",
			line:    3,
		},
		{
			name: "zero interval",
			input: `rate_limit {
	zone a {
		rate 10/0s
	}
}`,
			wantErr: "invalid rate '10/0s': interval '0s' must be positive",
			line:    3,
		},
		{
			name: "negative interval",
			input: `rate_limit {
	zone a {
		rate 10/-1s
	}
}`,
			wantErr: "invalid rate '10/-1s': interval '-1s' must be positive",
			line:    3,
		},
		{
			name: "rate without slash",
			input: `rate_limit {
	zone a {
		rate abc
	}
}`,
			wantErr: "invalid rate 'abc': expected <n>r/s",
			line:    3,
		},
		{
			name: "rate without number",
			input: `rate_limit {
	zone a {
		rate r/s
	}
}`,
			wantErr: "invalid rate 'r/s': '' is not a number",
			line:    3,
		},
		{
			name: "rate NaN",
			input: `rate_limit {
	zone a {
		rate NaNr/s
	}
}`,
			wantErr: "invalid rate 'NaNr/s': 'NaN' is not a number",
			line:    3,
		},
		{
			name: "rate without argument",
			input: `rate_limit {
	zone a {
		rate
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},
		{
			name: "rate with two arguments",
			input: `rate_limit {
	zone a {
		rate 1r/s 2r/s
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},
		{
			name: "rate too slow to refill the burst in 100 years",
			input: `rate_limit {
	zone a {
		rate 1r/d
		burst 40000
	}
}`,
			wantErr: "zone a: burst 40000 at rate 1r/d takes more than 100 years to refill",
			line:    5,
		},

		// Burst, cost and prefixes.
		{
			name: "zero burst",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst 0
	}
}`,
			wantErr: "invalid burst 0: must be at least 1",
			line:    4,
		},
		{
			name: "negative burst",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst -3
	}
}`,
			wantErr: "invalid burst -3: must be at least 1",
			line:    4,
		},
		{
			name: "fractional burst",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst 1.5
	}
}`,
			wantErr: "invalid burst '1.5': expected a whole number",
			line:    4,
		},
		{
			name: "burst without argument",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst
	}
}`,
			wantErr: "wrong argument count",
			line:    4,
		},
		{
			name: "burst with two arguments",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst 1 2
	}
}`,
			wantErr: "wrong argument count",
			line:    4,
		},
		{
			name: "fractional cost",
			input: `rate_limit {
	zone a {
		rate 1r/s
		cost 0.5
	}
}`,
			wantErr: "invalid cost '0.5': expected a whole number",
			line:    4,
		},
		{
			name: "zero cost",
			input: `rate_limit {
	zone a {
		rate 1r/s
		cost 0
	}
}`,
			wantErr: "invalid cost 0: must be at least 1",
			line:    4,
		},
		{
			name: "cost above burst",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst 2
		cost 3
	}
}`,
			wantErr: "zone a: cost 3 exceeds burst 2",
			line:    6,
		},
		{
			name: "cost above the default burst",
			input: `rate_limit {
	zone a {
		rate 2r/s
		cost 3
	}
}`,
			wantErr: "zone a: cost 3 exceeds burst 2",
			line:    5,
		},
		{
			name: "ipv4_prefix 0",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv4_prefix 0
	}
}`,
			wantErr: "invalid ipv4_prefix 0: must be 1 to 32",
			line:    4,
		},
		{
			name: "ipv4_prefix 33",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv4_prefix 33
	}
}`,
			wantErr: "invalid ipv4_prefix 33: must be 1 to 32",
			line:    4,
		},
		{
			name: "ipv4_prefix negative",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv4_prefix -8
	}
}`,
			wantErr: "invalid ipv4_prefix -8: must be 1 to 32",
			line:    4,
		},
		{
			name: "ipv4_prefix not a number",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv4_prefix /24
	}
}`,
			wantErr: "invalid ipv4_prefix '/24': expected a whole number",
			line:    4,
		},
		{
			name: "ipv6_prefix 0",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv6_prefix 0
	}
}`,
			wantErr: "invalid ipv6_prefix 0: must be 1 to 128",
			line:    4,
		},
		{
			name: "ipv6_prefix 129",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv6_prefix 129
	}
}`,
			wantErr: "invalid ipv6_prefix 129: must be 1 to 128",
			line:    4,
		},
		{
			name: "ipv6_prefix negative",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ipv6_prefix -64
	}
}`,
			wantErr: "invalid ipv6_prefix -64: must be 1 to 128",
			line:    4,
		},

		// Zones and duplicates.
		{
			name: "duplicate zone name",
			input: `rate_limit {
	zone a {
		rate 1r/s
	}
	zone a {
		rate 2r/s
	}
}`,
			wantErr: "duplicate zone name 'a'",
			line:    5,
		},
		{
			name: "zone named like the one-line zone",
			input: `rate_limit {client_ip} 1r/s {
	zone default {
		rate 2r/s
	}
}`,
			wantErr: "duplicate zone name 'default'",
			line:    2,
		},
		{
			name: "zone without name",
			input: `rate_limit {
	zone {
		rate 1r/s
	}
}`,
			wantErr: "zone needs a name",
			line:    2,
		},
		{
			name: "zone with two names",
			input: `rate_limit {
	zone a b {
		rate 1r/s
	}
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "rate twice",
			input: `rate_limit {
	zone a {
		rate 1r/s
		rate 2r/s
	}
}`,
			wantErr: "zone a: rate already specified",
			line:    4,
		},
		{
			name: "key twice",
			input: `rate_limit {
	zone a {
		key {client_ip}
		rate 1r/s
		key {remote_host}
	}
}`,
			wantErr: "zone a: key already specified",
			line:    5,
		},
		{
			name: "burst twice",
			input: `rate_limit {
	zone a {
		rate 1r/s
		burst 2
		burst 2
	}
}`,
			wantErr: "zone a: burst already specified",
			line:    5,
		},
		{
			name: "key without argument",
			input: `rate_limit {
	zone a {
		key
		rate 1r/s
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},
		{
			name: "store twice",
			input: `rate_limit {client_ip} 1r/s {
	store local
	store local
}`,
			wantErr: "store already specified",
			line:    3,
		},
		{
			name: "store without backend",
			input: `rate_limit {client_ip} 1r/s {
	store
}`,
			wantErr: "store needs a backend",
			line:    2,
		},
		{
			name: "store with extra argument",
			input: `rate_limit {client_ip} 1r/s {
	store local extra
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "max_keys twice",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys 10
		max_keys 20
	}
}`,
			wantErr: "max_keys already specified",
			line:    4,
		},
		{
			name: "max_keys zero",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys 0
	}
}`,
			wantErr: "invalid max_keys 0: must be at least 1",
			line:    3,
		},
		{
			name: "max_keys negative",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys -1
	}
}`,
			wantErr: "invalid max_keys -1: must be at least 1",
			line:    3,
		},
		{
			name: "max_keys not a number",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys 1e6
	}
}`,
			wantErr: "invalid max_keys '1e6': expected a whole number",
			line:    3,
		},
		{
			name: "max_keys without argument",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		max_keys
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},

		{
			name: "persist neither on nor off",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist no
	}
}`,
			wantErr: "invalid persist 'no': expected on or off",
			line:    3,
		},
		{
			name: "persist without argument",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},
		{
			name: "persist twice",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist on
		persist off
	}
}`,
			wantErr: "persist already specified",
			line:    4,
		},
		{
			name: "persist_interval not a duration",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist_interval often
	}
}`,
			wantErr: "invalid persist_interval 'often': expected a duration such as 30s",
			line:    3,
		},
		{
			name: "persist_interval too short",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist_interval 10ms
	}
}`,
			wantErr: "invalid persist_interval 10ms: must be at least 100ms",
			line:    3,
		},
		{
			name: "persist_interval twice",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist_interval 1s
		persist_interval 2s
	}
}`,
			wantErr: "persist_interval already specified",
			line:    4,
		},
		{
			name: "persist_interval with persist off",
			input: `rate_limit {client_ip} 1r/s {
	store local {
		persist off
		persist_interval 1s
	}
}`,
			wantErr: "persist_interval set with persist off",
			line:    5,
		},
		// Handler options.
		{
			name: "headers twice",
			input: `rate_limit {client_ip} 1r/s {
	headers off
	headers ietf
}`,
			wantErr: "headers already specified",
			line:    3,
		},
		{
			name: "headers unknown",
			input: `rate_limit {client_ip} 1r/s {
	headers draft
}`,
			wantErr: "invalid headers 'draft': expected both, legacy, ietf or off",
			line:    2,
		},
		{
			name: "headers empty",
			input: `rate_limit {client_ip} 1r/s {
	headers ""
}`,
			wantErr: "invalid headers '': expected both, legacy, ietf or off",
			line:    2,
		},
		{
			name: "grpc_status unknown",
			input: `rate_limit {client_ip} 1r/s {
	grpc_status 8
}`,
			wantErr: "invalid grpc_status '8': expected resource_exhausted, unavailable or off",
			line:    2,
		},
		{
			name: "grpc_status without argument",
			input: `rate_limit {client_ip} 1r/s {
	grpc_status
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "headers without argument",
			input: `rate_limit {client_ip} 1r/s {
	headers
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "headers with two arguments",
			input: `rate_limit {client_ip} 1r/s {
	headers legacy ietf
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "jitter twice",
			input: `rate_limit {client_ip} 1r/s {
	jitter 0.1
	jitter 0.2
}`,
			wantErr: "jitter already specified",
			line:    3,
		},
		{
			name: "jitter negative",
			input: `rate_limit {client_ip} 1r/s {
	jitter -0.1
}`,
			wantErr: "invalid jitter -0.1: must be a number of at least 0",
			line:    2,
		},
		{
			name: "jitter infinite",
			input: `rate_limit {client_ip} 1r/s {
	jitter +Inf
}`,
			wantErr: "invalid jitter +Inf: must be a number of at least 0",
			line:    2,
		},
		{
			name: "jitter percent",
			input: `rate_limit {client_ip} 1r/s {
	jitter 10%
}`,
			wantErr: "invalid jitter '10%': expected a fraction such as 0.1",
			line:    2,
		},
		{
			name: "jitter NaN",
			input: `rate_limit {client_ip} 1r/s {
	jitter NaN
}`,
			wantErr: "invalid jitter NaN: must be a number of at least 0",
			line:    2,
		},
		{
			name: "jitter without argument",
			input: `rate_limit {client_ip} 1r/s {
	jitter
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "jitter with two arguments",
			input: `rate_limit {client_ip} 1r/s {
	jitter 0.1 0.2
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "log_key with argument",
			input: `rate_limit {client_ip} 1r/s {
	log_key yes
}`,
			wantErr: "wrong argument count",
			line:    2,
		},
		{
			name: "log_key twice",
			input: `rate_limit {client_ip} 1r/s {
	log_key
	log_key
}`,
			wantErr: "log_key already specified",
			line:    3,
		},
		{
			name: "dry_run with argument",
			input: `rate_limit {
	zone a {
		rate 1r/s
		dry_run yes
	}
}`,
			wantErr: "wrong argument count",
			line:    4,
		},
		{
			name: "disable_metrics twice",
			input: `rate_limit {client_ip} 1r/s {
	disable_metrics
	disable_metrics
}`,
			wantErr: "disable_metrics already specified",
			line:    3,
		},
		{
			name:    "rate too fast",
			input:   `rate_limit {client_ip} 2000000000r/s`,
			wantErr: "invalid rate '2000000000r/s': at most 1000000000r/s",
			line:    1,
		},
		{
			name:    "default burst too large",
			input:   `rate_limit {client_ip} 4e18/100000d`,
			wantErr: "too large a default burst",
			line:    1,
		},
		{
			name: "store redis: bad fail_mode",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		fail_mode maybe
	}
}`,
			wantErr: "invalid fail_mode 'maybe': expected local, open or closed",
			line:    3,
		},
		{
			name: "store redis: url with address",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		address 127.0.0.1:6379
		url redis://127.0.0.1:6379
	}
}`,
			wantErr: "store redis: url replaces addresses",
			line:    5,
		},
		{
			name: "store redis: bad timeout",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		timeout soon
	}
}`,
			wantErr: "invalid timeout 'soon'",
			line:    3,
		},
		{
			name: "store redis: unknown subdirective",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		addresses 127.0.0.1:6379
	}
}`,
			wantErr: "unrecognized store redis subdirective 'addresses'",
			line:    3,
		},
		{
			name: "store redis: duplicate",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		db 1
		db 2
	}
}`,
			wantErr: "store redis: db already specified",
			line:    4,
		},
		{
			name: "store redis: tls option",
			input: `rate_limit {client_ip} 1r/s {
	store redis {
		tls verify_none
	}
}`,
			wantErr: "unrecognized tls option 'verify_none'",
			line:    3,
		},

		// caddy-ratelimit's window and events.
		{
			name: "window without events",
			input: `rate_limit {
	zone a {
		window 1m
	}
}`,
			wantErr: "zone a: window and events go together",
			line:    4,
		},
		{
			name: "events without window",
			input: `rate_limit {
	zone a {
		events 10
	}
}`,
			wantErr: "zone a: window and events go together",
			line:    4,
		},
		{
			name: "rate with window and events",
			input: `rate_limit {
	zone a {
		rate 1r/s
		window 1m
		events 10
	}
}`,
			wantErr: "zone a: use either rate or window and events, not both",
			line:    6,
		},
		{
			name: "rate with window",
			input: `rate_limit {
	zone a {
		window 1m
		rate 1r/s
	}
}`,
			wantErr: "zone a: use either rate or window and events, not both",
			line:    5,
		},
		{
			name: "burst with window and events",
			input: `rate_limit {
	zone a {
		window 1m
		events 10
		burst 20
	}
}`,
			wantErr: "zone a: events is already the burst of window and events",
			line:    6,
		},
		{
			name: "zero events",
			input: `rate_limit {
	zone a {
		window 1m
		events 0
	}
}`,
			wantErr: "invalid events 0: must be at least 1",
			line:    4,
		},
		{
			name: "fractional events",
			input: `rate_limit {
	zone a {
		window 1m
		events 2.5
	}
}`,
			wantErr: "invalid events '2.5': expected a whole number",
			line:    4,
		},
		{
			name: "bad window",
			input: `rate_limit {
	zone a {
		window forever
		events 10
	}
}`,
			wantErr: "invalid window 'forever': expected a positive duration such as 1m",
			line:    3,
		},
		{
			name: "window twice",
			input: `rate_limit {
	zone a {
		window 1m
		window 2m
		events 10
	}
}`,
			wantErr: "zone a: window already specified",
			line:    4,
		},
		{
			name: "distributed",
			input: `rate_limit {
	zone a {
		window 1m
		events 10
	}
	distributed {
		read_interval 5s
	}
}`,
			wantErr: "'distributed' is a github.com/mholt/caddy-ratelimit option: use 'store redis { ... }'",
			line:    6,
		},
		{
			name: "storage",
			input: `rate_limit {
	zone a {
		rate 1r/s
	}
	storage file_system /tmp
}`,
			wantErr: "'storage' is a github.com/mholt/caddy-ratelimit option: use 'store redis { ... }'",
			line:    5,
		},
		{
			name: "sweep_interval not a duration",
			input: `rate_limit {
	zone a {
		rate 1r/s
	}
	sweep_interval often
}`,
			wantErr: "invalid sweep_interval 'often': expected a duration such as 1m",
			line:    5,
		},
		{
			name: "sweep_interval twice",
			input: `rate_limit {
	zone a {
		rate 1r/s
	}
	sweep_interval 1m
	sweep_interval 2m
}`,
			wantErr: "sweep_interval already specified",
			line:    6,
		},

		// No zones, and the one-line form's arguments.
		{
			name:    "no zones",
			input:   `rate_limit`,
			wantErr: "no zones: use 'rate_limit <key> <rate> [<burst>]' or a 'zone <name> { ... }' block",
			line:    1,
		},
		{
			name: "no zones in a block",
			input: `rate_limit {
	headers off
}`,
			wantErr: "no zones",
			line:    3,
		},
		{
			name:    "one argument",
			input:   `rate_limit {client_ip}`,
			wantErr: "wrong argument count: expected <key> <rate> [<burst>], got 1 arguments",
			line:    1,
		},
		{
			name:    "four arguments",
			input:   `rate_limit {client_ip} 1r/s 5 10`,
			wantErr: "wrong argument count: expected <key> <rate> [<burst>], got 4 arguments",
			line:    1,
		},
		{
			name:    "one-line bad rate",
			input:   `rate_limit {client_ip} 10r/x`,
			wantErr: "invalid rate '10r/x': unknown unit 'x'",
			line:    1,
		},
		{
			name:    "one-line zero rate",
			input:   `rate_limit {client_ip} 0r/s`,
			wantErr: "invalid rate '0r/s': must be positive",
			line:    1,
		},
		{
			name: "ban without a rate",
			input: `rate_limit {
	zone a {
		ban 15m
	}
}`,
			wantErr: "zone a: ban needs a rate",
			line:    4,
		},
		{
			name: "ban 0",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ban 0s
	}
}`,
			wantErr: "invalid ban 0s: must be positive",
			line:    4,
		},
		{
			name: "ban not a duration",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ban forever
	}
}`,
			wantErr: "invalid ban 'forever': expected a duration such as 15m",
			line:    4,
		},
		{
			name: "ban twice",
			input: `rate_limit {
	zone a {
		rate 1r/s
		ban 1m
		ban 2m
	}
}`,
			wantErr: "zone a: ban already specified",
			line:    5,
		},
		{
			name: "count without a matcher",
			input: `rate_limit {
	zone a {
		rate 1r/s
		count
	}
}`,
			wantErr: "count needs a response matcher",
			line:    4,
		},
		{
			name: "count with a bad status",
			input: `rate_limit {
	zone a {
		rate 1r/s
		count {
			status 4xx 1000
		}
	}
}`,
			wantErr: "invalid count status 1000",
			line:    6,
		},
		{
			name: "count with an unknown matcher",
			input: `rate_limit {
	zone a {
		rate 1r/s
		count {
			path /login
		}
	}
}`,
			wantErr: "unrecognized response matcher path",
			line:    5,
		},
		{
			name: "count without a rate",
			input: `rate_limit {
	zone a {
		count status 401
	}
}`,
			wantErr: "zone a: count needs a rate",
			line:    4,
		},
		{
			name: "concurrency 0",
			input: `rate_limit {
	zone a {
		concurrency 0
	}
}`,
			wantErr: "invalid concurrency 0: must be 1 to",
			line:    3,
		},
		{
			name: "negative concurrency",
			input: `rate_limit {
	zone a {
		concurrency -2
	}
}`,
			wantErr: "invalid concurrency -2: must be 1 to",
			line:    3,
		},
		{
			name: "fractional concurrency",
			input: `rate_limit {
	zone a {
		concurrency 1.5
	}
}`,
			wantErr: "invalid concurrency '1.5': expected a whole number",
			line:    3,
		},
		{
			name: "concurrency without a number",
			input: `rate_limit {
	zone a {
		concurrency
	}
}`,
			wantErr: "wrong argument count",
			line:    3,
		},
		{
			name: "lease without concurrency",
			input: `rate_limit {
	zone a {
		rate 1r/s
		lease 30s
	}
}`,
			wantErr: "zone a: lease needs concurrency",
			line:    5,
		},
		{
			name: "lease 0",
			input: `rate_limit {
	zone a {
		concurrency 2
		lease 0s
	}
}`,
			wantErr: "invalid lease 0s: must be positive",
			line:    4,
		},
		{
			name: "lease not a duration",
			input: `rate_limit {
	zone a {
		concurrency 2
		lease soon
	}
}`,
			wantErr: "invalid lease 'soon': expected a duration such as 60s",
			line:    4,
		},
		{
			name: "burst with concurrency and no rate",
			input: `rate_limit {
	zone a {
		concurrency 2
		burst 5
	}
}`,
			wantErr: "zone a: burst needs a rate",
			line:    5,
		},
		{
			name: "ban with concurrency and no rate",
			input: `rate_limit {
	zone a {
		concurrency 2
		ban 1m
	}
}`,
			wantErr: "zone a: ban needs a rate",
			line:    5,
		},
		{
			name:    "one-line zero burst",
			input:   `rate_limit {client_ip} 1r/s 0`,
			wantErr: "invalid burst 0: must be at least 1",
			line:    1,
		},
		{
			name:    "one-line negative burst",
			input:   `rate_limit {client_ip} 1r/s -1`,
			wantErr: "invalid burst -1: must be at least 1",
			line:    1,
		},
		{
			name:    "one-line fractional burst",
			input:   `rate_limit {client_ip} 1r/s 2.5`,
			wantErr: "invalid burst '2.5': expected a whole number",
			line:    1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

// checkCaddyfileError checks that the directive's tokens in input fail
// with an error containing wantErr, at line.
func checkCaddyfileError(t *testing.T, input, wantErr string, line int) {
	t.Helper()
	err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
	if err == nil {
		t.Fatalf("expected error containing %q, got none", wantErr)
	}
	if !strings.Contains(err.Error(), wantErr) {
		t.Errorf("error %q does not contain %q", err, wantErr)
	}
	if suffix := fmt.Sprintf(", at Testfile:%d", line); !strings.HasSuffix(err.Error(), suffix) {
		t.Errorf("error %q does not end in %q", err, suffix)
	}
}

// TestAdapt adapts each testdata/*.caddyfiletest file's Caddyfile (before
// the ---------- line) and compares it with the JSON after it, as Caddy's
// own caddyfile_adapt tests do. Adapter warnings fail the test.
func TestAdapt(t *testing.T) {
	files, err := filepath.Glob("testdata/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		t.Fatalf("no adapt tests: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			input, expected := readAdaptTest(t, f)
			assertAdapt(t, input, expected)
		})
	}
}

// readAdaptTest splits a .caddyfiletest file into its Caddyfile and JSON.
func readAdaptTest(t *testing.T, path string) (caddyfile, expected string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	in, out, ok := strings.Cut(string(data), "----------")
	if !ok {
		t.Fatalf("%s: no ---------- line", path)
	}
	return strings.TrimSpace(in) + "\n", strings.TrimSpace(out)
}

// The directive is ordered before basic_auth without an `order` option,
// so clients that fail authentication are limited too.
func TestAdaptOrderBeforeBasicAuth(t *testing.T) {
	input, _ := readAdaptTest(t, "testdata/order_before_basic_auth.caddyfiletest")
	// The same, independent of the golden text's exact shape.
	var cfg struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []struct {
							Handler string `json:"handler"`
						} `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(adaptCaddyfile(t, input), &cfg); err != nil {
		t.Fatal(err)
	}
	var handlers []string
	for _, r := range cfg.Apps.HTTP.Servers["srv0"].Routes {
		for _, h := range r.Handle {
			handlers = append(handlers, h.Handler)
		}
	}
	if want := []string{"rate_limit", "authentication", "static_response"}; !slices.Equal(handlers, want) {
		t.Errorf("handlers in order %q, want %q", handlers, want)
	}
}

// assertAdapt compares the adapted Caddyfile with the expected JSON, and
// fails on adapter warnings, which AssertAdapt only logs.
func assertAdapt(t *testing.T, input, expectedJSON string) {
	t.Helper()
	caddytest.AssertAdapt(t, input, "caddyfile", expectedJSON)
	adaptCaddyfile(t, input)
}

// adaptCaddyfile adapts a Caddyfile to JSON and fails on any warning.
func adaptCaddyfile(t *testing.T, input string) []byte {
	t.Helper()
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	for _, w := range warnings {
		t.Errorf("warning: %s:%d: %s: %s", w.File, w.Line, w.Directive, w.Message)
	}
	return out
}
