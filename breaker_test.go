// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Clients that go away cancel their requests' contexts: that says nothing
// of Redis, and must not open the circuit breaker.
func TestRedisCancelledRequestsKeepBreakerClosed(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "cancel", "1r/m", 100, ""))
	rs := h.store.(*redisstore.Store)
	for range 2 * rediswire.TripAfter {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		reqs := &store.Demands{Buckets: []store.BucketDemand{bucketReq(h.Zones[0], store.Key{Text: "gone"})}}
		if _, err := rs.Take(ctx, time.Now(), reqs); err == nil {
			t.Fatal("a cancelled request reached a decision")
		}
	}
	if rs.Client.Breaker.Open() {
		t.Fatal("cancelled requests opened the circuit breaker")
	}
	serve(h, "192.0.2.60")
	if r.CLI(append([]string{"HEXISTS"}, pair(bucketOf(h, 0, "192.0.2.60"))...)...) != "1" {
		t.Fatal("the next request was not decided by Redis")
	}
}

// A probe whose client gives up must not leave the breaker open: Redis
// decides again as soon as it is back, whatever the probing clients do.
func TestRedisCancelledProbeDoesNotStickBreaker(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "probe", "1r/m", 100, `,"timeout":"50ms"`))
	rs := h.store.(*redisstore.Store)
	r.Kill()
	for range rediswire.TripAfter {
		serve(h, "192.0.2.80")
	}
	if !rs.Client.Breaker.Open() {
		t.Fatal("breaker closed after three outages")
	}
	r.Start()
	for range 3 {
		// Past the backoff, a client that has given up is the probe.
		time.Sleep(rediswire.MinBackoff + 10*time.Millisecond)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		rs.Take(ctx, time.Now(), &store.Demands{Buckets: []store.BucketDemand{bucketReq(h.Zones[0], store.Key{Text: "impatient"})}})
	}
	deadline := time.Now().Add(rediswire.MaxBackoff + 500*time.Millisecond)
	for r.CLI(append([]string{"HEXISTS"}, pair(bucketOf(h, 0, "192.0.2.81"))...)...) != "1" {
		if time.Now().After(deadline) {
			t.Fatal("Redis is back, but the breaker never let a request through again")
		}
		serve(h, "192.0.2.81")
		time.Sleep(20 * time.Millisecond)
	}
}
