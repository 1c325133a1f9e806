// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// syncInstances are n stores of zones on the Redis at addrs, as n Caddy
// instances would have them: each its own client, so its own copies of
// the zones with sync, under one key prefix.
func syncInstances(t *testing.T, n int, zones []store.ZoneSpec, opt redisstore.Options, addrs ...string) []*redisstore.Store {
	t.Helper()
	if opt.KeyPrefix == "" {
		opt.KeyPrefix = "t:"
	}
	ss := make([]*redisstore.Store, n)
	for i := range ss {
		ss[i] = redisstore.Open(t, redisstore.OpenClient(t, addrs...), zones, opt)
	}
	return ss
}

// The zone of most sync tests: 20r/s burst 40 with sync 100ms.
var (
	sync20   = redisstore.SyncLimit(20, 40, 100*time.Millisecond)
	exact20  = gcra.NewLimit(20, 40)
	sync20ms = 100 * time.Millisecond
)

// syncBound is the most the instances may allow beyond an exact zone of
// 20r/s with sync 100ms: (N - 1) x rate x interval, and a request each
// but one for rounding.
func syncBound(n int) int { return (n - 1) * (20*100/1000 + 1) }

// take is whether s allows a token of key in its zone 0 of limit l now;
// a failure fails the test.
func take(t *testing.T, s *redisstore.Store, key string, l gcra.Limit) bool {
	t.Helper()
	ok, err := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, key, l))
	if err != nil {
		t.Fatalf("key %s: %v", key, err)
	}
	return ok
}

