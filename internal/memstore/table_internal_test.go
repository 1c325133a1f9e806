// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

func keyOf(s string) store.Key { return store.Key{Text: s} }

func newTestCharge(tab *Table[Bucket], l gcra.Limit, k string, now time.Time) charge {
	return charge{l: l, cost: l.CostTime(1), t: tab, h: tab.Hash(keyOf(k)), now: tab.Instant(now)}
}

func TestTakeAllIsAllOrNothing(t *testing.T) {
	a := NewBuckets(100, tm0)
	b := NewBuckets(100, tm0)
	la := gcra.NewLimit(10, 5)
	lb := gcra.NewLimit(10, 1)

	cs := []charge{newTestCharge(a, la, "k", tm0), newTestCharge(b, lb, "k", tm0)}
	if ok := takeAll(cs, nil, nil); !ok {
		t.Fatal("first request denied")
	}
	// b is empty now: the second request must be denied and spend
	// nothing in a.
	cs = []charge{newTestCharge(a, la, "k", tm0), newTestCharge(b, lb, "k", tm0)}
	if ok := takeAll(cs, nil, nil); ok {
		t.Fatal("second request allowed past an empty bucket")
	}
	for _, c := range cs {
		if c.t == a && (!c.ok || la.Tokens(c.debt) != 4) {
			t.Fatalf("zone a: ok = %v, remaining %v, want true, 4", c.ok, la.Tokens(c.debt))
		}
		if c.t == b && c.ok {
			t.Fatal("zone b allowed")
		}
	}
	if got := la.Tokens(la.Debt(BucketAt(a, keyOf("k")), 0)); got != 4 {
		t.Fatalf("zone a holds %v tokens, want 4: the denied request spent some", got)
	}
}

