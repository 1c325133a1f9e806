// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Zones with sync (docs/sync.md): the Redis store decides a zone's
// requests in this instance, from its own copy of each key's shared
// bucket, and reconciles the copies with Redis every interval, many keys
// in one script call (a flight of adjustments): what this instance spent
// goes up, and the shared bucket, with what the other instances spent,
// comes back.
//
// Four rules keep the instances together close to one exact bucket:
//
//   - A key this instance has no copy of is decided by Redis, exactly, and
//     its copy made from the answer: a key flooded everywhere from its
//     first request gets no fresh burst in each instance.
//   - A copy refuses when it lacks the tokens: the other instances only
//     take from the shared bucket, so it holds fewer still (but for a
//     reset or an override, which reach it at its next reconciliation).
//   - A copy allows by itself only within an allowance: a bucket of one
//     interval's refill at the zone's rate, spent when the copy is made.
//     Between two of Redis's answers, however far apart, this instance so
//     spends by itself at most what the shared bucket refills meanwhile,
//     and one interval's refill more: the copies cannot each spend the
//     bucket's burst.
//   - A request beyond the allowance, while the copy has the tokens, is
//     decided by Redis, with what this instance spent of the key and has
//     not sent yet: as if that had been sent.
//
// What the instances spend together beyond the shared bucket is charged
// to it all the same, as a debt (the zone's limit may owe syncOwe
// intervals beyond empty): every copy then refuses until it is paid
// back, so the excess does not add up interval after interval. With N
// instances, they admit together at most (N - 1) x (rate x interval + 1)
// more than an exact zone (measured in docs/sync.md).

const (
	// syncKeep is how long a copy with nothing to tell stays (see keep).
	syncKeep = time.Minute

	// maxSyncKeys bounds the copies of each zone in this instance: beyond
	// it, a new key's requests are decided by Redis, as without sync.
	maxSyncKeys = 100_000

	// syncFlight is how many keys one script call of a reconciliation
	// carries at most, so that Redis, which runs a call at a time, is
	// never held by one for long.
	syncFlight = 512

	syncShards = 16 // a power of two
)

type SyncID struct {
	client   string // the Redis store's connection setup
	prefix   string
	hashKeys bool
	field    string // how the zone's buckets are named: its name and shape
	interval time.Duration
}

// A SyncZone is one zone's copies in this instance, and their
// reconciliation.
type SyncZone struct {
	interval time.Duration
	epoch    time.Time   // the copies' instants count from here
	hashKey  siphash.Key // how a key's copy is found: its hash under this key
	Shards   [syncShards]SyncShard
	Size     atomic.Int64

	mu    sync.Mutex
	users []syncUser // the stores that use it, newest last: the newest reconciles
	last  syncUser   // the last to leave: the final reconciliation's

	stop, done chan struct{}

	// What the reconciliations did, for the metrics: their script calls
	// (one per hash tag on a cluster), those that failed, and the keys
	// they carried.
	calls, failed, Keys atomic.Uint64
	// visited counts the copies the reconciliations looked at: their
	// work, which follows the copies used, not those held.
	Visited atomic.Uint64

	// The reconciliations' scratch, kept from one to the next: only the
	// loop reconciles.
	batch []syncItem
	bs    []store.BucketDemand
}

// A syncUser is a store and the place of the zone in it.
type syncUser struct {
	s    *Store
	zone int
}

type SyncShard struct {
	Mu sync.Mutex
	M  map[uint64]*SyncCopy
	// used are the copies asked or spent since the last reconciliation,
	// each once: what the next one sends.
	used   []*SyncCopy
	expiry syncQueue
	_      [56]byte // keep shards on separate cache lines
}

// use lists c for the next reconciliation, once. Requires sh.mu.
func (sh *SyncShard) use(c *SyncCopy) {
	if !c.used {
		c.used = true
		sh.used = append(sh.used, c)
	}
}

// A syncQueue is a shard's copies in the order their expiry falls due to
// be checked: each copy once, from when it is made until it goes (a
// reset one until its check finds it gone).
type syncQueue struct {
	items []syncDue
	head  int
}

type syncDue struct {
	c   *SyncCopy
	due time.Duration
}

