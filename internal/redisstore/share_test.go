// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// simClock is a clock the test moves: Redis's and the stores'.
type simClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *simClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *simClock) Add(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	return c.t
}

// ShareSpec is the spec of a zone of limit l with share of ttl.
func ShareSpec(name string, l gcra.Limit, ttl time.Duration) store.ZoneSpec {
	z := Bucket(name, l)
	z.Share = ttl
	return z
}

// shareInstances are n stores of one zone with share on one Redis, as n
// Caddy instances would have, on the clock c (nil: the real one).
func shareInstances(t *testing.T, n int, l gcra.Limit, ttl time.Duration, c *simClock) []*Store {
	t.Helper()
	r := redistest.Start(t)
	client := OpenClient(t, r.Addr())
	var opt Options
	opt.FailMode = "closed"
	if c != nil {
		opt.Clock = c.Now
	}
	stores := make([]*Store, n)
	for i := range stores {
		stores[i] = Open(t, client, []store.ZoneSpec{ShareSpec("api", l, ttl)}, opt)
	}
	return stores
}

// take is a request of one token of key at now.
func take(t *testing.T, s *Store, now time.Time, key string, l gcra.Limit) (bool, *store.Demands) {
	t.Helper()
	d := TakeOf(0, key, l)
	ok, err := s.Take(context.Background(), now, d)
	if err != nil {
		t.Fatal(err)
	}
	return ok, d
}

// A busy key's requests are decided here, from shares, with few calls to
// Redis; a key used rarely is decided by Redis at each request, and is
// granted no share.
func TestShareDecidesBusyKeysHere(t *testing.T) {
	l := gcra.NewLimit(100000, 100000)
	s := shareInstances(t, 1, l, time.Second, nil)[0]
	for range 20000 {
		if ok, _ := take(t, s, time.Now(), "busy", l); !ok {
			t.Fatal("a request of a bucket of 100000 was refused")
		}
	}
	st := s.Stats(0)
	if st.ShareRedis > 200 || st.ShareHere < 19800 || st.ShareGrants == 0 {
		t.Fatalf("20000 requests of one key: %d decided by Redis, %d here, %d grants; want at most 200 by Redis", st.ShareRedis, st.ShareHere, st.ShareGrants)
	}
	// The key's shared state: this instance's share among the holders.
	got, err := s.ShareState(context.Background(), 0, store.Key{Text: "busy"})
	if err != nil {
		t.Fatal(err)
	}
	if got.Holders != 1 || got.Out <= 0 || got.Here <= 0 || got.Here > got.Out || got.EndsIn <= 0 || got.EndsIn > time.Second {
		t.Fatalf("the busy key's shares: %+v, want this instance's, out and ending within the ttl", got)
	}
	for i := range 3 {
		take(t, s, time.Now(), "rare", l)
		if got := s.Stats(0); got.ShareRedis != st.ShareRedis+uint64(i+1) || got.ShareGrants != st.ShareGrants {
			t.Fatalf("rare request %d: %d by Redis, %d grants; want %d, %d", i, got.ShareRedis, got.ShareGrants, st.ShareRedis+uint64(i+1), st.ShareGrants)
		}
	}
}

// admissions checks the bound of one exact bucket of burst b tokens and a
// token every tt over every pair of admission instants: admitted between
// them at most b + the refill. It returns the largest excess found (≤ 0
// when the bound holds).
func excess(at []time.Duration, burst int64, tt time.Duration) float64 {
	sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
	worst, low := -float64(burst), 0.0
	for j, t := range at {
		v := float64(j) - float64(t)/float64(tt)
		if j == 0 || v < low {
			low = v
		}
		// admitted in [at[i], at[j]] is j - i + 1, for the i of the lowest
		// i - at[i]/tt.
		worst = max(worst, v-low+1-float64(burst))
	}
	return worst
}