// Requests that take two tables in opposite orders must not deadlock,
// and every allowed request must be charged to both.
func TestTakeAllConcurrentNoDeadlock(t *testing.T) {
	a := NewBuckets(1000, tm0)
	b := NewBuckets(1000, tm0)
	l := gcra.NewLimit(1, 1_000_000)
	var wg sync.WaitGroup
	var allowed atomic.Int64
	for g := range 8 {
		wg.Go(func() {
			for range 2000 {
				cs := []charge{newTestCharge(a, l, "k", tm0), newTestCharge(b, l, "k", tm0)}
				if g%2 == 1 {
					cs[0], cs[1] = cs[1], cs[0]
				}
				if ok := takeAll(cs, nil, nil); ok {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	for _, tab := range []*Table[Bucket]{a, b} {
		h := tab.Hash(keyOf("k"))
		if got := l.Tokens(l.Debt(tab.shard(h).m[h].FullAt, 0)); math.Round(got) != float64(1_000_000-allowed.Load()) {
			t.Fatalf("bucket holds %v, want %d", got, 1_000_000-allowed.Load())
		}
	}
}

func TestTableDropsFullBucketsFirst(t *testing.T) {
	tab := NewBuckets(10, tm0) // one shard of 10
	l := gcra.NewLimit(10, 1)  // a bucket is full again 100ms after its request
	for i := range 10 {
		cs := []charge{newTestCharge(tab, l, string(rune('a'+i)), tm0)}
		takeAll(cs, nil, nil)
	}
	if n := tab.size(); n != 10 {
		t.Fatalf("tracked %d keys, want 10", n)
	}
	// At tm2 all ten are full again: making room drops them, evicts none.
	cs := []charge{newTestCharge(tab, l, "new", tm2)}
	takeAll(cs, nil, nil)
	if n := tab.evictions.Load(); n != 0 {
		t.Fatalf("evicted %d buckets that were full", n)
	}
	if n := tab.size(); n != 1 {
		t.Fatalf("tracked %d keys after the sweep, want 1", n)
	}
}

func TestTableNeverGrowsPastMaxKeys(t *testing.T) {
	const maxKeys = 64 * 64 * 2 // sharded
	tab := NewBuckets(maxKeys, tm0)
	l := gcra.NewLimit(1.0/3600, 10) // nothing refills during the test
	for i := range 5 * maxKeys {
		cs := []charge{{l: l, cost: l.CostTime(1), t: tab, h: tab.Hash(store.Key{Net: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}), now: time.Duration(i)}}
		takeAll(cs, nil, nil)
		if i%1000 == 0 {
			if n := tab.size(); n > maxKeys {
				t.Fatalf("after %d keys: tracking %d, more than %d", i, n, maxKeys)
			}
		}
	}
	if n := tab.size(); n > maxKeys || n < maxKeys*9/10 {
		t.Fatalf("tracking %d keys, want close to and at most %d", n, maxKeys)
	}
	if evicted := tab.evictions.Load(); evicted != uint64(5*maxKeys-tab.size()) {
		t.Fatalf("evicted %d, want one per key beyond the %d tracked", evicted, tab.size())
	}
}

func TestBucketKeyHash(t *testing.T) {
	tab := NewBuckets(10, tm0)
	a := store.Key{Net: netip.MustParsePrefix("2001:db8::/64")}
	b := store.Key{Net: netip.MustParsePrefix("2001:db8::/64")}
	c := store.Key{Net: netip.MustParsePrefix("2001:db8:0:1::/64")}
	if tab.Hash(a) != tab.Hash(b) || tab.Hash(a) == tab.Hash(c) {
		t.Fatal("IP prefixes hash wrong")
	}
	long := make([]byte, 1<<20)
	if tab.Hash(keyOf(string(long))) == tab.Hash(keyOf(string(long[1:]))) {
		t.Fatal("long keys collide")
	}
}

// Memory per tracked key, as docs/performance.md states it. The figure is logged
// with -v; the test fails only if it is far off the 128-byte target.
func TestMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 1M keys")
	}
	const n = 1_000_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	tab := NewBuckets(2*n, tm0) // room for all: no evictions
	l := gcra.NewLimit(1, 10)
	for i := range n {
		k := store.Key{Net: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
		takeAll([]charge{{l: l, cost: l.CostTime(1), t: tab, h: tab.Hash(k), now: 0}}, nil, nil)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if tab.size() != n {
		t.Fatalf("tracking %d keys, want %d", tab.size(), n)
	}
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("%.1f bytes per tracked IPv4 key (1M keys)", per)
	if per > 128 {
		t.Fatalf("%.1f bytes per key, more than 128", per)
	}
	runtime.KeepAlive(tab)
}

// A client that keeps sending must not gain tokens from eviction while a
// flood of one-off keys overflows the table: 2M rotating keys through a
// zone of max_keys 100000 in 150 s, and a hot key polling the same zone,
// for bucket shapes where the flood's buckets and the hot key's look
// alike. The hot key gets what it would get from a table that never
// evicts, within 10%.
func TestEvictionSparesClientsThatKeepSending(t *testing.T) {
	if testing.Short() {
		t.Skip("2M decisions per case")
	}
	const (
		maxKeys  = 100_000
		flood    = 2_000_000
		duration = 150 * time.Second
	)
	for _, tc := range []struct {
		name      string
		rate      float64
		burst     int64
		cost      int64
		pollEvery time.Duration
	}{
		{"burst 1 at 1r/m, polling every 10ms", 1.0 / 60, 1, 1, 10 * time.Millisecond},
		{"burst 1 at 1r/m, polling every second", 1.0 / 60, 1, 1, time.Second},
		{"burst 10 at 10r/h, polling every 10ms", 10.0 / 3600, 10, 1, 10 * time.Millisecond},
		{"burst 3, cost 2, at 1r/m, polling every 100ms", 1.0 / 60, 3, 2, 100 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := gcra.NewLimit(tc.rate, tc.burst)
			cost := l.CostTime(tc.cost)
			tab := NewBuckets(maxKeys, tm0)
			oracle := NewBuckets(1<<20, tm0) // never full: never evicts
			hot := store.Key{Text: "hot"}
			step := duration / flood
			var got, want int
			nextPoll := time.Duration(0)
			for i := range flood {
				now := time.Duration(i) * step
				k := store.Key{Net: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
				takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.Hash(k), now: now}}, nil, nil)
				if now >= nextPoll {
					nextPoll += tc.pollEvery
					if takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.Hash(hot), now: now}}, nil, nil) {
						got++
					}
					if takeAll([]charge{{l: l, cost: cost, t: oracle, h: oracle.Hash(hot), now: now}}, nil, nil) {
						want++
					}
				}
			}
			t.Logf("hot key allowed %d, without eviction %d; %d evictions", got, want, tab.evictions.Load())
			if tab.evictions.Load() == 0 {
				t.Fatal("the flood evicted nothing: the test does not test eviction")
			}
			if float64(got) > 1.1*float64(want) {
				t.Fatalf("hot key allowed %d, more than 10%% over the %d it is due", got, want)
			}
		})
	}
}

