// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A slot is a lease in Redis: a request that finds none free is refused
// (its slot full), a release gives back the slots it holds, in one call
// or one each, and asks nothing when it holds none; a lease that is not
// given back ends by itself; and while Redis is down, a release is left
// to the leases' end.
func TestLeases(t *testing.T) {
	r := redistest.Start(t)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()),
		[]store.ZoneSpec{{Name: "k", Shape: gcra.NewLimit(1, 1), Slots: true}}, redisstore.Options{})
	ctx := context.Background()
	slot := func(lease time.Duration) *store.Demands {
		return &store.Demands{Slots: []store.SlotDemand{{Key: store.Key{Text: "k"}, Limit: 2, Lease: lease}}}
	}
	take := func(d *store.Demands) bool {
		t.Helper()
		ok, err := s.Take(ctx, time.Now(), d)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	first, second, third := slot(time.Minute), slot(300*time.Millisecond), slot(time.Minute)
	if !take(first) || !take(second) {
		t.Fatal("two slots of two refused")
	}
	if take(third) || !third.Slots[0].Full || third.Slots[0].Held {
		t.Fatalf("a third slot of two: %+v, want refused, full", third.Slots[0])
	}
	calls := r.Calls()
	if err := s.Release(ctx, third.Slots); err != nil || r.Calls() != calls {
		t.Fatalf("releasing what is not held: %v, %d calls", err, r.Calls()-calls)
	}
	// One held of two: a call for the one.
	if err := s.Release(ctx, append(first.Slots, third.Slots...)); err != nil || r.Calls() != calls+1 {
		t.Fatalf("releasing one of two: %v, %d calls", err, r.Calls()-calls)
	}
	if !take(slot(time.Minute)) {
		t.Fatal("the slot given back is not free")
	}
	// The second's lease ends by itself.
	time.Sleep(400 * time.Millisecond)
	if !take(slot(time.Minute)) {
		t.Fatal("a lease that ended still holds its slot")
	}
	r.Kill()
	for i := 0; !s.Stats(0).Unavailable; i++ {
		if i > 10 {
			t.Fatal("Redis is down, and the breaker stays closed")
		}
		_, _ = s.Take(ctx, time.Now(), slot(time.Minute))
	}
	if err := s.Release(ctx, first.Slots); !errors.Is(err, rediswire.ErrDown) {
		t.Fatalf("a release while Redis is down: %v, want %v", err, rediswire.ErrDown)
	}
}
