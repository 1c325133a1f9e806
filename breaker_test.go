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
	if rs.client.breaker.openUntil.Load() != 0 {
		t.Fatal("cancelled requests opened the circuit breaker")
	}
	serve(h, "192.0.2.60")
	if r.cli("EXISTS", "t:cancel:{192.0.2.60}") != "1" {
		t.Fatal("the next request was not decided by Redis")
	}
}