const manyKeys = 1 << 20

// ipKeys are a million distinct IPv4 keys, as the handler makes them.
var ipKeys = sync.OnceValue(func() []store.Key {
	keys := make([]store.Key, manyKeys)
	for i := range keys {
		keys[i] = store.Key{Net: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), 32)}
	}
	return keys
})

func BenchmarkDecision(b *testing.B) {
	for _, keys := range []int{1, manyKeys} {
		for _, parallel := range []bool{false, true} {
			name := fmt.Sprintf("keys=%d/parallel=%v", keys, parallel)
			b.Run("tokenbucket/"+name, func(b *testing.B) {
				tab := NewBuckets(2*manyKeys, time.Now())
				l := gcra.NewLimit(1e9, 1e9)
				ks := ipKeys()[:keys]
				for _, k := range ks { // steady state: keys already tracked
					takeAll([]charge{{l: l, cost: l.CostTime(1), t: tab, h: tab.Hash(k), now: 1}}, nil, nil)
				}
				cost := l.CostTime(1) // per zone, once
				decide := func(i int, now time.Time) {
					k := ks[i]
					cs := [1]charge{{l: l, cost: cost, t: tab, h: tab.Hash(k), now: tab.Instant(now)}}
					takeAll(cs[:], nil, nil)
				}
				runDecisions(b, parallel, keys, decide)
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

// BenchmarkEviction is a flood of one-off keys through a full zone: each
// decision is a new key, so each evicts a bucket that has not refilled.
func BenchmarkEviction(b *testing.B) {
	const maxKeys = 100_000
	tab := NewBuckets(maxKeys, time.Now())
	l := gcra.NewLimit(1.0/60, 1)
	cost := l.CostTime(1)
	keys := ipKeys()
	for i := range maxKeys { // full, of buckets that refill in a minute
		takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.Hash(keys[i]), now: 1}}, nil, nil)
	}
	b.ReportAllocs()
	i := maxKeys
	for b.Loop() {
		k := keys[i%len(keys)]
		takeAll([]charge{{l: l, cost: cost, t: tab, h: tab.Hash(k), now: 1 + time.Duration(i)}}, nil, nil)
		i++
	}
	if tab.evictions.Load() == 0 {
		b.Fatal("nothing was evicted")
	}
}

// A small table keeps a client that keeps sending, however many one-off
// keys come between its requests: a zone of max_keys 100 whose client
// sends after every 90 new keys never finds a fresh bucket, and holds 100
// keys. So does a table made for many keys whose max_keys a reload lowers
// to 100; it keeps room for 64 keys a shard.
func TestSmallTableKeepsAClientThatKeepsSending(t *testing.T) {
	for _, created := range []int64{100, 1_000_000} {
		tab := NewBuckets(created, tm0)
		tab.maxKeys.Store(100)
		l := gcra.NewLimit(1.0/60, 1) // a token a minute: nothing refills during the test
		now := time.Duration(0)
		take := func(k string) {
			now += time.Microsecond
			takeAll([]charge{{l: l, cost: l.CostTime(1), t: tab, h: tab.Hash(keyOf(k)), now: now}}, nil, nil)
		}
		take("hot")
		lost := 0
		for round := range 20 {
			for i := range 90 {
				take(fmt.Sprint("once-", round, "-", i))
			}
			if _, ok := tab.Lookup(keyOf("hot")); !ok {
				lost++
			}
			take("hot")
		}
		if lost != 0 {
			t.Errorf("made for %d keys: the client lost its bucket %d of 20 times", created, lost)
		}
		if most := max(100, len(tab.shards)*minShardCap(len(tab.shards))); tab.size() > most {
			t.Errorf("made for %d keys: %d kept, more than %d", created, tab.size(), most)
		}
	}
}

// IP networks and strings hash apart, and so do the two families. (The
// networks of one zone have one length per family, which need not be
// hashed.)
func TestTableHashKinds(t *testing.T) {
	tab := NewBuckets(100, tm0)
	seen := map[uint64]string{}
	for _, k := range []store.Key{
		{Net: netip.MustParsePrefix("192.0.2.1/32")},
		{Net: netip.MustParsePrefix("192.0.2.0/24")},
		{Net: netip.MustParsePrefix("::ffff:192.0.2.1/128")},
		{Net: netip.MustParsePrefix("2001:db8::/64")},
		{Net: netip.MustParsePrefix("2001:db8:0:1::/64")},
		{Net: netip.MustParsePrefix("0:0:c000:201::/64")}, // 192.0.2.1 as an IPv6 word
		{Net: netip.MustParsePrefix("2001:db8::1/128")},
		{Net: netip.MustParsePrefix("2001:db8::2/128")},
		{Net: netip.MustParsePrefix("2001:db8::/96")},
		{Text: "192.0.2.1"},
		{Text: ""},
	} {
		h := tab.Hash(k)
		if other, ok := seen[h]; ok {
			t.Errorf("%v and %s hash alike", k, other)
		}
		seen[h] = k.String()
	}
	other := NewBuckets(100, tm0)
	if k := keyOf("a"); tab.Hash(k) == other.Hash(k) {
		t.Error("two tables with random keys hash alike")
	}
	other.key = tab.key
	if k := keyOf("a"); tab.Hash(k) != other.Hash(k) {
		t.Error("two tables with one key hash apart")
	}
}

func BenchmarkTableHash(b *testing.B) {
	tab := NewBuckets(100, tm0)
	for _, k := range []store.Key{
		{Net: netip.MustParsePrefix("192.0.2.1/32")},
		{Net: netip.MustParsePrefix("2001:db8::/64")},
		{Text: "an-api-key-of-32-bytes-abcdefghi"},
	} {
		b.Run(k.String()[:min(len(k.String()), 12)], func(b *testing.B) {
			for b.Loop() {
				_ = tab.Hash(k)
			}
		})
	}
}

// Named instants, as in golang.org/x/time/rate's tests.
var (
	tm0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tm2 = tm0.Add(200 * time.Millisecond)
)

// A table's capacity, which the max_keys metric shows, is what it keeps
// at most: max_keys, rounded down to a whole share for each of a large
// table's 64 shards, and never below the 64 a shard that a table made
// large keeps when a reload lowers max_keys.
func TestMaxKeysCapacity(t *testing.T) {
	for _, tc := range []struct {
		created, loaded int64
		want            int
	}{
		{8, 8, 8},
		{4095, 4095, 4095},
		{5000, 5000, 4992},
		{1_000_000, 1_000_000, 1_000_000}, // the default max_keys
		{1_000_000, 100, 4096},
	} {
		tab := NewBuckets(tc.created, tm0)
		tab.SetMaxKeys(tc.loaded)
		if got := tab.capacity(); got != tc.want {
			t.Errorf("max_keys %d (table made for %d): capacity %d, want %d", tc.loaded, tc.created, got, tc.want)
		}
	}
}