func (q *syncQueue) push(c *SyncCopy, due time.Duration) {
	q.items = append(q.items, syncDue{c, due})
}

// pop takes the first copy whose check is due at n, or nil.
func (q *syncQueue) pop(n time.Duration) *SyncCopy {
	if q.head == len(q.items) || q.items[q.head].due > n {
		return nil
	}
	c := q.items[q.head].c
	q.items[q.head] = syncDue{}
	q.head++
	if 2*q.head >= len(q.items) { // the room before the head is the larger: reuse it
		k := copy(q.items, q.items[q.head:])
		clear(q.items[k:])
		q.items, q.head = q.items[:k], 0
	}
	return c
}

// A SyncCopy is this instance's copy of one key's shared bucket. Its
// fields are its shard's, under its lock, but for the names.
type SyncCopy struct {
	hash, field, limitKey string // the bucket's names in Redis, and its override's
	key                   uint64 // its key's hash: its place in the shard
	// base is the limit the requests brought when Redis last answered (the
	// zone's, or its plan's); lim the one Redis decided by: base, or the
	// key's own (an override).
	base, lim gcra.Limit
	fullAt    time.Duration // when the shared bucket is full again, as this instance knows it
	allow     time.Duration // when this instance's allowance is whole again
	// Tokens spent here: not sent yet, and sent in the reconciliation out.
	pending, sent int64
	// doubt: tokens of calls for the key that failed in doubt since Redis
	// last answered for it (see owe); cost: what the key's last request
	// took, in tokens.
	doubt, cost int64
	heard       time.Duration // when Redis last answered for the key, or the copy was made
	used        bool          // asked or spent since the last reconciliation: in the shard's used
}

func newSyncZone(interval time.Duration) *SyncZone {
	now := time.Now()
	sz := &SyncZone{interval: interval, epoch: now, hashKey: siphash.NewKey(), stop: make(chan struct{}), done: make(chan struct{})}
	for i := range sz.Shards {
		sz.Shards[i].M = make(map[uint64]*SyncCopy)
	}
	go sz.loop()
	return sz
}

// Destruct stops the reconciliation when no config has the zone any
// more, after a last one: what this instance spent goes up.
func (sz *SyncZone) Destruct() error {
	close(sz.stop)
	<-sz.done
	return nil
}

func (sz *SyncZone) Instant(t time.Time) time.Duration { return t.Sub(sz.epoch) }

// Keep is how long a copy that has nothing to send and whose bucket is
// full stays at least after Redis last answered for it (the sweep finds
// it within another keep): a key used again within it is decided here at
// once, within its allowance.
func (sz *SyncZone) Keep() time.Duration { return max(syncKeep, 2*sz.interval) }

func (sz *SyncZone) shard(h uint64) *SyncShard { return &sz.Shards[h&(syncShards-1)] }

// Lock locks the shard of k's copy, and returns it and k's hash.
func (sz *SyncZone) Lock(k store.Key) (*SyncShard, uint64) {
	h := k.Hash(sz.hashKey)
	sh := sz.shard(h)
	sh.Mu.Lock()
	return sh, h
}

func (sz *SyncZone) join(u syncUser) {
	sz.mu.Lock()
	defer sz.mu.Unlock()
	sz.users = append(sz.users, u)
}

func (sz *SyncZone) leave(s *Store) {
	sz.mu.Lock()
	defer sz.mu.Unlock()
	for i, u := range sz.users {
		if u.s == s {
			sz.last = u
			sz.users = append(sz.users[:i], sz.users[i+1:]...)
			return
		}
	}
}

// owner is the store that reconciles: the newest, or the last one.
func (sz *SyncZone) owner() (syncUser, bool) {
	sz.mu.Lock()
	defer sz.mu.Unlock()
	if n := len(sz.users); n > 0 {
		return sz.users[n-1], true
	}
	return sz.last, sz.last.s != nil
}

