// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// syncStore is a store of one zone of limit l with sync every interval,
// on the Redis at addr, with opt.
func syncStore(t *testing.T, addr string, l gcra.Limit, interval time.Duration, opt Options) *Store {
	t.Helper()
	return Open(t, OpenClient(t, addr), []store.ZoneSpec{SyncSpec("s", l, interval)}, opt)
}

// takeKey is whether s allows a token of key in its zone 0 of limit l
// now; a failure fails the test.
func takeKey(t *testing.T, s *Store, key string, l gcra.Limit) bool {
	t.Helper()
	ok, err := s.Take(context.Background(), time.Now(), TakeOf(0, key, l))
	if err != nil {
		t.Fatalf("key %s: %v", key, err)
	}
	return ok
}

// copyOfKey is s's copy of key in its zone 0, read under its shard's
// lock (a copy of the copy), and whether it has one.
func copyOfKey(s *Store, key string) (syncCopy, bool) {
	sh, h := s.zones[0].copies.lock(store.Key{Text: key})
	defer sh.mu.Unlock()
	if c := sh.m[h]; c != nil {
		return *c, true
	}
	return syncCopy{}, false
}

// The sweep drops a copy once its bucket is full and no request used it
// for keep() since Redis last answered for it; it keeps the others, and
// looks at them again keep() later. (At sync 1m no reconciliation runs by
// itself within the test: the test reconciles, and sweeps at instants of
// its own.)
func TestSyncSweep(t *testing.T) {
	r := redistest.Start(t)
	l := SyncLimit(1.0/60, 10, time.Minute)
	s := syncStore(t, r.Addr(), l, time.Minute, Options{})
	sz := s.zones[0].copies
	takeKey(t, s, "once", l) // full again a minute later
	for range 10 {
		takeKey(t, s, "emptied", l) // ten minutes later
	}
	sz.reconcile()
	takeKey(t, s, "used", l) // used since the reconciliation
	n, keep := sz.instant(time.Now()), sz.keep()
	sweep := func(at time.Duration, want ...string) {
		t.Helper()
		visited := sz.visited.Load()
		for i := range sz.shards {
			sh := &sz.shards[i]
			sh.mu.Lock()
			sz.sweep(sh, n+at)
			sh.mu.Unlock()
		}
		var held []string
		for _, key := range []string{"once", "emptied", "used"} {
			if _, ok := copyOfKey(s, key); ok {
				held = append(held, key)
			}
		}
		t.Logf("%v later: looked at %d copies, holds %v", at, sz.visited.Load()-visited, held)
		if fmt.Sprint(held) != fmt.Sprint(want) || sz.size.Load() != int64(len(want)) {
			t.Errorf("%v later: holds %v (%d copies), want %v", at, held, sz.size.Load(), want)
		}
	}
	sweep(keep-time.Second, "once", "emptied", "used")
	sweep(keep+2*time.Minute, "emptied", "used")
	sweep(keep+11*time.Minute, "used")
}

// An idle zone's reconciliations look at none of its copies, however
// many it holds: their work follows the keys used since the last one,
// not the copies held (an idle instance costs nothing an interval). 2,000
// copies at sync 10ms, each reconciled once: the next 20 intervals' look
// at none of them, and one key used again is looked at once.
func TestSyncIdleReconciliation(t *testing.T) {
	r := redistest.Start(t)
	l := SyncLimit(20, 40, 10*time.Millisecond)
	s := syncStore(t, r.Addr(), l, 10*time.Millisecond, Options{})
	sz := s.zones[0].copies
	const keys = 2000
	for k := range keys {
		takeKey(t, s, strconv.Itoa(k), l)
	}
	WaitFor(t, 5*time.Second, "the copies' reconciliation", func() bool { return sz.keys.Load() >= keys })
	visited := sz.visited.Load()
	time.Sleep(200 * time.Millisecond)
	if n := sz.visited.Load() - visited; n != 0 {
		t.Errorf("the reconciliations of 20 idle intervals looked at %d copies, want none (%d held)", n, sz.size.Load())
	}
	visited = sz.visited.Load()
	if !takeKey(t, s, "7", l) {
		t.Fatal("key 7 again: refused")
	}
	WaitFor(t, 5*time.Second, "key 7's reconciliation", func() bool { return sz.keys.Load() > keys })
	time.Sleep(50 * time.Millisecond)
	if n := sz.visited.Load() - visited; n != 1 {
		t.Errorf("the reconciliations after one key was used looked at %d copies, want 1", n)
	}
}