// Never over, as a property: three instances of a zone with share, on a
// simulated clock, take random requests of one key, renew, return, and
// die (an instance forgets its shares, unreturned, and goes on with new
// ones): over every pair of admission instants the cluster admitted at
// most one exact bucket's burst and refill, and no less than a good part
// of what an exact bucket admits.
func TestShareNeverOverProperty(t *testing.T) {
	l := gcra.NewLimit(20, 40) // a token every 50ms
	c := &simClock{t: time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)}
	stores := shareInstances(t, 3, l, time.Second, c)
	for run := range 20 {
		rng := rand.New(rand.NewPCG(uint64(run), 7))
		key := "k" + string(rune('a'+run))
		start := c.Now()
		var at []time.Duration
		var exact gcra.Limit = l
		var fullAt time.Duration // an exact bucket beside, for the fraction admitted
		exactAdmitted := 0
		gap := []int{4, 20, 60, 200}[run%4] // ms, at most: floods to trickles
		for range 600 {
			// Redis's clock never goes back: a renewal in flight is
			// decided before the clock moves on.
			settle(t, stores)
			now := c.Add(time.Duration(rng.IntN(gap*1000)) * time.Microsecond)
			i := rng.IntN(len(stores))
			if run%2 == 1 && rng.IntN(10) < 8 {
				i = 0 // one instance takes 80%
			}
			if rng.IntN(200) == 0 {
				die(stores[rng.IntN(len(stores))])
			}
			if ok, _ := take(t, stores[i], now, key, l); ok {
				at = append(at, now.Sub(start))
			}
			if f, ok := exact.Take(fullAt, now.Sub(start), l.TokenTime); ok {
				fullAt = f
				exactAdmitted++
			}
		}
		if e := excess(at, l.Burst, l.TokenTime); e > 1e-9 {
			t.Fatalf("run %d: %d admitted, %.2f tokens over the exact bucket's bound", run, len(at), e)
		}
		if len(at) < exactAdmitted*8/10 {
			t.Fatalf("run %d: %d admitted, an exact bucket %d: want at least 80%%", run, len(at), exactAdmitted)
		}
		var st store.ZoneStats
		for _, s := range stores {
			x := s.Stats(0)
			st.ShareGrants, st.ShareReturns, st.ShareWriteOffs = st.ShareGrants+x.ShareGrants, st.ShareReturns+x.ShareReturns, st.ShareWriteOffs+x.ShareWriteOffs
			st.ShareHere, st.ShareRedis = st.ShareHere+x.ShareHere, st.ShareRedis+x.ShareRedis
		}
		t.Logf("run %d: %d admitted, exact %d; so far %d grants, %d returns, %d write-offs, %d here, %d by Redis",
			run, len(at), exactAdmitted, st.ShareGrants, st.ShareReturns, st.ShareWriteOffs, st.ShareHere, st.ShareRedis)
		c.Add(10 * time.Second)
	}
}

// settle waits until no renewal of stores is in flight.
func settle(t *testing.T, stores []*Store) {
	t.Helper()
	WaitFor(t, 5*time.Second, "the renewals in flight", func() bool {
		for _, s := range stores {
			sz := s.zones[0].shares
			for i := range sz.shards {
				sh := &sz.shards[i]
				sh.mu.Lock()
				for _, e := range sh.m {
					if e.asking {
						sh.mu.Unlock()
						return false
					}
				}
				sh.mu.Unlock()
			}
		}
		return true
	})
}

// die forgets s's shares without returning them, as an instance killed
// would: Redis writes them off when they end.
func die(s *Store) {
	sz := s.zones[0].shares
	for i := range sz.shards {
		sh := &sz.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			if !e.asking {
				e.holder, e.granted, e.spent = "", 0, 0
			}
		}
		sh.mu.Unlock()
	}
}

