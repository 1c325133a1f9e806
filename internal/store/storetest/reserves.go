// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Reserves: a request of a class keeps the reserves of the classes above
// its own in the bucket (gcra.Limit.Kept). Zone r is 1r/m burst 10 with
// `reserve high 30%`: the lowest class takes 7 tokens, high the other 3.
// Zone a is 1r/m burst 100, without reserves, which every request of the
// steps of key "ra" also asks of: a request that r refuses spends
// nothing there. Zone p's limit comes with each request (plans).

var reserveLimit = gcra.NewLimit(1.0/60, 10)

func reserveZones() []store.ZoneSpec {
	return []store.ZoneSpec{
		{Name: "r", Bucket: true, Shape: reserveLimit, MaxOverrides: store.DefaultMaxOverrides},
		{Name: "a", Bucket: true, Shape: gcra.NewLimit(1.0/60, 100), MaxOverrides: store.DefaultMaxOverrides},
		planZone("p"),
	}
}

// A reserveStep is a take of one token of the zone's bucket by a request
// of the lowest class (keeping 30%) or of high (keeping none), or sets
// the key's own limit (burst, at 1r/m).
type reserveStep struct {
	at    time.Duration
	zone  int
	key   string
	high  bool
	burst int64 // set the key's own limit to 1r/m and this burst
	ok    bool
	rem   int64         // tokens left, as the request's class sees them
	wait  time.Duration // a refusal's wait
	other int64         // for key "ra": tokens left in zone a, after the step
}

var reserveSteps = func() []reserveStep {
	var s []reserveStep
	// The lowest class empties its part: 7 of 10.
	for i := range 7 {
		s = append(s, reserveStep{zone: 0, key: "ra", ok: true, rem: int64(6 - i), other: int64(99 - i)})
	}
	const m = time.Minute
	s = append(s,
		// Refused by the reserve, and nothing spent in zone a: a token
		// comes back in a minute.
		reserveStep{zone: 0, key: "ra", wait: m, other: 93},
		reserveStep{zone: 0, key: "ra", wait: m, other: 93},
		// High takes the other 3 (from what the cache may have learnt of
		// the lowest class's refusal).
		reserveStep{zone: 0, key: "ra", high: true, ok: true, rem: 2, other: 92},
		reserveStep{zone: 0, key: "ra", high: true, ok: true, rem: 1, other: 91},
		reserveStep{zone: 0, key: "ra", high: true, ok: true, rem: 0, other: 90},
		reserveStep{zone: 0, key: "ra", high: true, wait: m, other: 90},
		// A minute on: one token, for high only; the lowest class waits
		// for the bucket to hold 3 + 1.
		reserveStep{at: m, zone: 0, key: "ra", wait: 3 * m, other: 91},
		reserveStep{at: m, zone: 0, key: "ra", high: true, ok: true, rem: 0, other: 90},
		// A key's own burst scales its reserves: burst 20 keeps 6 from
		// the lowest class, which takes 14.
		reserveStep{at: m, zone: 0, key: "o", burst: 20},
	)
	for i := range 14 {
		s = append(s, reserveStep{at: m, zone: 0, key: "o", ok: true, rem: int64(13 - i)})
	}
	s = append(s,
		reserveStep{at: m, zone: 0, key: "o", wait: m},
		reserveStep{at: m, zone: 0, key: "o", high: true, ok: true, rem: 5},
		// A plan of 1r/s burst 2 (free) keeps 0.6 of a token: the lowest
		// class has one token, high both.
		reserveStep{at: m, zone: 2, key: "p", ok: true, rem: 0},
		reserveStep{at: m, zone: 2, key: "p", wait: 600 * time.Millisecond},
		reserveStep{at: m, zone: 2, key: "p", high: true, ok: true, rem: 0},
		reserveStep{at: m, zone: 2, key: "p", high: true, wait: time.Second},
	)
	return s
}()

// reserveReplay replays reserveSteps.
func reserveReplay(t *testing.T, newStore NewStore) {
	t.Helper()
	var now time.Time
	s := newStore(t, reserveZones(), func() time.Time { return now })
	start := time.Now() // after the store's making: a store's instants may start then
	ctx := context.Background()
	for i, st := range reserveSteps {
		now = start.Add(st.at)
		k := store.Key{Text: st.key}
		if st.burst > 0 {
			o := store.Override{TokenTime: reserveLimit.TokenTime, Burst: st.burst, Rate: "1r/m"}
			if err := s.SetOverride(ctx, now, st.zone, k, o); err != nil {
				t.Fatalf("reserve step %d: %v", i, err)
			}
			continue
		}
		l := reserveLimit
		if st.zone == 2 {
			l = plans["free"]
		}
		if !st.high {
			l = l.Keeping(0.3)
		}
		d := &store.Demands{Buckets: []store.BucketDemand{{Zone: st.zone, Key: k, Limit: l, Cost: l.TokenTime}}}
		if st.key == "ra" {
			a := gcra.NewLimit(1.0/60, 100)
			d.Buckets = append(d.Buckets, store.BucketDemand{Zone: 1, Key: k, Limit: a, Cost: a.TokenTime})
		}
		ok, err := s.Take(ctx, now, d)
		if err != nil {
			t.Fatalf("reserve step %d: %v", i, err)
		}
		q := &d.Buckets[0]
		if ok != st.ok || q.OK != st.ok {
			t.Fatalf("reserve step %d: allowed %v (bucket %v), want %v (debt %v)", i, ok, q.OK, st.ok, q.Debt)
		}
		if !ok && q.Wait() != st.wait {
			t.Fatalf("reserve step %d: wait %v, want %v", i, q.Wait(), st.wait)
		}
		if ok && q.Remaining() != st.rem {
			t.Fatalf("reserve step %d: %d tokens left, want %d", i, q.Remaining(), st.rem)
		}
		if st.key == "ra" {
			p := &store.Demands{Buckets: d.Buckets[1:2:2]}
			p.Buckets[0].Debt = 0
			if err := s.Peek(ctx, now, p); err != nil {
				t.Fatalf("reserve step %d: peek: %v", i, err)
			}
			if got := p.Buckets[0].Remaining(); got != st.other {
				t.Fatalf("reserve step %d: zone a holds %d tokens, want %d", i, got, st.other)
			}
		}
	}
}