// One fresh key flooded round robin on three instances, from its first
// request, is allowed within the bound of what an exact zone allows in
// the same run, and no less than 90% of it.
func TestSyncFloodOneKey(t *testing.T) {
	r := redistest.Start(t)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", sync20, sync20ms)}, redisstore.Options{}, r.Addr())
	exact := syncInstances(t, 1, []store.ZoneSpec{redisstore.Bucket("e", exact20)}, redisstore.Options{}, r.Addr())[0]
	allowed, exactAllowed := 0, 0
	for i, start := 0, time.Now(); time.Since(start) < 2*time.Second; i++ {
		if take(t, ss[i%3], "k", sync20) {
			allowed++
		}
		if take(t, exact, "k", exact20) {
			exactAllowed++
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("allowed %d, exact %d", allowed, exactAllowed)
	if allowed > exactAllowed+syncBound(3) || allowed < exactAllowed*9/10 {
		t.Errorf("allowed %d, want %d to %d (exact %d)", allowed, exactAllowed*9/10, exactAllowed+syncBound(3), exactAllowed)
	}
}

// Many keys flooded at once on three instances: each within the bound.
func TestSyncFloodManyKeys(t *testing.T) {
	r := redistest.Start(t)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", sync20, sync20ms)}, redisstore.Options{}, r.Addr())
	floodKeys(t, ss, 30, 2*time.Second)
}

// floodKeys floods keys at once round robin on the instances ss of zone
// sync20 for d, and checks that each key is allowed within the bound of
// an exact zone.
func floodKeys(t *testing.T, ss []*redisstore.Store, keys int, d time.Duration) {
	t.Helper()
	allowed := make([]int, keys)
	start := time.Now()
	for i := 0; time.Since(start) < d; i++ {
		k := i % keys
		if take(t, ss[i/keys%len(ss)], strconv.Itoa(k), sync20) {
			allowed[k]++
		}
		if k == keys-1 {
			time.Sleep(2 * time.Millisecond)
		}
	}
	// An exact zone allows its burst and a token every 50ms.
	exact := 40 + int(time.Since(start)/(50*time.Millisecond))
	for k, n := range allowed {
		if n > exact+1+syncBound(len(ss)) || n < exact*9/10 {
			t.Errorf("key %d: allowed %d, want %d to %d", k, n, exact*9/10, exact+1+syncBound(len(ss)))
		}
	}
	t.Logf("allowed %v, exact about %d", allowed, exact)
}

// On a Redis Cluster: the bound holds for keys of every slot.
func TestSyncCluster(t *testing.T) {
	nodes := redistest.StartCluster(t)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", sync20, sync20ms)}, redisstore.Options{},
		nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())
	floodKeys(t, ss, 10, 1500*time.Millisecond)
}

// Keys under their limit on three instances are refused nothing, and
// cost Redis far less than a script call a request: a call for each
// key's first request on each instance, and one per reconciliation.
func TestSyncUnderLimit(t *testing.T) {
	r := redistest.Start(t)
	l := redisstore.SyncLimit(100, 200, sync20ms)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", l, sync20ms)}, redisstore.Options{}, r.Addr())
	const keys = 100
	requests, refused := 0, 0
	checked := r.Calls() // the stores' checks when they were made
	start := time.Now()
	for time.Since(start) < 2*time.Second {
		for k := range keys {
			for _, s := range ss {
				if !take(t, s, strconv.Itoa(k), l) {
					refused++
				}
				requests++
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	calls, intervals := r.Calls()-checked, int(time.Since(start)/sync20ms)+2
	t.Logf("%d requests, %d script calls (%.3f a request)", requests, calls, float64(calls)/float64(requests))
	if refused > 0 {
		t.Errorf("%d of %d requests refused", refused, requests)
	}
	if most := keys*len(ss) + intervals*len(ss); calls > most {
		t.Errorf("%d script calls for %d requests, want at most %d", calls, requests, most)
	}
}

// Redis going away: the zone with sync goes on deciding in each
// instance, with no error for fail_mode to decide, new keys too; a zone
// without sync fails; what the instances spent meanwhile goes up to
// Redis when it is back.
func TestSyncRedisOutage(t *testing.T) {
	r := redistest.Start(t)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", sync20, sync20ms)}, redisstore.Options{FailMode: "closed"}, r.Addr())
	exact := syncInstances(t, 1, []store.ZoneSpec{redisstore.Bucket("e", exact20)}, redisstore.Options{FailMode: "closed"}, r.Addr())[0]
	for i := range 9 {
		if !take(t, ss[i%3], "k", sync20) {
			t.Fatalf("request %d before the outage: refused", i)
		}
	}
	r.Kill()
	allowed := 0
	for i := range 60 {
		if take(t, ss[i%3], "k", sync20) {
			allowed++
		}
	}
	if allowed == 0 {
		t.Error("nothing allowed during the outage")
	}
	for i, s := range ss {
		if !take(t, s, "new", sync20) {
			t.Errorf("instance %d: a new key during the outage: refused", i)
		}
	}
	if _, err := exact.Take(context.Background(), time.Now(), redisstore.TakeOf(0, "k", exact20)); err == nil {
		t.Error("zone without sync during the outage: no error, want one for fail_mode to decide")
	}
	r.Start()
	hash, field := ss[0].BucketName(0, store.Key{Text: "k"})
	c := newRedisClient(t, r.Addr())
	redisstore.WaitFor(t, 10*time.Second, "the spending of the outage in Redis", func() bool {
		return c.HGet(context.Background(), hash, field).Val() != ""
	})
	redisstore.WaitFor(t, 5*time.Second, "the zone without sync deciding again", func() bool {
		ok, err := exact.Take(context.Background(), time.Now(), redisstore.TakeOf(0, "k", exact20))
		return ok && err == nil
	})
}

// emptyEverywhere floods key of limit l on every instance until each
// refuses it.
func emptyEverywhere(t *testing.T, ss []*redisstore.Store, key string, l gcra.Limit) {
	t.Helper()
	for i, s := range ss {
		redisstore.WaitFor(t, 5*time.Second, "instance "+strconv.Itoa(i)+" refusing "+key, func() bool {
			ok := true
			for range 100 {
				ok = take(t, s, key, l)
			}
			return !ok
		})
	}
}

// allowedEverywhere waits until each instance allows key of limit l, and
// returns the burst each decided by and how long the slowest took.
func allowedEverywhere(t *testing.T, ss []*redisstore.Store, key string, l gcra.Limit) ([]int64, time.Duration) {
	t.Helper()
	start := time.Now()
	bursts := make([]int64, len(ss))
	for i, s := range ss {
		redisstore.WaitFor(t, time.Second, "instance "+strconv.Itoa(i)+" allowing "+key, func() bool {
			d := redisstore.TakeOf(0, key, l)
			ok, err := s.Take(context.Background(), time.Now(), d)
			bursts[i] = d.Buckets[0].Limit.Burst
			return ok && err == nil
		})
	}
	return bursts, time.Since(start)
}

// A reset and an override made through one instance reach every instance
// within an interval or two: their copies learn it at their next
// reconciliation. (The zone refills a token a minute: only the reset or
// the override can let a request through within the test's second.)
func TestSyncResetAndOverride(t *testing.T) {
	r := redistest.Start(t)
	l := redisstore.SyncLimit(1.0/60, 10, sync20ms)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", l, sync20ms)}, redisstore.Options{}, r.Addr())
	ctx := context.Background()
	k := store.Key{Text: "k"}
	emptyEverywhere(t, ss, "k", l)
	if found, err := ss[2].Reset(ctx, &store.Demands{Buckets: []store.BucketDemand{{Key: k, Limit: l}}}); !found || err != nil {
		t.Fatalf("reset: %v, %v", found, err)
	}
	_, took := allowedEverywhere(t, ss, "k", l)
	t.Logf("reset seen everywhere after %v", took)

	emptyEverywhere(t, ss, "k", l)
	if err := ss[2].SetOverride(ctx, time.Now(), 0, k, store.Override{TokenTime: time.Minute, Burst: 1000, Rate: "1r/m"}); err != nil {
		t.Fatal(err)
	}
	bursts, took := allowedEverywhere(t, ss, "k", l)
	t.Logf("override seen everywhere after %v", took)
	for i, b := range bursts {
		if b != 1000 {
			t.Errorf("instance %d: decided by a burst of %d, want the override's 1000", i, b)
		}
	}
}

// A zone with sync whose limit comes with each request (plans): a key
// flooded on three instances is held to its plan within the bound, and
// its copies follow it to another plan, keeping what it spent.
func TestSyncPlans(t *testing.T) {
	r := redistest.Start(t)
	ss := syncInstances(t, 3, []store.ZoneSpec{redisstore.SyncSpec("s", gcra.Limit{}, sync20ms)}, redisstore.Options{}, r.Addr())
	allowed := 0
	start := time.Now()
	for i := 0; time.Since(start) < time.Second; i++ {
		if take(t, ss[i%3], "k", sync20) {
			allowed++
		}
		time.Sleep(time.Millisecond)
	}
	exact := 40 + int(time.Since(start)/(50*time.Millisecond))
	if allowed > exact+1+syncBound(3) || allowed < exact*9/10 {
		t.Errorf("allowed %d, want %d to %d", allowed, exact*9/10, exact+1+syncBound(3))
	}
	// Ten times the burst: the emptied bucket owes the same fraction of
	// the new one, all of it, so the change of plan hands back no tokens
	// in any instance.
	l := redisstore.SyncLimit(20, 400, sync20ms)
	allowed = 0
	for i := range 300 {
		if take(t, ss[i%3], "k", l) {
			allowed++
		}
	}
	if allowed > 40+syncBound(3) {
		t.Errorf("after the change of plan: %d allowed, want at most %d", allowed, 40+syncBound(3))
	}
}

// A request that a zone with sync and a zone without both limit is
// decided by Redis, all or nothing: a refusal of the exact zone charges
// the other nothing; and when Redis fails, it fails for fail_mode to
// decide.
func TestSyncWithExactZone(t *testing.T) {
	r := redistest.Start(t)
	exact := redisstore.PerMinute(2)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()),
		[]store.ZoneSpec{redisstore.SyncSpec("s", sync20, sync20ms), redisstore.Bucket("e", exact)}, redisstore.Options{FailMode: "closed"})
	// both are the demands of a request of key in the zone with sync and
	// of client in the exact one.
	both := func(key, client string) *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{
			{Zone: 0, Key: store.Key{Text: key}, Limit: sync20, Cost: sync20.TokenTime},
			{Zone: 1, Key: store.Key{Text: client}, Limit: exact, Cost: exact.TokenTime}}}
	}
	for i, want := range []bool{true, true, false, false, false} {
		if ok, err := s.Take(context.Background(), time.Now(), both("k", "10.0.0.1")); ok != want || err != nil {
			t.Fatalf("request %d: %v, %v; want %v", i, ok, err, want)
		}
	}
	// Two of the sync zone's 40 tokens are spent: the refusals took none.
	d := redisstore.TakeOf(0, "k", sync20)
	if ok, err := s.Take(context.Background(), time.Now(), d); !ok || err != nil || d.Buckets[0].Remaining() != 37 {
		t.Errorf("the sync zone alone: %v, %v, %d tokens left; want 37", ok, err, d.Buckets[0].Remaining())
	}
	r.Kill()
	if _, err := s.Take(context.Background(), time.Now(), both("k", "10.0.0.3")); err == nil {
		t.Error("Redis down: a new client allowed or refused, want an error for fail_mode to decide")
	}
}