// What a copy spent waits for the next reconciliation: whole while Redis
// could have taken it, and capped at two intervals of refill (or one
// request's cost, when that is more) when it waits because Redis could
// not; tokens of a call in doubt are counted apart, and leave that much
// less to go up. A copy is listed for the next reconciliation once.
func TestSyncOwe(t *testing.T) {
	sz := &SyncZone{interval: 100 * time.Millisecond}
	sh := &syncShard{m: make(map[uint64]*syncCopy)}
	fast := &syncCopy{lim: gcra.NewLimit(10, 10), cost: 1} // two intervals: 2 tokens
	for _, step := range []struct {
		tokens      int64
		away, doubt bool
		pending     int64
		doubted     int64
	}{
		{5, false, false, 5, 0}, // within the allowance: all of it
		{5, false, false, 10, 0},
		{1, true, false, 2, 0}, // decided while Redis was away: two intervals
		{1, true, true, 1, 1},  // in doubt: one may still go up
		{3, false, true, 0, 4}, // nothing more
	} {
		sz.owe(sh, fast, step.tokens, step.away, step.doubt)
		if fast.pending != step.pending || fast.doubt != step.doubted {
			t.Fatalf("owing %+v: %d pending, %d in doubt; want %d, %d", step, fast.pending, fast.doubt, step.pending, step.doubted)
		}
	}
	if len(sh.used) != 1 || !fast.used {
		t.Fatalf("%d copies listed for the next reconciliation, want the one, once", len(sh.used))
	}
	// At 1r/m, two intervals are no token: a request's cost goes up.
	slow := &syncCopy{lim: gcra.NewLimit(1.0/60, 10), cost: 3}
	sz.owe(sh, slow, 12, true, false)
	if slow.pending != 3 {
		t.Fatalf("a slow copy owes %d after an outage, want a request's cost, 3", slow.pending)
	}
	if slow.cost = 0; sz.forgiven(slow) != 1 {
		t.Fatalf("forgiven %d, want a token at least", sz.forgiven(slow))
	}
	// What a failed call sent is owed again, as spent while Redis was
	// away.
	slow.sent, slow.pending = 5, 0
	sz.unsent(&syncItem{c: slow, sh: sh}, false)
	if slow.sent != 0 || slow.pending != 1 {
		t.Fatalf("after a failed reconciliation: %d sent, %d pending; want 0, 1", slow.sent, slow.pending)
	}
}

// A shard's expiry queue gives each copy back once its check is due, in
// the order they were pushed, and reuses its room.
func TestSyncQueue(t *testing.T) {
	var q syncQueue
	cs := make([]*syncCopy, 10)
	for i := range cs {
		cs[i] = &syncCopy{key: uint64(i)}
		q.push(cs[i], time.Duration(i)*time.Second)
	}
	if c := q.pop(-time.Second); c != nil {
		t.Fatalf("popped copy %d before any is due", c.key)
	}
	var got []uint64
	for c := q.pop(6 * time.Second); c != nil; c = q.pop(6 * time.Second) {
		got = append(got, c.key)
	}
	if fmt.Sprint(got) != "[0 1 2 3 4 5 6]" {
		t.Fatalf("due at 6s: %v", got)
	}
	if len(q.items) >= len(cs) {
		t.Fatalf("head %d of %d items: the room before the head is not reused", q.head, len(q.items))
	}
	q.push(cs[0], 20*time.Second)
	for _, want := range []uint64{7, 8, 9, 0} {
		if c := q.pop(time.Minute); c == nil || c.key != want {
			t.Fatalf("popped %v, want copy %d", c, want)
		}
	}
	if c := q.pop(time.Hour); c != nil || q.head != 0 || len(q.items) != 0 {
		t.Fatalf("an empty queue popped %v, head %d of %d", c, q.head, len(q.items))
	}
}