// add makes a copy of b's bucket, owing floor at n, unless the zone has
// maxSyncKeys already. Requires sh.mu to be held.
func (sz *SyncZone) add(sh *SyncShard, h uint64, s *Store, b *store.BucketDemand, n, floor time.Duration) *SyncCopy {
	if sz.Size.Load() >= maxSyncKeys {
		return nil
	}
	// Its allowance starts spent: the first interval's requests of a key
	// new here are Redis's but for what refills meanwhile, so that the
	// instances flooding a key from its first request spend no allowance
	// that Redis has not seen.
	c := &SyncCopy{base: baseLimit(b), lim: baseLimit(b), fullAt: n + floor, allow: n + sz.interval, heard: n, key: h}
	c.hash, c.field, c.limitKey = s.Keys.BucketLimit(s.Zones[b.Zone].Field, b.Key.String())
	sh.M[h] = c
	sh.expiry.push(c, n+sz.Keep())
	sz.Size.Add(1)
	return c
}

// baseLimit is the limit b's request brought, before any override.
func baseLimit(b *store.BucketDemand) gcra.Limit {
	if b.Overridden {
		return b.Base()
	}
	return b.Limit
}

func sameLimit(a, b gcra.Limit) bool { return a.TokenTime == b.TokenTime && a.Burst == b.Burst }

// learnt sets the copy from Redis's answer at instant at: the bucket owed
// debt, under lim. What this instance spent meanwhile, not yet in that
// answer, is added (what a reconciliation out carries may be in it
// already: counted twice until its answer, it only refuses sooner).
func (c *SyncCopy) learnt(at, n, debt time.Duration, lim gcra.Limit, tokens int64) {
	c.lim = lim
	c.fullAt = min(max(at+debt, n)+time.Duration(tokens)*lim.TokenTime, n+lim.Most())
	c.heard, c.doubt = n, 0
}

// synced reports whether a bucket of d is in a zone with sync.
func (s *Store) synced(d *store.Demands) bool {
	for i := range d.Buckets {
		if s.Zones[d.Buckets[i].Zone].Sync != nil {
			return true
		}
	}
	return false
}

// takeSync decides demands of which a bucket is in a zone with sync. A
// request of such buckets alone is decided here when their copies can;
// any other goes to Redis with all its demands, all or nothing as
// without sync, and the copies learn from the answer. When Redis fails,
// a request of such buckets alone is decided here all the same, from
// what this instance knows; fail_mode decides the others.
func (s *Store) takeSync(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	alone := len(d.Counters)+len(d.Slots) == 0
	for i := range d.Buckets {
		alone = alone && s.Zones[d.Buckets[i].Zone].Sync != nil
	}
	if alone {
		if allowed, decided := s.decideHere(now, d, nil); decided {
			return allowed, nil
		}
	}
	var carriedArr [4]int64
	carried := carriedArr[:0]
	for range d.Buckets {
		carried = append(carried, 0)
	}
	s.carry(d, carried)
	allowed, err := s.takeExact(ctx, now, d)
	charged := err == nil && allowed
	doubt := rediswire.InDoubt(err)
	s.uncarry(d, carried, charged, err != nil, doubt)
	switch {
	case err == nil:
		if !d.Remembered { // the over-limit cache's answer is a bound, not Redis's
			s.learn(now, d)
		}
		if !charged {
			// What the bucket owes counting what was not sent, as the
			// copy says: the refusal's wait.
			for i := range d.Buckets {
				d.Buckets[i].Debt += time.Duration(carried[i]) * d.Buckets[i].Limit.TokenTime
			}
		}
		return allowed, nil
	case !alone:
		if doubt {
			s.doubted(d)
		}
		return false, err
	}
	allowed, _ = s.decideHere(now, d, err)
	return allowed, nil
}

// carry adds to the cost of each of d's buckets in a zone with sync what
// this instance spent of it and has not sent yet, in carried (in
// tokens), so that Redis decides the request after that spending, as if
// it had been sent: a request beyond the allowance is decided against
// what this instance spent by itself too. (Not beyond the burst: a take
// of more than a bucket is refused whatever it owes.)
func (s *Store) carry(d *store.Demands, carried []int64) {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		sz := s.Zones[b.Zone].Sync
		if sz == nil {
			continue
		}
		sh, h := sz.Lock(b.Key)
		if c := sh.M[h]; c != nil && c.pending > 0 && sameLimit(c.base, baseLimit(b)) && sameLimit(c.lim, b.Limit) {
			if extra := time.Duration(c.pending) * b.Limit.TokenTime; b.Cost+extra <= b.Limit.BurstTime {
				carried[i], c.pending = c.pending, 0
				b.Cost += extra
			}
		}
		sh.Mu.Unlock()
	}
}