// A share whose holder died is written off when it ends: the others can
// then take what the bucket holds, and lose no more than that share, which
// refill brings back.
func TestShareDeadHolderWrittenOff(t *testing.T) {
	l := gcra.NewLimit(1, 40) // slow: a token a second
	c := &simClock{t: time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)}
	stores := shareInstances(t, 2, l, time.Second, c)
	a, b := stores[0], stores[1]
	for range 12 {
		take(t, a, c.Now(), "k", l)
	}
	WaitFor(t, 5*time.Second, "a's share", func() bool { return a.Stats(0).ShareGrants > 0 })
	granted, spent := shareOfKey(a, "k")
	if granted == 0 || granted > l.BurstTime/4 {
		t.Fatalf("a was granted %v, want a share of at most a quarter of the burst", granted)
	}
	die(a)
	// Before a's share ends, b gets what the bucket holds beside it.
	n := 0
	for {
		if ok, _ := take(t, b, c.Now(), "k", l); !ok {
			break
		}
		n++
	}
	held := int(l.Burst) - 12 - int((granted-spent)/l.TokenTime) + int(spent/l.TokenTime)
	if n > held {
		t.Fatalf("b took %d while a's share was out, want at most %d", n, held)
	}
	// When it ends, Redis writes it off: nothing comes back but refill.
	now := c.Add(1100 * time.Millisecond)
	got := 0
	for {
		if ok, _ := take(t, b, now, "k", l); !ok {
			break
		}
		got++
	}
	if got > 2 {
		t.Fatalf("after a's share ended b took %d: a written-off share gave tokens back", got)
	}
	// Refill brings the bucket back to its burst.
	now = c.Add(time.Minute)
	got = 0
	for {
		if ok, _ := take(t, b, now, "k", l); !ok {
			break
		}
		got++
	}
	if got < int(l.Burst)-int(l.Burst)/4 {
		t.Fatalf("a minute later b took %d, want at least %d", got, l.Burst-l.Burst/4)
	}
}

// shareOfKey is what s's share of key was granted and spent.
func shareOfKey(s *Store, key string) (granted, spent time.Duration) {
	sh, e := s.zones[0].shares.lock(store.Key{Text: key}, false)
	defer sh.mu.Unlock()
	if e == nil {
		return 0, 0
	}
	return e.granted, e.spent
}

// A key that goes idle returns its share: what it did not spend goes
// back, and another instance's remembered refusal does not outlive it.
func TestShareReturnedWhenIdle(t *testing.T) {
	l := gcra.NewLimit(1.0/60, 40) // a token a minute
	stores := shareInstances(t, 2, l, 200*time.Millisecond, nil)
	a, b := stores[0], stores[1]
	for range 10 {
		take(t, a, time.Now(), "k", l)
	}
	WaitFor(t, 5*time.Second, "a's share", func() bool { return a.Stats(0).ShareGrants > 0 })
	granted, spent := shareOfKey(a, "k")
	if granted-spent < l.TokenTime {
		t.Fatalf("a's share holds %v", granted-spent)
	}
	// b empties the bucket beside a's share, and is refused.
	for {
		ok, _ := take(t, b, time.Now(), "k", l)
		if !ok {
			break
		}
	}
	if ok, d := take(t, b, time.Now(), "k", l); ok {
		t.Fatal("b allowed past an empty bucket")
	} else if d.Remembered {
		t.Fatal("b remembered a refusal that a return could make wrong")
	}
	WaitFor(t, 5*time.Second, "a's return", func() bool { return a.Stats(0).ShareReturns > 0 })
	if ok, _ := take(t, b, time.Now(), "k", l); !ok {
		t.Fatal("after a returned its share, b was refused")
	}
	hash, field := a.BucketName(0, store.Key{Text: "k"})
	if v, _ := a.client.HGet(context.Background(), hash, field+"#").Result(); strings.Contains(v, a.zones[0].shares.holder) {
		t.Fatalf("a's holder is still in Redis: %q", v)
	}
}

