// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Three stores with their own clients, like three Caddy instances, hammer
// one key: together they get exactly the bucket's tokens.
func TestSharedLimitIsExact(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := redistest.Start(t)
	for _, skew := range []bool{false, true} {
		t.Run(fmt.Sprintf("skewed clocks %v", skew), func(t *testing.T) {
			const rate, burst = 50.0, 20
			l := gcra.NewLimit(rate, burst)
			var stores []*redisstore.Store
			for range 3 {
				stores = append(stores, redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("exact", l)}, redisstore.Options{}))
			}
			var allowed atomic.Int64
			var wg sync.WaitGroup
			start := time.Now()
			const run = 3 * time.Second
			for i, s := range stores {
				// Each instance sees its own clock; only the over-limit
				// cache uses it, and only as a local time line.
				offset := time.Duration(0)
				if skew {
					offset = time.Duration(i-1) * time.Hour
				}
				for range 4 {
					wg.Go(func() {
						for time.Since(start) < run {
							ok, err := s.Take(context.Background(), time.Now().Add(offset), redisstore.TakeOf(0, "hot", l))
							if err != nil {
								t.Error(err)
								return
							}
							if ok {
								allowed.Add(1)
							}
						}
					})
				}
			}
			wg.Wait()
			elapsed := time.Since(start).Seconds()
			most := burst + rate*elapsed + 1
			got := float64(allowed.Load())
			t.Logf("allowed %v in %.2fs; the bucket gave at most %.0f", got, elapsed, most)
			if got > most || got < 0.9*most {
				t.Fatalf("allowed %v, want at most %.0f and not far below", got, most)
			}
		})
	}
}

// Under a flood on one key, the over-limit cache leaves Redis about one
// call per token, where without it every request is a call; and every
// refusal says when a token comes back, within a token.
func TestOverLimitCache(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := redistest.Start(t)
	l := gcra.NewLimit(10, 20)
	for _, cached := range []bool{true, false} {
		t.Run(fmt.Sprintf("cache %v", cached), func(t *testing.T) {
			s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("flood", l)},
				redisstore.Options{DisableOverLimitCache: !cached})
			before := r.Calls()
			// 2000 requests a second for 2 seconds.
			var ok, denied, wrongWait int
			tick := time.NewTicker(500 * time.Microsecond)
			defer tick.Stop()
			start := time.Now()
			for time.Since(start) < 2*time.Second {
				<-tick.C
				d := redisstore.TakeOf(0, "198.51.100.1", l)
				allowed, err := s.Take(context.Background(), time.Now(), d)
				switch {
				case err != nil:
					t.Fatal(err)
				case allowed:
					ok++
				default:
					denied++
					if w := d.Buckets[0].Wait(); w <= 0 || w > l.TokenTime {
						wrongWait++
					}
				}
			}
			calls := r.Calls() - before
			elapsed := time.Since(start).Seconds()
			t.Logf("%d allowed, %d denied, %d Redis calls in %.2fs", ok, denied, calls, elapsed)
			if most := 20 + 10*elapsed + 1; float64(ok) > most || float64(ok) < most-5 {
				t.Fatalf("allowed %d, want about %.0f", ok, most)
			}
			if wrongWait > 0 {
				t.Fatalf("%d denials whose wait is not within a token", wrongWait)
			}
			if cached && calls > 2*ok {
				t.Fatalf("%d Redis calls for %d allowed requests: the cache is not sparing Redis", calls, ok)
			}
			if !cached && calls != ok+denied {
				t.Fatalf("%d Redis calls for %d requests", calls, ok+denied)
			}
		})
	}
}

// A flood on one key from many concurrent callers asks Redis about once
// per token, not once per caller: neither when the bucket is new (the
// first wave) nor each time the key's cached instant passes.
func TestFloodAsksOncePerBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := redistest.Start(t)
	l := gcra.NewLimit(10, 20)
	s := redisstore.Open(t, redisstore.OpenClientWith(t, redisstore.ClientOptions{PoolSize: 64}, r.Addr()),
		[]store.ZoneSpec{redisstore.Bucket("onceper", l)}, redisstore.Options{})
	var allowed, total atomic.Int64
	var wg sync.WaitGroup
	callsBefore := r.Calls()
	start := time.Now()
	const warmUp, run = 500 * time.Millisecond, 2500 * time.Millisecond
	for range 64 {
		wg.Go(func() {
			for time.Since(start) < run {
				if ok, _ := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, "198.51.100.7", l)); ok {
					allowed.Add(1)
				}
				total.Add(1)
			}
		})
	}
	time.Sleep(warmUp)
	allowedWarm, callsWarm := allowed.Load(), r.Calls()
	wg.Wait()
	calls := r.Calls() - callsBefore
	steadyAllowed, steadyCalls := allowed.Load()-allowedWarm, r.Calls()-callsWarm
	t.Logf("64 callers: %d requests, %d allowed, %d Redis calls; after the first %v: %d allowed, %d calls",
		total.Load(), allowed.Load(), calls, warmUp, steadyAllowed, steadyCalls)
	if most := 20 + 10*time.Since(start).Seconds() + 1; float64(allowed.Load()) > most {
		t.Fatalf("allowed %d, more than the bucket's %.0f", allowed.Load(), most)
	}
	// The first wave, on a bucket Redis has not seen, asks no more than
	// the burst at once.
	if int64(calls) > 3*allowed.Load() {
		t.Errorf("%d Redis calls for %d allowed requests: concurrent callers multiply the calls", calls, allowed.Load())
	}
	// Once steady, about one call a token: the cache counts from when the
	// last call was sent and Redis from when it ran, and the store waits
	// out a round trip past the cached instant before asking, so a call
	// only now and then comes early and finds the bucket short.
	if int64(steadyCalls) > 2*steadyAllowed+5 {
		t.Errorf("steady: %d Redis calls for %d allowed requests", steadyCalls, steadyAllowed)
	}
}