// uncarry takes off the costs what carry added, and, unless the take
// charged them, gives the tokens back to the copies to send: away when
// the take failed, or counts them in doubt when it failed in doubt (see
// owe).
func (s *Store) uncarry(d *store.Demands, carried []int64, charged, away, doubt bool) {
	for i := range d.Buckets {
		if carried[i] == 0 {
			continue
		}
		b := &d.Buckets[i]
		b.Cost -= time.Duration(carried[i]) * b.Limit.TokenTime
		if charged {
			continue
		}
		sz := s.Zones[b.Zone].Sync
		sh, h := sz.Lock(b.Key)
		if c := sh.M[h]; c != nil {
			sz.owe(sh, c, carried[i], away, doubt)
		}
		sh.Mu.Unlock()
	}
}

// doubted counts the costs of d's buckets in zones with sync in doubt:
// d's call failed in doubt, and fail_mode decided it (see owe).
func (s *Store) doubted(d *store.Demands) {
	s.withCopies(d, func(sz *SyncZone, sh *SyncShard, h uint64, b *store.BucketDemand) {
		if c := sh.M[h]; c != nil {
			sz.owe(sh, c, int64(b.Cost/b.Limit.TokenTime), true, true)
		}
	})
}

// A syncLook is what decideHere found of a bucket.
type syncLook struct {
	sz       *SyncZone
	sh       *SyncShard
	c        *SyncCopy
	n        time.Duration
	debt, ad time.Duration // what the copy owes, and what its allowance
	away     bool          // decided without Redis (see owe)
}

// decideHere decides d from the copies of its buckets, all or nothing,
// and reports whether they could: a copy that lacks the tokens refuses
// the request (the shared bucket has no more, the other instances only
// taking from it); the request is allowed when every copy is fresh and
// has the tokens within its allowance; else Redis decides. failed is why
// Redis could not decide d: the copies then decide all the same (a key
// without one gets one, as full as the over-limit cache allows), and no
// allowance or freshness holds them back; so do copies with calls in
// doubt, until Redis answers for them again (see owe).
func (s *Store) decideHere(now time.Time, d *store.Demands, failed error) (allowed, decided bool) {
	var lockedArr [4]*SyncShard
	var looksArr [4]syncLook
	locked, looks := lockedArr[:0], looksArr[:0]
	defer func() {
		for _, sh := range locked {
			sh.Mu.Unlock()
		}
	}()
	strict := failed == nil && s.Client.Up()
	here, denied := true, false
	for i := range d.Buckets {
		b := &d.Buckets[i]
		sz := s.Zones[b.Zone].Sync
		h := b.Key.Hash(sz.hashKey)
		sh := sz.shard(h)
		if !containsShard(locked, sh) {
			sh.Mu.Lock()
			locked = append(locked, sh)
		}
		n := sz.Instant(now)
		c := s.copyOf(now, b, sz, sh, h, n, failed)
		looks = append(looks, syncLook{sz: sz, sh: sh, c: c, n: n})
		if c == nil {
			here, b.OK, b.Debt = false, true, 0 // not asked, unless Redis is
			continue
		}
		sh.use(c)
		b.ClearOwnLimit()
		if !sameLimit(c.lim, c.base) {
			b.SetOwnLimit(c.lim.TokenTime, c.lim.Burst)
		}
		look := &looks[i]
		look.debt, look.ad = b.Limit.Debt(c.fullAt, n), max(c.allow-n, 0)
		look.away = !strict || c.doubt > 0
		b.Debt, b.OK = look.debt, look.debt+b.Cost <= b.Limit.Reach()
		switch {
		case !b.OK:
			denied = denied || !b.Soft
		case !look.away && look.ad+b.Cost > max(sz.interval, b.Cost):
			here = false
		}
	}
	if denied {
		d.At = now
		return false, true
	}
	if !here {
		return false, false
	}
	chargeCopies(d, looks, rediswire.InDoubt(failed))
	d.At = now
	return true, true
}

