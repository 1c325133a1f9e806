// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"testing"
	"time"
)

// Clients that go away cancel their requests' contexts: that says nothing
// of Redis, and must not open the circuit breaker.
func TestRedisCancelledRequestsKeepBreakerClosed(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "cancel", "1r/m", 100, ""))
	rs := h.store.(*RedisStore)
	for range 2 * tripAfter {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		reqs := []request{{zone: h.Zones[0], key: bucketKey{s: "gone"}}}
		if _, err := rs.take(ctx, time.Now(), reqs); err == nil {
			t.Fatal("a cancelled request reached a decision")
		}
	}
	if rs.client.breaker.open() {
		t.Fatal("cancelled requests opened the circuit breaker")
	}
	serve(h, "192.0.2.60")
	if r.cli(append([]string{"HEXISTS"}, pair(bucketOf(h, 0, "192.0.2.60"))...)...) != "1" {
		t.Fatal("the next request was not decided by Redis")
	}
}

// Every way out of a call reports to the breaker, and every way out of
// the probe hands the next probe on: success closes the breaker, an
// outage backs off, and a call that says nothing of Redis (its client
// went away) lets the next request probe at once.
func TestBreakerProbeAlwaysEnds(t *testing.T) {
	var b breaker
	now := time.Now()
	for i := range tripAfter {
		if ok, probe := b.allow(now); !ok || probe {
			t.Fatalf("closed breaker, call %d: ok %t, probe %t; want an ordinary call", i, ok, probe)
		}
		if opened := b.outage(now, false); opened != (i == tripAfter-1) {
			t.Fatalf("outage %d: opened %t", i+1, opened)
		}
	}
	if ok, _ := b.allow(now); ok {
		t.Fatal("open breaker let a call through before its backoff")
	}
	// An outage from a call made before the breaker opened changes nothing.
	b.outage(now, false)
	later := now.Add(minBackoff)
	ok, probe := b.allow(later)
	if !ok || !probe {
		t.Fatalf("after the backoff: ok %t, probe %t; want the probe", ok, probe)
	}
	if ok, _ := b.allow(later); ok {
		t.Fatal("a second probe while the first is out")
	}
	// The probe's client went away: the next request probes.
	b.done(true)
	if ok, probe := b.allow(later); !ok || !probe {
		t.Fatalf("after an abandoned probe: ok %t, probe %t; want a new probe", ok, probe)
	}
	// The probe finds Redis down: the next probe waits twice as long.
	b.outage(later, true)
	if ok, _ := b.allow(later.Add(2*minBackoff - time.Millisecond)); ok {
		t.Fatal("probe before the doubled backoff")
	}
	ok, probe = b.allow(later.Add(2 * minBackoff))
	if !ok || !probe {
		t.Fatal("no probe after the doubled backoff")
	}
	if closed := b.success(true); !closed || b.open() {
		t.Fatalf("successful probe: closed %t, open %t", closed, b.open())
	}
	if ok, probe := b.allow(later); !ok || probe {
		t.Fatalf("closed again: ok %t, probe %t; want an ordinary call", ok, probe)
	}
}

// A probe whose client gives up must not leave the breaker open: Redis
// decides again as soon as it is back, whatever the probing clients do.
func TestRedisCancelledProbeDoesNotStickBreaker(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "probe", "1r/m", 100, `,"timeout":"50ms"`))
	rs := h.store.(*RedisStore)
	r.kill()
	for range tripAfter {
		serve(h, "192.0.2.80")
	}
	if !rs.client.breaker.open() {
		t.Fatal("breaker closed after three outages")
	}
	r.start()
	for range 3 {
		// Past the backoff, a client that has given up is the probe.
		time.Sleep(minBackoff + 10*time.Millisecond)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		rs.take(ctx, time.Now(), []request{{zone: h.Zones[0], key: bucketKey{s: "impatient"}}})
	}
	deadline := time.Now().Add(maxBackoff + 500*time.Millisecond)
	for r.cli(append([]string{"HEXISTS"}, pair(bucketOf(h, 0, "192.0.2.81"))...)...) != "1" {
		if time.Now().After(deadline) {
			t.Fatal("Redis is back, but the breaker never let a request through again")
		}
		serve(h, "192.0.2.81")
		time.Sleep(20 * time.Millisecond)
	}
}
