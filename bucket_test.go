// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"math"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Named instants, as in golang.org/x/time/rate's tests.
var (
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1 = t0.Add(100 * time.Millisecond)
	t2 = t0.Add(200 * time.Millisecond)
	t3 = t0.Add(300 * time.Millisecond)
	t4 = t0.Add(400 * time.Millisecond)
	t5 = t0.Add(500 * time.Millisecond)
	t9 = t0.Add(900 * time.Millisecond)
)

// A step is one request against a bucket and what it must get.
type step struct {
	t         time.Time
	n         int64   // tokens asked for
	ok        bool    // allowed?
	remaining float64 // tokens left after the decision
	wait      time.Duration
}

// runSteps replays steps against one bucket of shape l, starting full.
func runSteps(t *testing.T, l limit, steps []step) {
	t.Helper()
	var f time.Duration
	for i, s := range steps {
		now := s.t.Sub(t0)
		cost := l.costTime(s.n)
		nf, ok := l.take(f, now, cost)
		if ok != s.ok {
			t.Fatalf("step %d: ok = %v, want %v", i, ok, s.ok)
		}
		if !ok && nf != f {
			t.Fatalf("step %d: a denied request moved the bucket from %d to %d", i, f, nf)
		}
		f = nf
		debt := l.debt(f, now)
		if got := l.tokens(debt); math.Abs(got-s.remaining) > 1e-6 {
			t.Fatalf("step %d: remaining = %v, want %v", i, got, s.remaining)
		}
		if !ok {
			if got := l.wait(debt, cost); got != s.wait {
				t.Fatalf("step %d: wait = %v, want %v", i, got, s.wait)
			}
		}
	}
}

func TestBucketMath(t *testing.T) {
	tests := []struct {
		name  string
		rate  float64 // tokens per second
		burst int64
		steps []step
	}{
		{"burst exhaustion", 10, 3, []step{
			{t: t0, n: 1, ok: true, remaining: 2},
			{t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
		}},
		{"refill", 10, 2, []step{
			{t: t0, n: 2, ok: true, remaining: 0},
			{t: t1, n: 1, ok: true, remaining: 0},
			{t: t1, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t3, n: 1, ok: true, remaining: 1},
			{t: t9, n: 1, ok: true, remaining: 1}, // capped at burst before taking
		}},
		{"clock going backwards", 10, 2, []step{
			{t: t5, n: 2, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t5.Add(100 * time.Millisecond), n: 1, ok: true, remaining: 0},
		}},
		{"fractional rate", 0.5, 1, []step{
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t9, n: 1, ok: false, remaining: 0.45, wait: 1100 * time.Millisecond},
			{t: t0.Add(2 * time.Second), n: 1, ok: true, remaining: 0},
		}},
		{"cost above 1", 10, 5, []step{
			{t: t0, n: 3, ok: true, remaining: 2},
			{t: t0, n: 3, ok: false, remaining: 2, wait: 100 * time.Millisecond},
			{t: t1, n: 3, ok: true, remaining: 0},
		}},
		{"long idle", 1, 10, []step{
			{t: t0, n: 10, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 1, ok: true, remaining: 9},
		}},
		{"huge values", 1e-6, 1000, []step{ // a token per 11.6 days; 31.7 years to refill
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 4, ok: false, remaining: 3.6, wait: 400000 * time.Second},
		}},
		{"whole burst at a rate of odd token time", 7, 7, []step{
			{t: t0, n: 1, ok: true, remaining: 6}, {t: t0, n: 1, ok: true, remaining: 5},
			{t: t0, n: 1, ok: true, remaining: 4}, {t: t0, n: 1, ok: true, remaining: 3},
			{t: t0, n: 1, ok: true, remaining: 2}, {t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 142857143},
		}},
		{"fast rate", 1e9, 1000, []step{
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(time.Microsecond), n: 1000, ok: true, remaining: 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runSteps(t, newLimit(tt.rate, tt.burst), tt.steps)
		})
	}
}

// A long run at the limit must allow exactly burst + rate·elapsed, with no
// drift from the rounding of fractional token intervals.
func TestBucketNoDrift(t *testing.T) {
	for _, rate := range []float64{3, 7, 1.0 / 3, 1000.0 / 7} {
		l := newLimit(rate, 5)
		cost := l.costTime(1)
		var f time.Duration
		allowed := 0
		const elapsed = 1000 * time.Second
		step := time.Duration(float64(time.Second) / rate / 10) // 10 tries per token
		for now := time.Duration(0); now <= elapsed; now += step {
			var ok bool
			if f, ok = l.take(f, now, cost); ok {
				allowed++
			}
		}
		want := 5 + rate*elapsed.Seconds()
		if math.Abs(float64(allowed)-want) > 1 {
			t.Errorf("rate %v: allowed %d in %v, want %.1f ± 1", rate, allowed, elapsed, want)
		}
	}
}

func TestNewLimitMaxBurstTime(t *testing.T) {
	// The largest bucket the configuration accepts must not overflow.
	l := newLimit(1.0/86400, 36500) // one a day, burst of 100 years
	if l.burstTime <= 0 || l.burstTime > maxBurstTime {
		t.Fatalf("burstTime = %v", l.burstTime)
	}
	f, ok := l.take(0, math.MaxInt64/4, l.costTime(36500))
	if !ok || f <= 0 {
		t.Fatalf("take at a far instant: f = %d, ok = %v", f, ok)
	}
}

func key(s string) bucketKey { return bucketKey{s: s} }

func newTestCharge(tab *table, l limit, k string, now time.Time) charge {
	return charge{l: l, cost: l.costTime(1), t: tab, h: tab.hash(key(k)), now: tab.instant(now)}
}