// A request beyond a copy's allowance goes to Redis with what the copy
// spent and has not sent yet (carry), so that Redis decides it after
// that spending; whatever the answer, the cost is the request's again
// after (uncarry), and what was carried is sent later unless the take
// charged it: owed as before when Redis refused, capped when the call
// failed, in doubt when it may have run.
func TestSyncCarry(t *testing.T) {
	r := redistest.Start(t)
	l := SyncLimit(1.0/60, 20, time.Minute) // two intervals: 2 tokens
	s := syncStore(t, r.Addr(), l, time.Minute, Options{})
	takeKey(t, s, "k", l) // Redis's: the copy is made
	sz := s.zones[0].copies
	sh, h := sz.lock(store.Key{Text: "k"})
	sh.m[h].pending = 4
	sh.mu.Unlock()
	for _, tc := range []struct {
		charged, away, doubt bool
		pending, doubted     int64
	}{
		{true, false, false, 0, 0},  // charged with the take: sent
		{false, false, false, 4, 0}, // refused: waits, whole
		{false, true, false, 2, 0},  // the call failed: two intervals of it
		{false, true, true, 0, 4},   // in doubt
	} {
		sh.mu.Lock()
		c := sh.m[h]
		c.pending, c.doubt = 4, 0
		sh.mu.Unlock()
		d := TakeOf(0, "k", l)
		carried := make([]int64, 1)
		s.carry(d, carried)
		if carried[0] != 4 || d.Buckets[0].Cost != 5*l.TokenTime {
			t.Fatalf("carried %d tokens, cost %v; want 4, and 5 tokens", carried[0], d.Buckets[0].Cost)
		}
		s.uncarry(d, carried, tc.charged, tc.away, tc.doubt)
		got, _ := copyOfKey(s, "k")
		if d.Buckets[0].Cost != l.TokenTime || got.pending != tc.pending || got.doubt != tc.doubted {
			t.Errorf("%+v: cost %v, %d pending, %d in doubt; want a token, %d, %d", tc, d.Buckets[0].Cost, got.pending, got.doubt, tc.pending, tc.doubted)
		}
	}
	// Not beyond the burst: a take of more than a bucket is refused
	// whatever it owes.
	sh.mu.Lock()
	sh.m[h].pending = 20
	sh.mu.Unlock()
	d, carried := TakeOf(0, "k", l), make([]int64, 1)
	if s.carry(d, carried); carried[0] != 0 || d.Buckets[0].Cost != l.TokenTime {
		t.Errorf("carried %d tokens beyond the burst", carried[0])
	}
}

