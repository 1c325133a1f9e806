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
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
)

// Benchmarks of one decision, side by side with a map of
// golang.org/x/time/rate limiters under one mutex (what a Go service
// would write by hand), on one hot key and on a million keys:
//
//	go test -run '^$' -bench 'Decision' -benchmem -count 6 | tee new.txt
//	benchstat new.txt

const manyKeys = 1 << 20

// ipKeys are a million distinct IPv4 keys, as the handler makes them.
var ipKeys = sync.OnceValue(func() []bucketKey {
	keys := make([]bucketKey, manyKeys)
	for i := range keys {
		keys[i] = bucketKey{ip: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
	}
	return keys
})

// ipStrings are the same keys as strings, for the x/time/rate map.
var ipStrings = sync.OnceValue(func() []string {
	keys := make([]string, manyKeys)
	for i, k := range ipKeys() {
		keys[i] = k.String()
	}
	return keys
})

// xrateMap is the hand-written alternative: one limiter per key.
type xrateMap struct {
	mu sync.Mutex
	m  map[string]*rate.Limiter
}

func (x *xrateMap) allow(key string, now time.Time) bool {
	x.mu.Lock()
	l, ok := x.m[key]
	if !ok {
		l = rate.NewLimiter(1e9, 1e9) // never limits: measures the cost only
		x.m[key] = l
	}
	x.mu.Unlock()
	return l.AllowN(now, 1)
}

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
			b.Run("xrate-map/"+name, func(b *testing.B) {
				x := &xrateMap{m: make(map[string]*rate.Limiter)}
				ks := ipStrings()[:keys]
				for _, k := range ks {
					x.allow(k, time.Now())
				}
				runDecisions(b, parallel, keys, func(i int, now time.Time) { x.allow(ks[i], now) })
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
		{"denied", `{"name":"bench-denied","rate":"1r/s"}`}, // Retry-After: 1
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop() // Caddy's default level skips denial logs too
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
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

// BenchmarkRedis compares one decision through the Redis store with
// github.com/go-redis/redis_rate/v10's Allow on the same Redis, with 1, 16
// and 64 concurrent callers on random keys that never run out. Both are
// exact (one atomic script per decision). It reports decisions/s and the
// callers' p50/p99 latency.
//
//	go test -run '^$' -bench Redis -count 6
func BenchmarkRedis(b *testing.B) {
	r := startRedis(b)
	for _, callers := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("tokenbucket/callers=%d", callers), func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rb","rate":"1000000r/s"}],
				"store":{"backend":"redis","addresses":[%q],"pool_size":%d,"timeout":"1s"}}`, r.addr(), callers))
			z := h.Zones[0]
			runConcurrent(b, callers, func(key string) error {
				reqs := [1]request{{zone: z, key: bucketKey{s: key}}}
				_, err := h.store.take(context.Background(), time.Now(), reqs[:])
				return err
			})
		})
		b.Run(fmt.Sprintf("redis_rate/callers=%d", callers), func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: r.addr(), PoolSize: callers})
			defer c.Close()
			lim := redis_rate.NewLimiter(c)
			limit := redis_rate.Limit{Rate: 1000000, Burst: 1000000, Period: time.Second}
			runConcurrent(b, callers, func(key string) error {
				_, err := lim.Allow(context.Background(), key, limit)
				return err
			})
		})
	}
}

// runConcurrent runs b.N calls of decide spread over callers goroutines
// and reports throughput and latency percentiles.
func runConcurrent(b *testing.B, callers int, decide func(key string) error) {
	keys := make([]string, 10000)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	lat := make([][]time.Duration, callers)
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := range callers {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				t := time.Now()
				if err := decide(keys[i%int64(len(keys))]); err != nil {
					b.Error(err)
					return
				}
				lat[c] = append(lat[c], time.Since(t))
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	all := slices.Concat(lat...)
	slices.Sort(all)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
	b.ReportMetric(all[len(all)/2].Seconds()*1e6, "p50-µs")
	b.ReportMetric(all[len(all)*99/100].Seconds()*1e6, "p99-µs")
}