// copiesPool is a SyncPool that stores share, as the module's pool shares
// the copies of a zone with sync across reloads: the first store to ask
// for a zone's copies makes them, the last to let go of them stops them.
type copiesPool struct {
	mu sync.Mutex
	m  map[redisstore.SyncID]*pooledCopies
}

type pooledCopies struct {
	sz   *redisstore.SyncZone
	refs int
}

func (p *copiesPool) Acquire(id redisstore.SyncID, newCopies func() *redisstore.SyncZone) (*redisstore.SyncZone, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = make(map[redisstore.SyncID]*pooledCopies)
	}
	c := p.m[id]
	if c == nil {
		c = &pooledCopies{sz: newCopies()}
		p.m[id] = c
	}
	c.refs++
	return c.sz, nil
}

func (p *copiesPool) Release(id redisstore.SyncID) error {
	p.mu.Lock()
	c := p.m[id]
	if c == nil {
		p.mu.Unlock()
		return errors.New("released copies that no store holds")
	}
	c.refs--
	if c.refs > 0 {
		p.mu.Unlock()
		return nil
	}
	delete(p.m, id)
	p.mu.Unlock()
	return c.sz.Destruct()
}

// A reload keeps the copies: the new config's store, on the same setup
// and pool, decides from them. (With sync 1m no reconciliation runs
// within the test, and a token comes back a minute: the copy of a key
// emptied here says so, while Redis, whose bucket is deleted behind the
// store's back, would allow it.)
func TestSyncReloadKeepsCopies(t *testing.T) {
	r := redistest.Start(t)
	l := redisstore.SyncLimit(1.0/60, 10, time.Minute)
	zones := []store.ZoneSpec{redisstore.SyncSpec("s", l, time.Minute)}
	c := redisstore.OpenClient(t, r.Addr())
	pool := new(copiesPool)
	opt := redisstore.Options{KeyPrefix: "t:", Setup: "one", SyncPool: pool, CallTimeout: 5 * time.Second}
	old, err := redisstore.New(c, zones, opt)
	if err != nil {
		t.Fatal(err)
	}
	emptyEverywhere(t, []*redisstore.Store{old}, "k", l)
	copies := old.Stats(0).SyncCopies
	hash, field := old.BucketName(0, store.Key{Text: "k"})
	r.CLI("HDEL", hash, field)
	next := redisstore.Open(t, c, zones, opt)
	if err := old.Drop(); err != nil {
		t.Fatal(err)
	}
	if got := next.Stats(0).SyncCopies; got != copies {
		t.Fatal("the reloaded config has copies of its own")
	}
	calls := r.Calls()
	if take(t, next, "k", l) {
		t.Error("after the reload: allowed, want the copy's refusal")
	}
	if got := r.Calls(); got != calls {
		t.Errorf("the refusal asked Redis: %d script calls, want %d", got, calls)
	}
}
