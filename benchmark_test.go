// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Benchmarks of one decision, on one hot key and on a million keys. Their
// counterparts for other limiters (a map of golang.org/x/time/rate
// limiters, what a Go service would write by hand; go-redis/redis_rate on
// Redis) are in bench/compare, so that those limiters stay out of this
// module:
//
//	go test -run '^$' -bench 'Decision|ServeHTTP|Clock|RedisStore' -benchmem -count 6

const manyKeys = 1 << 20

// ipKeys are a million distinct IPv4 keys, as the handler makes them.
var ipKeys = sync.OnceValue(func() []bucketKey {
	keys := make([]bucketKey, manyKeys)
	for i := range keys {
		keys[i] = bucketKey{ip: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
	}
	return keys
})

func BenchmarkDecision(b *testing.B) {
	for _, keys := range []int{1, manyKeys} {
		for _, parallel := range []bool{false, true} {
			name := fmt.Sprintf("keys=%d/parallel=%v", keys, parallel)
			b.Run("tokenbucket/"+name, func(b *testing.B) {
				tab := newTable(2*manyKeys, time.Now())
				l := newLimit(1e9, 1e9)
				ks := ipKeys()[:keys]
				for _, k := range ks { // steady state: keys already tracked
					takeAll([]charge{{l: l, cost: l.costTime(1), t: tab, h: tab.hash(k), now: 1}})
				}
				cost := l.costTime(1) // per zone, once
				decide := func(i int, now time.Time) {
					k := ks[i]
					cs := [1]charge{{l: l, cost: cost, t: tab, h: tab.hash(k), now: tab.instant(now)}}
					takeAll(cs[:])
				}
				runDecisions(b, parallel, keys, decide)
			})
		}
	}
}

// runDecisions calls decide with a key index, random (cache-missing, as
// real traffic) when there are many, and an instant a little later each
// time. Both limiters take time as a parameter; reading the clock costs
// the same for both and is measured apart, in BenchmarkClock.
func runDecisions(b *testing.B, parallel bool, keys int, decide func(int, time.Time)) {
	b.ReportAllocs()
	next := func(r *rand.Rand) int {
		if keys == 1 {
			return 0
		}
		return r.IntN(keys)
	}
	start := time.Now()
	if !parallel {
		r := rand.New(rand.NewPCG(1, 2))
		now := start
		for b.Loop() {
			now = now.Add(time.Microsecond)
			decide(next(r), now)
		}
		return
	}
	var seed atomic.Uint64
	b.ResetTimer() // after the setup
	b.RunParallel(func(pb *testing.PB) {
		r := rand.New(rand.NewPCG(seed.Add(1), 2))
		now := start
		for pb.Next() {
			now = now.Add(time.Microsecond)
			decide(next(r), now)
		}
	})
}

// BenchmarkClock is what reading the clock, once per request, costs here.
func BenchmarkClock(b *testing.B) {
	for b.Loop() {
		_ = time.Now()
	}
}

// BenchmarkServeHTTP is the handler's whole cost for one request, without
// Caddy's server around it: key from {client_ip}, decision, headers.
func BenchmarkServeHTTP(b *testing.B) {
	for _, tc := range []struct{ name, zone string }{
		{"allowed", `{"name":"bench-allowed","rate":"1000000000r/s"}`},
		{"allowed-ban", `{"name":"bench-allowed-ban","rate":"1000000000r/s","ban":"15m"}`},
		// count 401, and the response a 200: every request is charged,
		// then given its token back.
		{"allowed-count", `{"name":"bench-allowed-count","rate":"1000000000r/s","count":{"status_code":[401]}}`},
		{"allowed-concurrency", `{"name":"bench-allowed-concurrency","rate":"1000000000r/s","concurrency":100}`},
		{"allowed-delay", `{"name":"bench-allowed-delay","rate":"1000000000r/s","delay":"1s"}`},
		{"denied", `{"name":"bench-denied","rate":"1r/s"}`}, // Retry-After: 1
		{"allowed_api_key", `{"name":"bench-api-key","key":"{http.request.header.X-API-Key}","rate":"1000000000r/s"}`},
		{"allowed-quota", `{"name":"bench-quota","quota":999999999999999,"quota_period":"month"}`},
		{"allowed-rate-quota", `{"name":"bench-rate-quota","rate":"1000000000r/s","quota":999999999999999,"quota_period":"month"}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop() // Caddy's default level skips denial logs too
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			req.Header.Set("X-API-Key", "an-api-key-of-32-bytes-abcdefghi")
			vars := map[string]any{"client_ip": "192.0.2.1"}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				_ = h.ServeHTTP(w, req, next)
			}
		})
	}
}

// headerSink is a ResponseWriter that keeps headers and drops the rest.
type headerSink struct{ h http.Header }

func (w *headerSink) Header() http.Header         { return w.h }
func (w *headerSink) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerSink) WriteHeader(int)             {}

// BenchmarkRedisStore is one decision through the Redis store, one caller
// at a time, on keys that never run out: its latency and allocations. The
// comparison with redis_rate at 1 to 64 callers is in bench/compare.
func BenchmarkRedisStore(b *testing.B) {
	r := startRedis(b)
	for _, tc := range []struct{ name, ban string }{{"plain", ""}, {"ban", `,"ban":"15m"`}, {"delay", `,"delay":"1s"`},
		{"quota", `,"quota":999999999999999,"quota_period":"month"`}} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rb-%s","rate":"1000000r/s"%s}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"1s"}}`, tc.name, tc.ban, r.Addr()))
			keys := make([]bucketKey, 10000)
			for i := range keys {
				keys[i] = bucketKey{s: "k" + strconv.Itoa(i)}
			}
			calls := r.Calls()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				reqs := [2]request{{zone: h.Zones[0], key: keys[i%len(keys)]}}
				n := 1
				if z := h.Zones[0]; z.quota != nil {
					reqs[1], n = request{zone: z, key: reqs[0].key, win: z.quota.window(time.Now())}, 2
				}
				if _, err := h.store.take(context.Background(), time.Now(), reqs[:n]); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(float64(r.Calls()-calls)/float64(i), "calls/op")
		})
	}
}