// chargeCopies charges each bucket of d that had the tokens its cost, in
// its copy as decideHere looked at it; a soft one that lacked them is
// charged nothing. doubt: d's call failed in doubt, so its costs may
// reach Redis by it (see owe).
func chargeCopies(d *store.Demands, looks []syncLook, doubt bool) {
	for i := range d.Buckets {
		b, look := &d.Buckets[i], &looks[i]
		if !b.OK {
			continue
		}
		c := look.c
		c.fullAt = look.n + look.debt + b.Cost
		c.allow = look.n + look.ad + b.Cost
		c.cost = int64(b.Cost / b.Limit.TokenTime)
		look.sz.owe(look.sh, c, c.cost, look.away, doubt)
		b.Debt += b.Cost
	}
}

// copyOf is b's copy in shard sh (h its key's hash) at instant n, for
// decideHere: none for a copy learnt under another plan while Redis can
// decide (Redis rescales it); while it cannot (failed), a key without one
// gets one, and one of another plan takes b's.
func (s *Store) copyOf(now time.Time, b *store.BucketDemand, sz *SyncZone, sh *SyncShard, h uint64, n time.Duration, failed error) *SyncCopy {
	c := sh.M[h]
	switch {
	case failed == nil && c != nil && !sameLimit(c.base, baseLimit(b)):
		c = nil // learnt under another plan: Redis rescales it
	case failed != nil && c == nil:
		floor := s.Known(now, b, failed)
		if c = sz.add(sh, h, s, b, n, floor); c == nil {
			c = &SyncCopy{fullAt: n + floor, used: true} // beyond maxSyncKeys: this request's alone, in no list
		}
		fallthrough
	case failed != nil && !sameLimit(c.base, baseLimit(b)):
		c.base, c.lim = baseLimit(b), baseLimit(b)
	}
	return c
}

func containsShard(shards []*SyncShard, sh *SyncShard) bool {
	for _, x := range shards {
		if x == sh {
			return true
		}
	}
	return false
}

// learn sets the copies of d's buckets in zones with sync from Redis's
// answer, making those it lacks. Demands that a cluster took a slot at a
// time (their keys in different slots) teach nothing: a bucket after a
// refusal was not asked.
func (s *Store) learn(now time.Time, d *store.Demands) {
	if s.Client.Cluster && !oneTag(d) {
		return
	}
	s.withCopies(d, func(sz *SyncZone, sh *SyncShard, h uint64, b *store.BucketDemand) {
		n, at := sz.Instant(now), sz.Instant(d.At)
		c := sh.M[h]
		if c == nil {
			c = sz.add(sh, h, s, b, n, 0)
		}
		if c != nil {
			c.base, c.cost = baseLimit(b), int64(b.Cost/b.Limit.TokenTime)
			sh.use(c)
			c.learnt(at, max(n, at), b.Debt, b.Limit, c.pending+c.sent)
		}
	})
}

// forgetSync drops this instance's copies of d's buckets (a reset): their
// next requests go to Redis. The other instances learn of a reset at
// their next reconciliation.
func (s *Store) forgetSync(d *store.Demands) {
	s.withCopies(d, func(sz *SyncZone, sh *SyncShard, h uint64, _ *store.BucketDemand) {
		if _, ok := sh.M[h]; ok {
			delete(sh.M, h)
			sz.Size.Add(-1)
		}
	})
}

// peekSync adds to what Redis said of d's buckets in zones with sync what
// this instance spent that Redis has not heard of yet.
func (s *Store) peekSync(d *store.Demands) {
	s.withCopies(d, func(_ *SyncZone, sh *SyncShard, h uint64, b *store.BucketDemand) {
		if c := sh.M[h]; c != nil {
			b.Debt = min(b.Debt+time.Duration(c.pending+c.sent)*b.Limit.TokenTime, b.Limit.Most())
		}
	})
}