// A key whose last request came before its share's renewal was due
// returns the share before it ends, rather than leave it to be written
// off: a quarter of a ttl after that request, when the share has at most
// half a ttl left. The clock stands still once the key goes idle, so the
// return can only come from that rule.
func TestShareReturnedBeforeItEnds(t *testing.T) {
	const ttl = 200 * time.Millisecond
	l := gcra.NewLimit(1000, 1000)
	c := &simClock{t: time.Now()}
	s := shareInstances(t, 1, l, ttl, c)[0]
	for range 10 {
		take(t, s, c.Now(), "k", l)
	}
	sh, e := s.zones[0].shares.lock(store.Key{Text: "k"}, false)
	if e == nil || e.holder == "" || e.granted-e.spent < 2*l.TokenTime {
		sh.mu.Unlock()
		t.Fatal("ten requests at once were granted no share")
	}
	until := e.until
	sh.mu.Unlock()
	// The last request, a little before the renewal is due (half a ttl
	// left), then a quarter of a ttl and more of idleness: the share ends
	// here before half a ttl of it.
	c.Add(until.Add(-ttl/2 - 20*time.Millisecond).Sub(c.Now()))
	if ok, _ := take(t, s, c.Now(), "k", l); !ok {
		t.Fatal("refused")
	}
	c.Add(ttl/4 + 10*time.Millisecond)
	WaitFor(t, 5*time.Second, "the return", func() bool { return s.Stats(0).ShareReturns == 1 })
	if st := s.Stats(0); st.ShareWriteOffs != 0 || st.ShareGrants != 1 {
		t.Fatalf("%d grants, %d write-offs: want the one share returned", st.ShareGrants, st.ShareWriteOffs)
	}
	got, err := s.ShareState(context.Background(), 0, store.Key{Text: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if got.Out != 0 || got.Holders != 0 {
		t.Fatalf("after the return: %+v, want nothing out", got)
	}
}

// A bucket that lacks the tokens even with every share back is refused
// without a call, until it can hold them: once a touch that tells the
// shares out has refused it (a plain take's refusal, which does not,
// sends the next request as one).
func TestShareRemembersRefusals(t *testing.T) {
	l := gcra.NewLimit(1.0/60, 5)
	s := shareInstances(t, 1, l, time.Second, nil)[0]
	for range 5 {
		take(t, s, time.Now(), "k", l)
	}
	for _, n := range []string{"sixth", "seventh"} {
		ok, d := take(t, s, time.Now(), "k", l)
		if ok || d.Remembered {
			t.Fatalf("the %s: allowed %v, remembered %v; want refused by Redis", n, ok, d.Remembered)
		}
	}
	before := s.Stats(0).ShareRedis
	for range 10 {
		ok, d := take(t, s, time.Now(), "k", l)
		if ok || !d.Remembered {
			t.Fatalf("allowed %v, remembered %v: want a remembered refusal", ok, d.Remembered)
		}
		if w := d.Buckets[0].Wait(); w < 50*time.Second || w > time.Minute {
			t.Fatalf("remembered refusal's wait %v, want about a minute", w)
		}
	}
	if got := s.Stats(0).ShareRedis; got != before {
		t.Fatalf("%d calls to Redis for remembered refusals", got-before)
	}
}

// A request refused by another of its zones gives back what the zone
// with share took, from the share or in Redis: all or nothing.
func TestShareAllOrNothing(t *testing.T) {
	r := redistest.Start(t)
	client := OpenClient(t, r.Addr())
	l, tight := gcra.NewLimit(1.0/60, 10), gcra.NewLimit(1.0/60, 1)
	s := Open(t, client, []store.ZoneSpec{ShareSpec("api", l, time.Second), Bucket("tight", tight)}, Options{FailMode: "closed"})
	both := func() bool {
		d := &store.Demands{Buckets: []store.BucketDemand{
			{Zone: 0, Key: store.Key{Text: "k"}, Limit: l, Cost: l.TokenTime},
			{Zone: 1, Key: store.Key{Text: "k"}, Limit: tight, Cost: tight.TokenTime},
		}}
		ok, err := s.Take(context.Background(), time.Now(), d)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !both() {
		t.Fatal("the first request refused")
	}
	for range 20 {
		if both() {
			t.Fatal("tight allowed a second request")
		}
	}
	// The zone with share was given back what the refusals took: 9 left.
	n := 0
	for {
		if ok, _ := take(t, s, time.Now(), "k", l); !ok {
			break
		}
		n++
	}
	if n != 9 {
		t.Fatalf("after 20 requests the other zone refused, the zone with share held %d, want 9", n)
	}
}

// On a 3-master Redis Cluster, busy keys of every master get shares, are
// decided here, and return them in flights that the cluster splits by
// hash tag.
func TestShareOnCluster(t *testing.T) {
	nodes := redistest.StartCluster(t)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.Addr())
	}
	l := gcra.NewLimit(100000, 100000)
	// A ttl of a second: a sweep that a loaded machine runs late by less
	// than a quarter of it still returns the idle keys' shares before
	// they end.
	s := Open(t, OpenClient(t, addrs...), []store.ZoneSpec{ShareSpec("api", l, time.Second)}, Options{FailMode: "closed"})
	for range 200 {
		for k := range 30 {
			if ok, _ := take(t, s, time.Now(), "key-"+string(rune('a'+k)), l); !ok {
				t.Fatal("refused")
			}
		}
	}
	st := s.Stats(0)
	if st.ShareGrants < 30 || st.ShareHere < 5000 {
		t.Fatalf("30 keys, 200 requests each: %d grants, %d decided here, %d by Redis", st.ShareGrants, st.ShareHere, st.ShareRedis)
	}
	WaitFor(t, 5*time.Second, "the idle keys' returns", func() bool { return s.Stats(0).ShareReturns >= 30 })
	for k := range 30 {
		got, err := s.ShareState(context.Background(), 0, store.Key{Text: "key-" + string(rune('a'+k))})
		if err != nil {
			t.Fatal(err)
		}
		if got.Out != 0 || got.Holders != 0 {
			t.Fatalf("key %d after its return: %+v, want nothing out", k, got)
		}
	}
}

// A request's zones with share are decided in turn: one that refuses
// leaves the next untouched (its answer read, nothing taken), and an
// adjustment gives back to the bucket, never past what the shares out
// hold.
func TestShareZonesInTurnAndAdjusted(t *testing.T) {
	r := redistest.Start(t)
	client := OpenClient(t, r.Addr())
	tight, wide := gcra.NewLimit(1.0/60, 1), gcra.NewLimit(1.0/60, 10)
	s := Open(t, client, []store.ZoneSpec{ShareSpec("tight", tight, time.Second), ShareSpec("wide", wide, time.Second)}, Options{FailMode: "closed"})
	both := func() (bool, *store.Demands) {
		d := &store.Demands{Buckets: []store.BucketDemand{
			{Zone: 0, Key: store.Key{Text: "k"}, Limit: tight, Cost: tight.TokenTime},
			{Zone: 1, Key: store.Key{Text: "k"}, Limit: wide, Cost: wide.TokenTime},
		}}
		ok, err := s.Take(context.Background(), time.Now(), d)
		if err != nil {
			t.Fatal(err)
		}
		return ok, d
	}
	if ok, _ := both(); !ok {
		t.Fatal("the first request refused")
	}
	for range 5 {
		ok, d := both()
		if ok || d.Buckets[0].OK || !d.Buckets[1].OK {
			t.Fatalf("allowed %v, tight ok %v, wide ok %v: want tight to refuse, wide to have the tokens", ok, d.Buckets[0].OK, d.Buckets[1].OK)
		}
	}
	takeWide := func() bool {
		d := &store.Demands{Buckets: []store.BucketDemand{{Zone: 1, Key: store.Key{Text: "k"}, Limit: wide, Cost: wide.TokenTime}}}
		ok, err := s.Take(context.Background(), time.Now(), d)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	n := 0
	for takeWide() {
		n++
	}
	// wide gave a token to the first request only (1 of 10 taken); the
	// loop's requests took the other 9.
	if n != 9 {
		t.Fatalf("wide held %d after tight refused five times, want 9", n)
	}
	// Three tokens given back: three more requests.
	back := &store.Demands{Buckets: []store.BucketDemand{{Zone: 1, Key: store.Key{Text: "k"}, Limit: wide, Cost: -3 * wide.TokenTime}}}
	if err := s.Adjust(context.Background(), time.Now(), back); err != nil {
		t.Fatal(err)
	}
	n = 0
	for takeWide() {
		n++
	}
	if n != 3 {
		t.Fatalf("after 3 tokens given back, %d requests allowed, want 3", n)
	}
}