func TestTakeAllIsAllOrNothing(t *testing.T) {
	a := newTable(100, t0)
	b := newTable(100, t0)
	la := newLimit(10, 5)
	lb := newLimit(10, 1)

	cs := []charge{newTestCharge(a, la, "k", t0), newTestCharge(b, lb, "k", t0)}
	if ok := takeAll(cs); !ok {
		t.Fatal("first request denied")
	}
	// b is empty now: the second request must be denied and spend
	// nothing in a.
	cs = []charge{newTestCharge(a, la, "k", t0), newTestCharge(b, lb, "k", t0)}
	if ok := takeAll(cs); ok {
		t.Fatal("second request allowed past an empty bucket")
	}
	for _, c := range cs {
		if c.t == a && (!c.ok || la.tokens(c.debt) != 4) {
			t.Fatalf("zone a: ok = %v, remaining %v, want true, 4", c.ok, la.tokens(c.debt))
		}
		if c.t == b && c.ok {
			t.Fatal("zone b allowed")
		}
	}
	if got := la.tokens(la.debt(a.shard(a.hash(key("k"))).get(a.hash(key("k"))), 0)); got != 4 {
		t.Fatalf("zone a holds %v tokens, want 4: the denied request spent some", got)
	}
}

// Requests that take two tables in opposite orders must not deadlock,
// and every allowed request must be charged to both.
func TestTakeAllConcurrentNoDeadlock(t *testing.T) {
	a := newTable(1000, t0)
	b := newTable(1000, t0)
	l := newLimit(1, 1_000_000)
	var wg sync.WaitGroup
	var allowed atomic.Int64
	for g := range 8 {
		wg.Go(func() {
			for range 2000 {
				cs := []charge{newTestCharge(a, l, "k", t0), newTestCharge(b, l, "k", t0)}
				if g%2 == 1 {
					cs[0], cs[1] = cs[1], cs[0]
				}
				if ok := takeAll(cs); ok {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	for _, tab := range []*table{a, b} {
		h := tab.hash(key("k"))
		if got := l.tokens(l.debt(tab.shard(h).get(h), 0)); math.Round(got) != float64(1_000_000-allowed.Load()) {
			t.Fatalf("bucket holds %v, want %d", got, 1_000_000-allowed.Load())
		}
	}
}

func TestTableDropsFullBucketsFirst(t *testing.T) {
	tab := newTable(10, t0) // one shard of 10
	l := newLimit(10, 1)    // a bucket is full again 100ms after its request
	for i := range 10 {
		cs := []charge{newTestCharge(tab, l, string(rune('a'+i)), t0)}
		takeAll(cs)
	}
	if n := tab.len(); n != 10 {
		t.Fatalf("tracked %d keys, want 10", n)
	}
	// At t2 all ten are full again: making room drops them, evicts none.
	cs := []charge{newTestCharge(tab, l, "new", t2)}
	takeAll(cs)
	if n := tab.evictions.Load(); n != 0 {
		t.Fatalf("evicted %d buckets that were full", n)
	}
	if n := tab.len(); n != 1 {
		t.Fatalf("tracked %d keys after the sweep, want 1", n)
	}
}

func TestTableNeverGrowsPastMaxKeys(t *testing.T) {
	const maxKeys = 64 * 64 * 2 // sharded
	tab := newTable(maxKeys, t0)
	l := newLimit(1.0/3600, 10) // nothing refills during the test
	for i := range 5 * maxKeys {
		cs := []charge{{l: l, cost: l.costTime(1), t: tab, h: tab.hash(bucketKey{ip: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}), now: time.Duration(i)}}
		takeAll(cs)
		if i%1000 == 0 {
			if n := tab.len(); n > maxKeys {
				t.Fatalf("after %d keys: tracking %d, more than %d", i, n, maxKeys)
			}
		}
	}
	if n := tab.len(); n > maxKeys || n < maxKeys*9/10 {
		t.Fatalf("tracking %d keys, want close to and at most %d", n, maxKeys)
	}
	if evicted := tab.evictions.Load(); evicted != uint64(5*maxKeys-tab.len()) {
		t.Fatalf("evicted %d, want one per key beyond the %d tracked", evicted, tab.len())
	}
}

func TestBucketKeyHash(t *testing.T) {
	tab := newTable(10, t0)
	a := bucketKey{ip: netip.MustParsePrefix("2001:db8::/64")}
	b := bucketKey{ip: netip.MustParsePrefix("2001:db8::/64")}
	c := bucketKey{ip: netip.MustParsePrefix("2001:db8:0:1::/64")}
	if tab.hash(a) != tab.hash(b) || tab.hash(a) == tab.hash(c) {
		t.Fatal("IP prefixes hash wrong")
	}
	long := make([]byte, 1<<20)
	if tab.hash(key(string(long))) == tab.hash(key(string(long[1:]))) {
		t.Fatal("long keys collide")
	}
}

// Memory per tracked key, as the README states it. The figure is logged
// with -v; the test fails only if it is far off the 128-byte target.
func TestMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 1M keys")
	}
	const n = 1_000_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tab := newTable(2*n, t0) // room for all: no evictions
	l := newLimit(1, 10)
	for i := range n {
		k := bucketKey{ip: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
		takeAll([]charge{{l: l, cost: l.costTime(1), t: tab, h: tab.hash(k), now: 0}})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if tab.len() != n {
		t.Fatalf("tracking %d keys, want %d", tab.len(), n)
	}
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("%.1f bytes per tracked IPv4 key (1M keys)", per)
	if per > 128 {
		t.Fatalf("%.1f bytes per key, more than 128", per)
	}
	runtime.KeepAlive(tab)
}