// withCopies calls f for each bucket of d in a zone with sync, with the
// shard of its copy locked, and the copy's hash.
func (s *Store) withCopies(d *store.Demands, f func(sz *SyncZone, sh *SyncShard, h uint64, b *store.BucketDemand)) {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if sz := s.Zones[b.Zone].Sync; sz != nil {
			sh, h := sz.Lock(b.Key)
			f(sz, sh, h, b)
			sh.Mu.Unlock()
		}
	}
}

// bindSync gets the copies of the store's zones with sync.
func (s *Store) bindSync(zones []store.ZoneSpec) error {
	for i, z := range zones {
		if z.Sync == 0 {
			continue
		}
		id := SyncID{s.Setup, s.KeyPrefix, s.HashKeys, s.Zones[i].Field, z.Sync}
		sz, err := s.SyncPool.Acquire(id, func() *SyncZone { return newSyncZone(z.Sync) })
		if err != nil {
			return err
		}
		sz.join(syncUser{s, i})
		s.Zones[i].Sync = sz
		s.syncIDs = append(s.syncIDs, id)
	}
	return nil
}

// releaseSync gives the copies back; the last config that has a zone
// reconciles its copies a last time.
func (s *Store) releaseSync() error {
	for i := range s.Zones {
		if sz := s.Zones[i].Sync; sz != nil {
			sz.leave(s)
		}
	}
	// syncIDs stay as they are: the last user drops the store once, and a
	// request that reached it later (its hold refused) still reads them,
	// to be decided by fail_mode when its call fails on the closed client.
	var errs []error
	for _, id := range s.syncIDs {
		errs = append(errs, s.SyncPool.Release(id))
	}
	return errors.Join(errs...)
}

// A SyncPool holds the copies of the zones with sync of every loaded
// config, by syncID, so that a reload that keeps a zone keeps its copies
// (the Redis store module's pool).
type SyncPool interface {
	// acquire gets the copies of id, made by make when no config has
	// them; release lets go of them.
	Acquire(id SyncID, make func() *SyncZone) (*SyncZone, error)
	Release(id SyncID) error
}

// loop reconciles every interval, and a last time when the zone goes.
func (sz *SyncZone) loop() {
	defer close(sz.done)
	tick := time.NewTicker(sz.interval)
	defer tick.Stop()
	for {
		select {
		case <-sz.stop:
			sz.Reconcile()
			return
		case <-tick.C:
			sz.Reconcile()
		}
	}
}

// A syncItem is a copy in a reconciliation: the tokens it sends, counted
// in its limit base.
type syncItem struct {
	c      *SyncCopy
	sh     *SyncShard
	base   gcra.Limit
	tokens int64
}

// Reconcile sends Redis what each copy that was asked or spent since the
// last reconciliation spent, as adjustments, syncFlight to a script call,
// and sets the copies from the answers; and drops the copies that have
// had their day (see sweep). Its work follows the copies used since the
// last one, not the copies held: an idle zone costs a lock of each shard.
// While Redis is down (its breaker open), what the copies spend waits
// for the next, forgiven beyond two intervals of refill or a request's
// cost (see owe).
func (sz *SyncZone) Reconcile() {
	u, ok := sz.owner()
	if !ok {
		return
	}
	up := u.s.Client.Up()
	n := sz.Instant(time.Now())
	batch := sz.batch[:0]
	defer func() { clear(batch); sz.batch = batch[:0] }()
	for i := range sz.Shards {
		sh := &sz.Shards[i]
		sh.Mu.Lock()
		sz.Sweep(sh, n)
		if up {
			batch = sz.collect(sh, batch)
		}
		sh.Mu.Unlock()
	}
	own := len(batch) > 0 && sz.ownLimits(u)
	for sent := 0; sent < len(batch); {
		if !u.s.Client.Up() {
			// Redis went away meanwhile: the rest waits for the next.
			for i := range batch[sent:] {
				p := &batch[sent+i]
				p.sh.Mu.Lock()
				sz.unsent(p, false)
				p.sh.Mu.Unlock()
			}
			return
		}
		part := batch[sent:min(len(batch), sent+syncFlight)]
		sent += len(part)
		sz.send(u, part, own)
	}
}

