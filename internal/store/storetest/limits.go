// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package storetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// The limits that are not a zone's one fixed limit: limits that come
// with each request (plans), costs known after the response (usage),
// keys' own limits (overrides), and a refund. Each is replayed on a
// store of its own zones.

// plans are the limits the plan steps' requests bring: free is 1r/s
// burst 2 (full in 2s), pro 10r/s burst 5 (full in 500ms).
var plans = map[string]gcra.Limit{"free": gcra.NewLimit(1, 2), "pro": gcra.NewLimit(10, 5)}

// planZone is a zone whose limit comes with each request: its spec's
// shape is the zero limit.
func planZone(name string) store.ZoneSpec {
	return store.ZoneSpec{Name: name, Bucket: true, MaxOverrides: store.DefaultMaxOverrides}
}

type planStep struct {
	at   time.Duration
	plan string
	ok   bool
	rem  int64
}

var planSteps = []planStep{
	{0, "free", true, 1},
	{0, "free", true, 0},
	{0, "free", false, 0}, // owes 2s: all of its bucket
	// Now pro: the bucket owes all of a pro bucket, from now on…
	{0, "pro", false, 0},
	// …so a pro token comes back at pro's rate, not after free's 2s.
	{100 * time.Millisecond, "pro", true, 0},
	// Back to free, the bucket owes what it owed, all of it: a change of
	// plan hands back no tokens (free would have 1.5 of its 2 if the
	// debt were carried as time).
	{100 * time.Millisecond, "free", false, 0},
	{100 * time.Millisecond, "free", false, 0},
	{100 * time.Millisecond, "pro", false, 0}, // all of a pro bucket again: full at 600ms
	{700 * time.Millisecond, "pro", true, 4},
	// A fifth of a pro bucket owed is a fifth of free's: 0.4s of 2s.
	{700 * time.Millisecond, "free", true, 0},
}

// planReplay replays planSteps on a store of one zone whose limit comes
// with each request.
func planReplay(t *testing.T, newStore NewStore) {
	t.Helper()
	var now time.Time
	s := newStore(t, []store.ZoneSpec{planZone("p")}, func() time.Time { return now })
	start := time.Now() // after the store's making: a store's instants may start then
	for i, st := range planSteps {
		now = start.Add(st.at)
		l := plans[st.plan]
		d := &store.Demands{Buckets: []store.BucketDemand{{Key: store.Key{Text: "k"}, Limit: l, Cost: l.TokenTime}}}
		ok, err := s.Take(context.Background(), now, d)
		if err != nil {
			t.Fatalf("plan step %d: %v", i, err)
		}
		if ok != st.ok {
			t.Fatalf("plan step %d (%s): allowed = %v, want %v", i, st.plan, ok, st.ok)
		}
		if got := d.Buckets[0].Remaining(); got != st.rem {
			t.Fatalf("plan step %d (%s): %d tokens left, want %d", i, st.plan, got, st.rem)
		}
	}
}

// The zone of the usage steps: 100/m (a token is 600ms), burst 100, and
// a usage that may take the bucket 20 tokens past empty (max_debt); its
// quota of 1000 a day counts the same usage, in windows of quotaWindow.
func usageZone() (gcra.Limit, store.ZoneSpec) {
	l := gcra.NewLimit(100.0/60, 100)
	l.Owe = l.CostTime(20)
	return l, store.ZoneSpec{Name: "u", Bucket: true, Shape: l, Quota: "day@UTC", Refunds: true, MaxOverrides: store.DefaultMaxOverrides}
}

const usageQuota = 1000

type usageStep struct {
	at     time.Duration
	adjust int64 // tokens a response's usage charges beyond the cost (negative: gives back); 0: a take
	ok     bool  // a take: allowed
	owed   int64 // tokens the bucket owes after the step: 100 is empty, 110 ten in debt
	used   int64 // the quota's count after the step
}

// Costs known after the response: the example of usage's docs (a
// response of 60 tokens, then one of 50, leave the bucket owing 10, and
// the next request waits for 11 tokens: 6.6s), then a debt clamped to
// max_debt, a counter past its limit, and refunds.
var usageSteps = []usageStep{
	{0, 0, true, 1, 1},
	{0, 59, true, 60, 60},
	{0, 0, true, 61, 61},
	{0, 49, true, 110, 110},
	{0, 0, false, 110, 110},
	{6 * time.Second, 0, false, 100, 110},
	{6600 * time.Millisecond, 0, true, 100, 111},
	{6600 * time.Millisecond, 1000, true, 120, 1111},
	{6600 * time.Millisecond, 0, false, 120, 1111},
	{6600 * time.Millisecond, -5, true, 115, 1106},
	{6600 * time.Millisecond, -200, true, 0, 906},
}

