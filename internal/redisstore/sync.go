// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
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

// synced reports whether a bucket of d is in a zone with sync.
func (s *Store) synced(d *store.Demands) bool {
	for i := range d.Buckets {
		if s.zones[d.Buckets[i].Zone].copies != nil {
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
		alone = alone && s.zones[d.Buckets[i].Zone].copies != nil
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
		sz := s.zones[b.Zone].copies
		if sz == nil {
			continue
		}
		sh, h := sz.lock(b.Key)
		if c := sh.m[h]; c != nil && c.pending > 0 && sameLimit(c.base, baseLimit(b)) && sameLimit(c.lim, b.Limit) {
			if extra := time.Duration(c.pending) * b.Limit.TokenTime; b.Cost+extra <= b.Limit.BurstTime {
				carried[i], c.pending = c.pending, 0
				b.Cost += extra
			}
		}
		sh.mu.Unlock()
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
		sz := s.zones[b.Zone].copies
		sh, h := sz.lock(b.Key)
		if c := sh.m[h]; c != nil {
			sz.owe(sh, c, carried[i], away, doubt)
		}
		sh.mu.Unlock()
	}
}

// doubted counts the costs of d's buckets in zones with sync in doubt:
// d's call failed in doubt, and fail_mode decided it (see owe).
func (s *Store) doubted(d *store.Demands) {
	s.withCopies(d, func(sz *SyncZone, sh *syncShard, h uint64, b *store.BucketDemand) {
		if c := sh.m[h]; c != nil {
			sz.owe(sh, c, int64(b.Cost/b.Limit.TokenTime), true, true)
		}
	})
}

// A syncLook is what decideHere found of a bucket.
type syncLook struct {
	sz       *SyncZone
	sh       *syncShard
	c        *syncCopy
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
	var lockedArr [4]*syncShard
	var looksArr [4]syncLook
	locked, looks := lockedArr[:0], looksArr[:0]
	defer func() {
		for _, sh := range locked {
			sh.mu.Unlock()
		}
	}()
	strict := failed == nil && s.client.Up()
	here, denied := true, false
	for i := range d.Buckets {
		b := &d.Buckets[i]
		sz := s.zones[b.Zone].copies
		h := b.Key.Hash(sz.hashKey)
		sh := sz.shard(h)
		if !containsShard(locked, sh) {
			sh.mu.Lock()
			locked = append(locked, sh)
		}
		n := sz.instant(now)
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
func (s *Store) copyOf(now time.Time, b *store.BucketDemand, sz *SyncZone, sh *syncShard, h uint64, n time.Duration, failed error) *syncCopy {
	c := sh.m[h]
	switch {
	case failed == nil && c != nil && !sameLimit(c.base, baseLimit(b)):
		c = nil // learnt under another plan: Redis rescales it
	case failed != nil && c == nil:
		floor := s.Known(now, b, failed)
		if c = sz.add(sh, h, s, b, n, floor); c == nil {
			c = &syncCopy{fullAt: n + floor, used: true} // beyond maxSyncKeys: this request's alone, in no list
		}
		fallthrough
	case failed != nil && !sameLimit(c.base, baseLimit(b)):
		c.base, c.lim = baseLimit(b), baseLimit(b)
	}
	return c
}

func containsShard(shards []*syncShard, sh *syncShard) bool {
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
	if s.client.Cluster && !oneTag(d) {
		return
	}
	s.withCopies(d, func(sz *SyncZone, sh *syncShard, h uint64, b *store.BucketDemand) {
		n, at := sz.instant(now), sz.instant(d.At)
		c := sh.m[h]
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
	s.withCopies(d, func(sz *SyncZone, sh *syncShard, h uint64, _ *store.BucketDemand) {
		if _, ok := sh.m[h]; ok {
			delete(sh.m, h)
			sz.size.Add(-1)
		}
	})
}

// peekSync adds to what Redis said of d's buckets in zones with sync what
// this instance spent that Redis has not heard of yet.
func (s *Store) peekSync(d *store.Demands) {
	s.withCopies(d, func(_ *SyncZone, sh *syncShard, h uint64, b *store.BucketDemand) {
		if c := sh.m[h]; c != nil {
			b.Debt = min(b.Debt+time.Duration(c.pending+c.sent)*b.Limit.TokenTime, b.Limit.Most())
		}
	})
}

// withCopies calls f for each bucket of d in a zone with sync, with the
// shard of its copy locked, and the copy's hash.
func (s *Store) withCopies(d *store.Demands, f func(sz *SyncZone, sh *syncShard, h uint64, b *store.BucketDemand)) {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if sz := s.zones[b.Zone].copies; sz != nil {
			sh, h := sz.lock(b.Key)
			f(sz, sh, h, b)
			sh.mu.Unlock()
		}
	}
}

// bindSync gets the copies of the store's zones with sync.
func (s *Store) bindSync(zones []store.ZoneSpec) error {
	for i, z := range zones {
		if z.Sync == 0 {
			continue
		}
		id := SyncID{s.opt.Setup, s.opt.KeyPrefix, s.opt.HashKeys, s.zones[i].field, z.Sync}
		sz, err := s.opt.SyncPool.Acquire(id, func() *SyncZone { return newSyncZone(z.Sync) })
		if err != nil {
			return err
		}
		sz.join(syncUser{s, i})
		s.zones[i].copies = sz
		s.syncIDs = append(s.syncIDs, id)
	}
	return nil
}

// releaseSync gives the copies back; the last config that has a zone
// reconciles its copies a last time.
func (s *Store) releaseSync() error {
	for i := range s.zones {
		if sz := s.zones[i].copies; sz != nil {
			sz.leave(s)
		}
	}
	// syncIDs stay as they are: the last user drops the store once, and a
	// request that reached it later (its hold refused) still reads them,
	// to be decided by fail_mode when its call fails on the closed client.
	var errs []error
	for _, id := range s.syncIDs {
		errs = append(errs, s.opt.SyncPool.Release(id))
	}
	return errors.Join(errs...)
}

// sawOverride has the store's decisions of a zone read the keys' own
// limits: a reconciliation found one, set through another instance,
// which the zone's count of overrides may not show yet (see mayOverride).
// What the over-limit cache learnt without reading them is forgotten, as
// when a poll finds the zone's first override.
func (s *Store) sawOverride(zone int) {
	rz := &s.zones[zone]
	if c := rz.overridden.Load(); c.n == 0 {
		if rz.overridden.CompareAndSwap(c, &countedOverrides{n: -1, at: time.Since(processStart).Nanoseconds()}) {
			rz.overriddenGen.Add(1)
			if rz.cache != nil {
				rz.cache.Clear()
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