// BenchmarkServeHTTPRedis is the handler's whole cost for one request
// with the Redis store, one caller at a time, on keys that never run out:
// allocations, and calls to Redis per request.
func BenchmarkServeHTTPRedis(b *testing.B) {
	r := startRedis(b)
	for _, tc := range []struct{ name, zone string }{
		{"allowed", `"rate":"1000000r/s"`},
		{"allowed-ban", `"rate":"1000000r/s","ban":"15m"`},
		// The response, a 200, does not match: the tokens go back.
		{"allowed-count", `"rate":"1000000r/s","count":{"status_code":[401]}`},
		// A slot taken in the decision's call, given back in a second
		// one when the handlers return.
		{"allowed-concurrency", `"concurrency":1000`},
		{"allowed-rate+concurrency", `"rate":"1000000r/s","concurrency":1000`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rh-%s",%s}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"1s"}}`, tc.name, tc.zone, r.Addr()))
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			ips := make([]any, 10000) // boxed once: the loop allocates nothing of its own
			for i := range ips {
				ips[i] = fmt.Sprintf("10.%d.%d.1", i>>8, i&0xff)
			}
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			vars := map[string]any{"client_ip": ips[0]}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			calls := r.Calls()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				vars["client_ip"] = ips[i%len(ips)]
				clear(w.h)
				if err := h.ServeHTTP(w, req, next); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(float64(r.Calls()-calls)/float64(i), "calls/op")
		})
	}
}

// BenchmarkServeHTTPPlan is the allowed path of a zone whose rate and
// burst come with the request (plans.go), beside the same zone with
// fixed numbers: `benchstat -col /rate`. The values come from
// {http.vars.*}, as an authentication handler would set them, or from
// request headers.
func BenchmarkServeHTTPPlan(b *testing.B) {
	for _, tc := range []struct{ name, zone string }{
		{"rate=fixed", `{"name":"bench-plan-fixed","rate":"1000000000r/s","burst":1000000000}`},
		{"rate=vars", `{"name":"bench-plan-vars","rate":"{http.vars.plan_rate}","burst":"{http.vars.plan_burst}"}`},
		{"rate=header", `{"name":"bench-plan-header","rate":"{http.request.header.X-Rate}","burst":"{http.request.header.X-Burst}"}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			req.Header.Set("X-Rate", "1000000000r/s")
			req.Header.Set("X-Burst", "1000000000")
			vars := map[string]any{"client_ip": "192.0.2.1", "plan_rate": "1000000000r/s", "plan_burst": "1000000000"}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				if err := h.ServeHTTP(w, req, next); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkServeHTTPRedisParallel is the handler's cost per request with
// the Redis store when 50 requests are in flight at once, as under load:
// all from one client (the load run's case: their takes are twins), or
// each from its own. Each request comes with a context of its own, as
// net/http gives it (two of the allocations are the benchmark's).
func BenchmarkServeHTTPRedisParallel(b *testing.B) {
	r := startRedis(b)
	for _, tc := range []struct {
		name string
		keys int
	}{{"one-client", 1}, {"many-clients", 10000}} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rp-%s","rate":"1000000000r/s"}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"1s"}}`, tc.name, r.Addr()))
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			ips := make([]any, tc.keys)
			for i := range ips {
				ips[i] = fmt.Sprintf("10.%d.%d.1", i>>8, i&0xff)
			}
			var seq atomic.Int64
			calls := r.Calls()
			b.ReportAllocs()
			b.SetParallelism(max(1, 50/runtime.GOMAXPROCS(0)))
			b.RunParallel(func(pb *testing.PB) {
				req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
				vars := map[string]any{}
				req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
				caddyhttp.NewTestReplacer(req)
				base := req.Context()
				w := &headerSink{h: make(http.Header)}
				for pb.Next() {
					vars["client_ip"] = ips[int(seq.Add(1))%len(ips)]
					ctx, cancel := context.WithCancel(base)
					clear(w.h)
					if err := h.ServeHTTP(w, req.WithContext(ctx), next); err != nil {
						b.Error(err)
					}
					cancel()
				}
			})
			b.ReportMetric(float64(r.Calls()-calls)/float64(b.N), "calls/op")
		})
	}
}

// BenchmarkEviction is a flood of one-off keys through a full zone: each
// decision is a new key, so each evicts a bucket that has not refilled.
func BenchmarkEviction(b *testing.B) {
	const maxKeys = 100_000
	tab := newTable(maxKeys, time.Now())
	l := newLimit(1.0/60, 1)
	cost := l.costTime(1)
	keys := ipKeys()
	for i := range maxKeys { // full, of buckets that refill in a minute
		takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.hash(keys[i]), now: 1}})
	}
	b.ReportAllocs()
	i := maxKeys
	for b.Loop() {
		k := keys[i%len(keys)]
		takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.hash(k), now: 1 + time.Duration(i)}})
		i++
	}
	if tab.evictions.Load() == 0 {
		b.Fatal("nothing was evicted")
	}
}
