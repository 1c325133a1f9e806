// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package compare holds the benchmarks that measure the plugin against
// other Go rate limiters. They live in the bench module so that those
// limiters never enter the plugin's go.mod.
//
// BenchmarkDecision is the x/time/rate counterpart of the plugin's own
// BenchmarkDecision (../../benchmark_test.go), with the same keys and the
// same loop; run both binaries in alternation and compare with benchstat:
//
//	go test -c -o /tmp/ours.test .. && go test -c -o /tmp/peer.test ./compare   # from bench/
//	for i in 1 2 3 4 5 6; do
//		/tmp/ours.test -test.run '^$' -test.bench Decision -test.benchmem >>ours.txt
//		/tmp/peer.test -test.run '^$' -test.bench Decision -test.benchmem >>peer.txt
//	done
//	benchstat ours.txt peer.txt
//
// BenchmarkRedis runs the plugin's Redis store (through its handler, as
// Caddy calls it) and github.com/go-redis/redis_rate side by side on one
// redis-server it starts:
//
//	go test -run '^$' -bench Redis -count 6 ./compare
package compare

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

const manyKeys = 1 << 20

// ipStrings are a million distinct IPv4 keys, as the plugin's
// BenchmarkDecision makes them, as strings.
var ipStrings = sync.OnceValue(func() []string {
	keys := make([]string, manyKeys)
	for i := range keys {
		keys[i] = netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()
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
			b.Run(fmt.Sprintf("xrate-map/keys=%d/parallel=%v", keys, parallel), func(b *testing.B) {
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

// runDecisions is the plugin's, line for line, so that the figures
// compare: a key index, random when there are many, and an instant a
// little later each time.
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

// BenchmarkRedis compares one decision through the plugin's Redis store
// with redis_rate's Allow on the same Redis, with 1, 16 and 64 concurrent
// callers on random keys that never run out. Both are exact (one atomic
// script per decision). It reports decisions/s and the callers' p50/p99
// latency.
func BenchmarkRedis(b *testing.B) {
	addr := startRedis(b)
	for _, callers := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("tokenbucket/callers=%d", callers), func(b *testing.B) {
			h := newHandler(b, fmt.Sprintf(`{"zones":[{"name":"rb","key":"{http.request.header.X-Key}","rate":"1000000r/s"}],
				"store":{"backend":"redis","addresses":[%q],"pool_size":%d,"timeout":"1s"}}`, addr, callers))
			reqs := keyRequests()
			writers := make([]*headerSink, callers)
			for i := range writers {
				writers[i] = &headerSink{h: make(http.Header)}
			}
			runConcurrent(b, callers, func(caller, key int) error {
				return serveOne(h, writers[caller], reqs[key])
			})
		})
		b.Run(fmt.Sprintf("redis_rate/callers=%d", callers), func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: callers})
			defer c.Close()
			lim := redis_rate.NewLimiter(c)
			limit := redis_rate.Limit{Rate: 1000000, Burst: 1000000, Period: time.Second}
			runConcurrent(b, callers, func(_, key int) error {
				_, err := lim.Allow(context.Background(), benchKeys[key], limit)
				return err
			})
		})
	}
}