// usageReplay replays usageSteps, and reads the bucket and the counter
// back after each.
func usageReplay(t *testing.T, newStore NewStore) {
	t.Helper()
	w := int64(quotaWindow)
	start := time.Unix(0, time.Now().Add(quotaWindow).UnixNano()/w*w)
	var now time.Time
	l, spec := usageZone()
	s := newStore(t, []store.ZoneSpec{spec}, func() time.Time { return now })
	windows := &calendar.Windows{Every: quotaWindow}
	k := store.Key{Text: "k"}
	demands := func() *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{{Key: k, Limit: l, Cost: l.TokenTime}},
			Counters: []store.CounterDemand{{Key: k, Limit: usageQuota, Cost: 1, Window: windows.Window(now)}}}
	}
	for i, st := range usageSteps {
		now = start.Add(st.at)
		d := demands()
		var err error
		if st.adjust == 0 {
			var ok bool
			if ok, err = s.Take(context.Background(), now, d); ok != st.ok {
				t.Fatalf("usage step %d: allowed = %v, want %v", i, ok, st.ok)
			}
			if b := &d.Buckets[0]; !st.ok && b.Debt > l.BurstTime && b.Wait() != time.Duration(st.owed+1-100)*l.TokenTime {
				t.Fatalf("usage step %d: wait %v for a bucket owing %d tokens, want the time of %d tokens", i, b.Wait(), st.owed, st.owed+1-100)
			}
		} else {
			d.Buckets[0].Cost = l.Spend(st.adjust+1) - l.TokenTime
			d.Counters[0].Cost = st.adjust
			err = s.Adjust(context.Background(), now, d)
		}
		if err != nil {
			t.Fatalf("usage step %d: %v", i, err)
		}
		d = demands()
		if err := s.Peek(context.Background(), now, d); err != nil {
			t.Fatalf("usage step %d: peek: %v", i, err)
		}
		if got, want := d.Buckets[0].Debt, time.Duration(st.owed)*l.TokenTime; got != want {
			t.Fatalf("usage step %d: the bucket owes %v, want %v (%d tokens)", i, got, want, st.owed)
		}
		if got := d.Counters[0].Used; got != st.used {
			t.Fatalf("usage step %d: the quota counted %d, want %d", i, got, st.used)
		}
	}
}

// The zones of the override steps: o 1r/s burst 2, and p, whose limit
// comes with each request (at plan free: 1r/s burst 2).
var overrideLimit = gcra.NewLimit(1, 2)

func overrideZones() []store.ZoneSpec {
	return []store.ZoneSpec{{Name: "o", Bucket: true, Shape: overrideLimit, MaxOverrides: store.DefaultMaxOverrides}, planZone("p")}
}

// An overrideStep takes a token of a key in a zone, or sets (rate) or
// removes (remove) the key's own limit there.
type overrideStep struct {
	at         time.Duration
	zone, key  string
	rate       float64 // set the key's own limit: this rate (tokens a second) and burst
	burst      int64
	remove     bool  // remove it; ok says whether there was one
	ok         bool  // a take: allowed
	rem, limit int64 // a take: tokens left, of a bucket of this burst
}

var overrideSteps = []overrideStep{
	{0, "o", "k", 0, 0, false, true, 1, 2},
	{0, "o", "k", 0, 0, false, true, 0, 2},
	{0, "o", "k", 0, 0, false, false, 0, 2},
	// Emptied at burst 2, raised to 5: 3 tokens at once.
	{0, "o", "k", 1, 5, false, false, 0, 0},
	{0, "o", "k", 0, 0, false, true, 2, 5},
	{0, "o", "k", 0, 0, false, true, 1, 5},
	{0, "o", "k", 0, 0, false, true, 0, 5},
	{0, "o", "k", 0, 0, false, false, 0, 5},
	// A faster rate keeps the tokens spent: all 5, now of 100ms each.
	{0, "o", "k", 10, 5, false, false, 0, 0},
	{0, "o", "k", 0, 0, false, false, 0, 5},
	{100 * time.Millisecond, "o", "k", 0, 0, false, true, 0, 5},
	// Back to the zone's limit, owing a whole bucket: empty, refilling
	// at the zone's rate.
	{100 * time.Millisecond, "o", "k", 0, 0, true, true, 0, 0},
	{100 * time.Millisecond, "o", "k", 0, 0, false, false, 0, 2},
	{1100 * time.Millisecond, "o", "k", 0, 0, false, true, 0, 2},
	{1100 * time.Millisecond, "o", "k", 0, 0, true, false, 0, 0}, // none to remove
	// Lowered, a bucket keeps the tokens it holds, up to its burst.
	{2 * time.Second, "o", "j", 100, 100, false, false, 0, 0},
	{2 * time.Second, "o", "j", 0, 0, false, true, 99, 100},
	{2 * time.Second, "o", "j", 0, 0, false, true, 98, 100},
	{2 * time.Second, "o", "j", 100, 10, false, false, 0, 0},
	{2 * time.Second, "o", "j", 0, 0, false, true, 9, 10},
	{2 * time.Second, "o", "j", 0, 0, true, true, 0, 0},
	{2 * time.Second, "o", "j", 0, 0, false, true, 1, 2},
	// A key without a bucket has its own limit from its first request.
	{3 * time.Second, "o", "n", 1.0 / 60, 3, false, false, 0, 0},
	{3 * time.Second, "o", "n", 0, 0, false, true, 2, 3},
	// Where the limit comes with each request, an override is one more
	// plan: the bucket keeps the fraction it owed (all of it here).
	{0, "p", "k", 0, 0, false, true, 1, 2},
	{0, "p", "k", 0, 0, false, true, 0, 2},
	{0, "p", "k", 1, 10, false, false, 0, 0},
	{0, "p", "k", 0, 0, false, false, 0, 10},
	{100 * time.Millisecond, "p", "k", 0, 0, false, false, 0, 10},
	{time.Second, "p", "k", 0, 0, false, true, 0, 10},
}