// collect appends to batch the copies of sh used since the last
// reconciliation, each with what it spent, which it now sends. Requires
// sh.mu.
func (sz *SyncZone) collect(sh *SyncShard, batch []syncItem) []syncItem {
	for _, c := range sh.used {
		c.used = false
		if sh.M[c.key] != c {
			continue // reset meanwhile: its key's next request goes to Redis
		}
		batch = append(batch, syncItem{c, sh, c.base, c.pending})
		c.sent, c.pending = c.pending, 0
	}
	sz.Visited.Add(uint64(len(sh.used)))
	clear(sh.used)
	sh.used = sh.used[:0]
	return batch
}

// Sweep drops the copies of sh whose check is due at n and that have had
// their day: no request used them since the last reconciliation, their
// bucket is full, and Redis last answered for them more than keep ago.
// It checks the others again keep later: each copy is looked at once
// every keep, from when it is made, so that what the sweep costs an
// interval is the copies made or checked keep earlier, not all those
// held. Requires sh.mu.
func (sz *SyncZone) Sweep(sh *SyncShard, n time.Duration) {
	visited := uint64(0)
	for c := sh.expiry.pop(n); c != nil; c = sh.expiry.pop(n) {
		visited++
		switch {
		case sh.M[c.key] != c: // reset: gone already
		case !c.used && n-c.heard > sz.Keep() && c.fullAt <= n:
			delete(sh.M, c.key)
			sz.Size.Add(-1)
		default:
			sh.expiry.push(c, n+sz.Keep())
		}
	}
	sz.Visited.Add(visited)
}

// ownLimits reports whether a reconciliation must read its keys' own
// limits (overrides): unless Redis says, asked now, that the zone has
// none. A count costs Redis one command a reconciliation where reading
// would cost one a key; an override set through another instance
// meanwhile is read by the next reconciliation, an interval later.
func (sz *SyncZone) ownLimits(u syncUser) bool {
	at := time.Since(ProcessStart).Nanoseconds()
	u.s.pollOverrides(u.zone, at)
	c := u.s.Zones[u.zone].Overridden.Load()
	return c.N != 0 || c.At < at
}

// send reconciles part in one flight, reading the keys' own limits if
// own. An adjustment refuses nothing, so each bucket is charged as it
// would be alone, and part goes as one adjustment of all its buckets: one
// script call on one Redis; on a cluster, one per hash tag among them
// (part is sorted by hash for it).
func (sz *SyncZone) send(u syncUser, part []syncItem, own bool) {
	s := u.s
	if s.Client.Cluster {
		slices.SortFunc(part, func(a, b syncItem) int { return strings.Compare(a.c.hash, b.c.hash) })
	}
	deadline := time.Now().Add(s.CallTimeout)
	bs := slices.Grow(sz.bs[:0], len(part))[:len(part)]
	defer func() { clear(bs); sz.bs = bs[:0] }()
	var ds []store.Demands
	var calls []*rediswire.Call
	for i := range part {
		p := &part[i]
		// The script applies the key's own limit itself (see build).
		bs[i] = store.BucketDemand{Zone: u.zone, Limit: p.base, Cost: time.Duration(p.tokens) * p.base.TokenTime}
		if i == 0 || s.Client.Cluster && p.c.hash != part[i-1].c.hash {
			ds = append(ds, store.Demands{Buckets: bs[i:i]})
			calls = append(calls, rediswire.NewCall(rediswire.Adjust, deadline))
		}
		d := &ds[len(ds)-1]
		d.Buckets = d.Buckets[:len(d.Buckets)+1] // bs[i], the call's next bucket
		limit := p.c.limitKey
		if !own {
			limit = p.c.hash // the script reads no override
		}
		calls[len(calls)-1].AdjustBucket(p.c.hash, p.c.field, limit, s.ShapeOf(&bs[i], true), bs[i].Cost)
	}
	sent := time.Now()
	replies, errs := s.Client.RunAll(calls)
	var failure error
	var failed uint64
	i := 0
	for j := range ds {
		_, err := s.answered(replies[j], errs[j], sent, rediswire.Adjust, &ds[j])
		if err != nil {
			failure = cmpErr(failure, err)
			failed++
		}
		for k := range ds[j].Buckets {
			sz.update(u, &part[i], &ds[j], k, err)
			i++
		}
	}
	// The metrics count script calls: one per hash tag on a cluster.
	sz.calls.Add(uint64(len(calls)))
	sz.failed.Add(failed)
	sz.Keys.Add(uint64(len(part)))
	switch kind := rediswire.Classify(failure); {
	case failure == nil || kind == rediswire.Answered:
		s.Client.Answered(s.Logger)
		if failure != nil {
			s.keyErrors.Warn(s.Logger, "redis refused a reconciliation of zone "+s.Zones[u.zone].name, failure)
		}
	case kind != rediswire.Unknown: // an Unknown failure says nothing of Redis
		s.Client.Failed(s.Logger, failure)
	}
}