// BenchmarkRedisOneCaller is one caller's latency through each limiter,
// taken in turns on the same Redis: each iteration makes one decision
// with each, first one then the other, so that both see the same
// loopback round trip, which on a shared machine swings by tens of
// percent from minute to minute. It reports each one's median and the
// ratio of the plugin's to redis_rate's.
func BenchmarkRedisOneCaller(b *testing.B) {
	addr := startRedis(b)
	h := newHandler(b, fmt.Sprintf(`{"zones":[{"name":"r1","key":"{http.request.header.X-Key}","rate":"1000000r/s"}],
		"store":{"backend":"redis","addresses":[%q],"pool_size":1,"timeout":"1s"}}`, addr))
	reqs := keyRequests()
	w := &headerSink{h: make(http.Header)}
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 1})
	defer c.Close()
	lim := redis_rate.NewLimiter(c)
	limit := redis_rate.Limit{Rate: 1000000, Burst: 1000000, Period: time.Second}
	ours := func(k int) error { return serveOne(h, w, reqs[k]) }
	theirs := func(k int) error {
		_, err := lim.Allow(context.Background(), benchKeys[k], limit)
		return err
	}
	var lat [2][]time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := i % len(benchKeys)
		for j := range 2 {
			which := (i + j) % 2 // who goes first alternates
			decide := ours
			if which == 1 {
				decide = theirs
			}
			t := time.Now()
			if err := decide(k); err != nil {
				b.Fatal(err)
			}
			lat[which] = append(lat[which], time.Since(t))
		}
		i++
	}
	p50 := func(d []time.Duration) float64 {
		slices.Sort(d)
		return d[len(d)/2].Seconds() * 1e6
	}
	o, t := p50(lat[0]), p50(lat[1])
	b.ReportMetric(o, "tokenbucket-p50-µs")
	b.ReportMetric(t, "redis_rate-p50-µs")
	b.ReportMetric(o/t, "ratio")
}

// keyRequests are a request for each of benchKeys, in header X-Key,
// made beforehand as Caddy's server makes them: what is measured is the
// handler.
func keyRequests() []*http.Request {
	reqs := make([]*http.Request, len(benchKeys))
	for i, k := range benchKeys {
		reqs[i] = httptest.NewRequest(http.MethodGet, "/", nil)
		reqs[i].Header.Set("X-Key", k)
		caddyhttp.NewTestReplacer(reqs[i])
	}
	return reqs
}

// serveOne runs the handler for req, and fails if it did not decide.
func serveOne(h *ratelimit.Handler, w *headerSink, req *http.Request) error {
	clear(w.h)
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	if err := h.ServeHTTP(w, req, next); err != nil {
		return err
	}
	if len(w.h["X-Ratelimit-Remaining"]) == 0 {
		return fmt.Errorf("no decision: headers %v", w.h)
	}
	return nil
}

// benchKeys are the keys of BenchmarkRedis.
var benchKeys = func() []string {
	keys := make([]string, 10000)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	return keys
}()

// headerSink is a ResponseWriter that keeps headers and drops the rest.
type headerSink struct{ h http.Header }

func (w *headerSink) Header() http.Header         { return w.h }
func (w *headerSink) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerSink) WriteHeader(int)             {}

// runConcurrent runs b.N calls of decide, with the index of a key of
// benchKeys, spread over callers goroutines, and reports throughput and
// latency percentiles.
func runConcurrent(b *testing.B, callers int, decide func(caller, key int) error) {
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
				if err := decide(c, int(i%int64(len(benchKeys)))); err != nil {
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

// newHandler provisions the plugin's handler from its JSON config, as
// Caddy would.
func newHandler(b *testing.B, config string) *ratelimit.Handler {
	b.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := new(ratelimit.Handler)
	if err := json.Unmarshal([]byte(config), h); err != nil {
		b.Fatal(err)
	}
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		h.Cleanup()
		cancel()
	})
	return h
}

// startRedis starts a throwaway redis-server on a free port (or the server
// that RATE_LIMIT_REDIS_SERVER names).
func startRedis(b *testing.B) string {
	b.Helper()
	port := redistest.FreePort(b, 0)
	cmd := exec.Command(redistest.ServerBin(), "--bind", "127.0.0.1", "--port", strconv.Itoa(port),
		"--save", "", "--appendonly", "no", "--dir", b.TempDir())
	if err := cmd.Start(); err != nil {
		b.Fatalf("starting %s (apt-get install redis-server): %v", redistest.ServerBin(), err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := "127.0.0.1:" + strconv.Itoa(port)
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	for deadline := time.Now().Add(10 * time.Second); c.Ping(context.Background()).Err() != nil; {
		if time.Now().After(deadline) {
			b.Fatal(redistest.ServerBin() + " did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return addr
}