// A Redis frozen under a request beyond a copy's allowance leaves its
// call in doubt: the copy decides the request, and the key's next ones,
// by itself, counting the call's tokens in doubt, until Redis answers
// for the key again; then the copy learns the shared bucket, and nothing
// stays in doubt. A request of a zone with sync and one without, whose
// call fails in doubt, counts its tokens in doubt too, for fail_mode to
// decide it. (Each first call after the freeze finds a connection made
// already, so that it is sent: a call that cannot connect is not in
// doubt.)
func TestSyncCallsInDoubt(t *testing.T) {
	l := SyncLimit(10, 20, time.Minute)
	exact := gcra.NewLimit(10, 20)
	open := func(t *testing.T) (*redistest.Server, *Store) {
		r := redistest.Start(t)
		return r, Open(t, OpenClient(t, r.Addr()), []store.ZoneSpec{SyncSpec("s", l, time.Minute), Bucket("e", exact)},
			Options{CallTimeout: 500 * time.Millisecond})
	}
	t.Run("alone", func(t *testing.T) {
		r, s := open(t)
		takeKey(t, s, "k", l) // Redis's: the copy is made, its allowance spent
		r.Pause()
		for i := range 3 {
			if !takeKey(t, s, "k", l) {
				t.Fatalf("request %d while Redis is frozen: refused", i)
			}
		}
		if c, _ := copyOfKey(s, "k"); c.doubt == 0 {
			t.Fatal("no tokens in doubt after a call timed out")
		}
		r.Resume()
		WaitFor(t, 5*time.Second, "Redis deciding again", func() bool { return s.client.Up() })
		s.zones[0].copies.reconcile()
		if c, _ := copyOfKey(s, "k"); c.doubt != 0 || c.pending != 0 {
			t.Errorf("after Redis answered: %d in doubt, %d pending; want none", c.doubt, c.pending)
		}
	})
	t.Run("with a zone without sync", func(t *testing.T) {
		r, s := open(t)
		both := &store.Demands{Buckets: []store.BucketDemand{{Zone: 0, Key: store.Key{Text: "j"}, Limit: l, Cost: l.TokenTime},
			{Zone: 1, Key: store.Key{Text: "j"}, Limit: exact, Cost: exact.TokenTime}}}
		learnt := both.Buckets[0]
		s.learn(time.Now(), &store.Demands{Buckets: []store.BucketDemand{learnt}}) // a copy of j, as if Redis had answered
		if ok, err := s.Take(context.Background(), time.Now(), TakeOf(1, "other", exact)); !ok || err != nil {
			t.Fatal(ok, err)
		}
		r.Pause()
		defer r.Resume()
		if _, err := s.Take(context.Background(), time.Now(), both); err == nil {
			t.Fatal("a request with a zone without sync decided while Redis is frozen")
		}
		if j, _ := copyOfKey(s, "j"); j.doubt != 1 {
			t.Errorf("the call of a request with a zone without sync failed: %d tokens in doubt, want its 1", j.doubt)
		}
	})
}

// A reconciliation that fails keeps what it sent for the next, as spent
// while Redis was away, and counts the failure; the next one, Redis
// back, sends it.
func TestSyncReconciliationFails(t *testing.T) {
	r := redistest.Start(t)
	l := SyncLimit(10, 20, time.Minute)
	s := syncStore(t, r.Addr(), l, time.Minute, Options{})
	sz := s.zones[0].copies
	takeKey(t, s, "k", l)
	sz.reconcile() // the copy learns; its allowance comes back as it refills
	time.Sleep(200 * time.Millisecond)
	for range 2 {
		takeKey(t, s, "k", l) // within the allowance: pending
	}
	before := s.Stats(0)
	r.Kill()
	sz.reconcile()
	st := s.Stats(0)
	if st.SyncCalls != before.SyncCalls+1 || st.SyncFailed != before.SyncFailed+1 {
		t.Fatalf("calls %d → %d, failed %d → %d: want one more of each", before.SyncCalls, st.SyncCalls, before.SyncFailed, st.SyncFailed)
	}
	c, _ := copyOfKey(s, "k")
	if c.sent != 0 || c.pending == 0 {
		t.Fatalf("after a failed reconciliation: %d sent, %d pending; want what was sent pending again", c.sent, c.pending)
	}
	r.Start()
	WaitFor(t, 5*time.Second, "the reconciliation to send it", func() bool {
		sz.reconcile()
		c, _ := copyOfKey(s, "k")
		return c.pending == 0 && s.Stats(0).SyncFailed == st.SyncFailed
	})
}