// overrideReplay replays overrideSteps: a change of a key's own limit
// carries its bucket over alike on every store.
func overrideReplay(t *testing.T, newStore NewStore) {
	t.Helper()
	var now time.Time
	s := newStore(t, overrideZones(), func() time.Time { return now })
	start := time.Now() // after the store's making: a store's instants may start then
	ctx := context.Background()
	for i, st := range overrideSteps {
		now = start.Add(st.at)
		zone, k := 0, store.Key{Text: st.key}
		l := overrideLimit
		if st.zone == "p" {
			zone, l = 1, plans["free"]
		}
		switch {
		case st.rate != 0:
			o := store.Override{TokenTime: gcra.NewLimit(st.rate, st.burst).TokenTime, Burst: st.burst, Rate: fmt.Sprintf("%g/s", st.rate)}
			if err := s.SetOverride(ctx, now, zone, k, o); err != nil {
				t.Fatalf("override step %d: %v", i, err)
			}
			continue
		case st.remove:
			if found, err := s.DeleteOverride(ctx, now, zone, k); err != nil || found != st.ok {
				t.Fatalf("override step %d: removed %v, %v; want %v", i, found, err, st.ok)
			}
			continue
		}
		d := &store.Demands{Buckets: []store.BucketDemand{{Zone: zone, Key: k, Limit: l, Cost: l.TokenTime}}}
		ok, err := s.Take(ctx, now, d)
		if err != nil {
			t.Fatalf("override step %d: %v", i, err)
		}
		if q := &d.Buckets[0]; ok != st.ok || q.Remaining() != st.rem || q.Limit.Burst != st.limit {
			t.Fatalf("override step %d: allowed %v, %d tokens left of %d; want %v, %d of %d", i, ok, q.Remaining(), q.Limit.Burst, st.ok, st.rem, st.limit)
		}
	}
}

// refundReplay checks that a refund gives an empty bucket its tokens
// back whatever its rate: one whose token is not a whole number of
// nanoseconds (11/2914ms), emptied, then refunded at the same instant,
// holds a token again.
func refundReplay(t *testing.T, newStore NewStore) {
	t.Helper()
	var now time.Time
	l := gcra.NewLimit(11/2.914, 2)
	s := newStore(t, []store.ZoneSpec{{Name: "refund", Bucket: true, Shape: l, MaxOverrides: store.DefaultMaxOverrides}},
		func() time.Time { return now })
	now = time.Now() // after the store's making: a store's instants may start then
	demands := func() *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{{Key: store.Key{Text: "k"}, Limit: l, Cost: l.TokenTime}}}
	}
	d := demands()
	for range 2 {
		if ok, err := s.Take(context.Background(), now, d); !ok || err != nil {
			t.Fatalf("take: %v, %v", ok, err)
		}
	}
	if got := d.Buckets[0].Remaining(); got != 0 {
		t.Fatalf("%d tokens left after two takes, want 0", got)
	}
	d.Buckets[0].Cost = -d.Buckets[0].Cost // a refund
	if err := s.Adjust(context.Background(), now, d); err != nil {
		t.Fatal(err)
	}
	d = demands()
	if err := s.Peek(context.Background(), now, d); err != nil {
		t.Fatal(err)
	}
	if q := &d.Buckets[0]; q.Remaining() != 1 {
		t.Fatalf("%d tokens after the refund, want 1 (debt %v, a token %v)", q.Remaining(), q.Debt, l.TokenTime)
	}
}