// update sets p's copy from bucket k of d, the answer of its call, or
// keeps what it sent for the next reconciliation when the call failed.
func (sz *SyncZone) update(u syncUser, p *syncItem, d *store.Demands, k int, err error) {
	b := &d.Buckets[k]
	p.sh.Mu.Lock()
	c := p.c
	if err != nil {
		sz.unsent(p, rediswire.InDoubt(err))
	} else {
		c.sent = 0
		n := sz.Instant(time.Now())
		c.learnt(sz.Instant(d.At), n, b.Debt, b.Limit, c.pending)
	}
	p.sh.Mu.Unlock()
	if err == nil && b.Overridden {
		u.s.sawOverride(u.zone)
	}
}

// owe adds tokens to what c spent here and has not sent, for the next
// reconciliation to send. Requires sh.mu, c's shard's lock. away says
// that they wait for Redis because Redis could not take them: decided
// here while it was away (its breaker open, the request's call failed,
// or the copy has calls in doubt), or sent in a reconciliation that
// failed or was not made. What waits so is forgiven beyond two intervals
// of refill, or one request's cost when that is more, as fail_mode local
// forgets what its buckets spent: no allowance held an outage's spending
// back, and all of it charged to the shared bucket at once would refuse
// the keys used during the outage for up to syncOwe intervals after.
// Spending that Redis could have taken (within the allowance, while it
// answers) is always sent whole: the bound counts on it.
//
// doubt says that the tokens went in a call that failed in doubt: Redis
// may have run it, or may run it later (a frozen Redis thawing), so they
// are not sent again, and count against what may still go up: the copy
// then decides here, sending nothing to Redis but its reconciliations,
// until Redis answers for the key again, so that one call at most is in
// doubt for it.
func (sz *SyncZone) owe(sh *SyncShard, c *SyncCopy, tokens int64, away, doubt bool) {
	if doubt {
		c.doubt += tokens
	} else {
		c.pending += tokens
	}
	if away || doubt {
		c.pending = min(c.pending, max(sz.forgiven(c)-c.doubt, 0))
	}
	sh.use(c)
}

// forgiven is what of c's spending while Redis was away may go up, in
// tokens: two intervals of refill, or one request's cost when that is
// more.
func (sz *SyncZone) forgiven(c *SyncCopy) int64 {
	return max(int64(2*sz.interval/c.lim.TokenTime), c.cost, 1)
}

// unsent puts back what p's copy sent in a call that failed or was not
// made, for the next reconciliation to send again, with the shared state
// to learn: Redis could not take it (see owe); or, for a call that
// failed in doubt, counts it in doubt. Requires p.sh.mu.
func (sz *SyncZone) unsent(p *syncItem, doubt bool) {
	tokens := p.c.sent
	p.c.sent = 0
	sz.owe(p.sh, p.c, tokens, true, doubt)
}

// sawOverride has the store's decisions of a zone read the keys' own
// limits: a reconciliation found one, set through another instance,
// which the zone's count of overrides may not show yet (see mayOverride).
// What the over-limit cache learnt without reading them is forgotten, as
// when a poll finds the zone's first override.
func (s *Store) sawOverride(zone int) {
	rz := &s.Zones[zone]
	if c := rz.Overridden.Load(); c.N == 0 {
		if rz.Overridden.CompareAndSwap(c, &countedOverrides{N: -1, At: time.Since(ProcessStart).Nanoseconds()}) {
			rz.overriddenGen.Add(1)
			if rz.Cache != nil {
				rz.Cache.Clear()
			}
		}
	}
}

func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}