// What a store's Peek of a key with a copy says counts what the copy
// spent that Redis has not heard of yet; a Reset drops the copy, so the
// key's next request goes to Redis.
func TestSyncPeekAndReset(t *testing.T) {
	r := redistest.Start(t)
	l := SyncLimit(1.0/60, 10, time.Minute)
	s := syncStore(t, r.Addr(), l, time.Minute, Options{})
	takeKey(t, s, "k", l) // Redis's
	sz := s.zones[0].copies
	sh, h := sz.lock(store.Key{Text: "k"})
	sh.m[h].allow = 0 // a whole allowance, one token, to spend here
	sh.mu.Unlock()
	calls := r.Calls()
	takeKey(t, s, "k", l)
	if r.Calls() != calls {
		t.Fatal("a request within the allowance asked Redis")
	}
	d := TakeOf(0, "k", l)
	if err := s.Peek(context.Background(), time.Now(), d); err != nil {
		t.Fatal(err)
	}
	if got := d.Buckets[0].Remaining(); got != 8 {
		t.Fatalf("a peek finds %d tokens, want 8: one spent in Redis, one here", got)
	}
	if found, err := s.Reset(context.Background(), TakeOf(0, "k", l)); !found || err != nil {
		t.Fatalf("reset: %v, %v", found, err)
	}
	if _, ok := copyOfKey(s, "k"); ok || sz.size.Load() != 0 {
		t.Fatal("the reset kept the copy")
	}
	takeKey(t, s, "k", l)
	if r.Calls() == calls {
		t.Fatal("the request after the reset did not ask Redis")
	}
}

// A request of two zones with sync, whose keys' copies share a shard or
// not, is decided by their copies together, all or nothing: a copy that
// lacks refuses it, and the other is charged nothing.
func TestSyncTwoZones(t *testing.T) {
	r := redistest.Start(t)
	big, small := SyncLimit(1.0/60, 10, time.Minute), SyncLimit(1.0/60, 2, time.Minute)
	s := Open(t, OpenClient(t, r.Addr()), []store.ZoneSpec{SyncSpec("big", big, time.Minute), SyncSpec("small", small, time.Minute)}, Options{})
	both := func() *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{{Zone: 0, Key: store.Key{Text: "k"}, Limit: big, Cost: big.TokenTime},
			{Zone: 1, Key: store.Key{Text: "k"}, Limit: small, Cost: small.TokenTime}}}
	}
	var got []bool
	for range 4 {
		ok, err := s.Take(context.Background(), time.Now(), both())
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ok)
	}
	if fmt.Sprint(got) != "[true true false false]" {
		t.Fatalf("decisions %v, want the small zone's burst of 2", got)
	}
	d := both()
	if err := s.Peek(context.Background(), time.Now(), d); err != nil {
		t.Fatal(err)
	}
	if b := d.Buckets[0].Remaining(); b != 8 {
		t.Fatalf("the big zone has %d tokens left, want 8: the refusals charged it", b)
	}
}

// A store that lets go of its copies leaves them to the one that shares
// them: the newest store reconciles, and the last one's copies reconcile
// a last time when it lets go of them.
func TestSyncOwners(t *testing.T) {
	sz := &SyncZone{}
	a, b := &Store{}, &Store{}
	if _, ok := sz.owner(); ok {
		t.Fatal("copies no store holds have an owner")
	}
	sz.join(syncUser{a, 0})
	sz.join(syncUser{b, 1})
	if u, _ := sz.owner(); u.s != b {
		t.Fatal("the newest store does not reconcile")
	}
	sz.leave(b)
	if u, _ := sz.owner(); u.s != a {
		t.Fatal("the store left does not leave the copies to the other")
	}
	sz.leave(a)
	if u, ok := sz.owner(); !ok || u.s != a {
		t.Fatal("the last store does not reconcile a last time")
	}
}

// New makes no store of a config it cannot decide by: a call timeout
// that is not positive, or zones that would share their copies.
func TestNewRefuses(t *testing.T) {
	r := redistest.Start(t)
	c := OpenClient(t, r.Addr())
	l := SyncLimit(10, 20, time.Second)
	if _, err := New(c, []store.ZoneSpec{Bucket("a", l)}, Options{}); err == nil {
		t.Error("a store without a call timeout")
	}
	twice := []store.ZoneSpec{SyncSpec("s", l, time.Second), SyncSpec("s", l, time.Second)}
	if _, err := New(c, twice, Options{CallTimeout: time.Second}); err == nil {
		t.Error("a store of two zones with one set of copies")
	}
	s := Open(t, c, []store.ZoneSpec{Bucket("a", l)}, Options{})
	if !takeKey(t, s, "k", l) {
		t.Error("the client is not the store's after New failed twice with it")
	}
}
