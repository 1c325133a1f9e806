// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// Zones with share (docs/share.md): this instance decides a busy key's
// requests from a share of its bucket's tokens that Redis granted it in
// advance, and asks Redis only when the share runs out or nears its end.
// Redis keeps the bucket's tokens plus every share out at most the burst
// (lua/decide/65_share.lua), so that the instances together never admit
// more than one exact bucket would:
//
//   - A key without a share here is decided by Redis, exactly, by a touch
//     of its bucket that clips it by the shares out. A touch asks for a
//     share once the key is busy here: its requests of the last ttl cost
//     shareBusy of them or more. A share is what two ttls of them cost,
//     as Redis grants it (a fair part of what the bucket holds, at most a
//     quarter of its burst).
//   - A share is spent here until this instance's end of it: a tenth of
//     its ttl before Redis's, counted from when the touch was sent, so
//     that it ends here first. Past its middle a busy key's share is
//     renewed in the background: what was spent is reported, more is
//     granted, and the end moves on.
//   - A share a key no longer uses is returned: what it did not spend
//     goes back to the bucket. One that ends unreturned (the instance
//     died, its return was lost) is written off whole by Redis: what it
//     did not spend comes back by refill only.
//   - A refusal is remembered only as long as the bucket could not hold
//     the cost even with every share out returned to it: a return it did
//     not see never makes it wrong.

const (
	shareShards = 16 // a power of two

	// shareBusy is how many requests' cost within a ttl make a key busy:
	// below it, a share would mostly be written off or returned unspent.
	shareBusy = 8

	// maxShareKeys bounds the keys of each zone this instance tracks:
	// beyond it, a new key's requests are decided by Redis.
	maxShareKeys = 100_000
)

// errShareOwnLimit refuses a key's own limit in a zone with share: the
// shares already out could not follow it.
var errShareOwnLimit = errors.New("a zone with share has no keys' own limits: the shares already out could not follow a new one")

// A shareZone is this instance's shares of one zone's buckets.
type shareZone struct {
	zone    int
	ttl     time.Duration
	holder  string // the ids of this instance's shares start with it
	seq     atomic.Uint64
	hashKey siphash.Key
	shards  [shareShards]shareShard
	size    atomic.Int64

	stop, done chan struct{}

	// What it did, for the metrics: shares granted (and renewed), shares
	// returned and written off, requests decided here and by Redis.
	grants, returns, writeOffs, here, exact atomic.Uint64
}

type shareShard struct {
	mu sync.Mutex
	m  map[uint64]*shareOf
}

// shareOf is what this instance knows of one key's bucket.
type shareOf struct {
	key store.Key
	// The share: its holder's id ("" for none), what Redis granted it and
	// what this instance spent of it, both counted since the share began,
	// and when this instance stops spending it.
	holder         string
	granted, spent time.Duration
	held           time.Duration // spent by requests whose other demands are being decided
	until          time.Time
	asking         bool // a touch that asks for more is in flight
	// The key's demand here: what its requests cost since since, and in
	// the ttl before.
	since      time.Time
	cost, prev time.Duration
	used       time.Time // its last request
	// Redis's last answer: what the bucket owed, with the tokens out in
	// every share, at.
	debt, out time.Duration
	at        time.Time
	// A remembered refusal: before full, the bucket cannot hold need.
	// refused: a plain take was refused last (see takeShare).
	full    time.Time
	need    time.Duration
	refused bool
}

// left is what e's share holds at now.
func (e *shareOf) left(now time.Time) time.Duration {
	if e.holder == "" || !now.Before(e.until) {
		return 0
	}
	return e.granted - e.spent - e.held
}

// spend spends cost of e's share, for good or held (see settleShares).
func (e *shareOf) spend(cost time.Duration, tentative bool) {
	if tentative {
		e.held += cost
	} else {
		e.spent += cost
	}
}

// demand counts a request's cost at now, and is what the key's requests
// cost here over the last ttl.
func (e *shareOf) demand(now time.Time, cost, ttl time.Duration) time.Duration {
	switch d := now.Sub(e.since); {
	case d >= 2*ttl:
		e.since, e.cost, e.prev = now, 0, 0
	case d >= ttl:
		e.since, e.cost, e.prev = now, 0, e.cost
	}
	e.cost += cost
	e.used = now
	return max(e.cost, e.prev)
}

// lastDebt is what the bucket owes at now as Redis last said, less this
// instance's share: the headers' remaining is the bucket's and the
// share's tokens.
func (e *shareOf) lastDebt(now time.Time) time.Duration {
	return max(e.debt-now.Sub(e.at), 0)
}

func newShareZone(zone int, ttl time.Duration) *shareZone {
	var id [6]byte
	_, _ = rand.Read(id[:])
	sz := &shareZone{zone: zone, ttl: ttl, hashKey: siphash.NewKey(), stop: make(chan struct{}), done: make(chan struct{}),
		holder: base64.RawURLEncoding.EncodeToString(id[:])}
	for i := range sz.shards {
		sz.shards[i].m = make(map[uint64]*shareOf)
	}
	return sz
}

// lock locks the shard of k's entry and returns it, with the entry (nil
// when there is none and make is false, or the zone holds too many).
func (sz *shareZone) lock(k store.Key, make bool) (*shareShard, *shareOf) {
	h := k.Hash(sz.hashKey)
	sh := &sz.shards[h&(shareShards-1)]
	sh.mu.Lock()
	e := sh.m[h]
	if e == nil && make && sz.size.Load() < maxShareKeys {
		e = &shareOf{key: k}
		sh.m[h] = e
		sz.size.Add(1)
	}
	return sh, e
}

// newHolder starts a share of e: an id no share had before.
func (sz *shareZone) newHolder(e *shareOf) {
	e.holder = sz.holder + ":" + strconv.FormatUint(sz.seq.Add(1), 36)
	e.granted, e.spent, e.until = 0, 0, time.Time{}
}

// shared reports whether a bucket of d is in a zone with share.
func (s *Store) shared(d *store.Demands) bool {
	for i := range d.Buckets {
		if s.zones[d.Buckets[i].Zone].shares != nil {
			return true
		}
	}
	return false
}

// What a request took of a bucket, for the undoing.
const (
	shareNone  = iota // nothing, or it is not in a zone with share
	shareHere         // from this instance's share
	shareRedis        // from the bucket in Redis
)

// takeShared decides demands of which a bucket is in a zone with share:
// those buckets first, each from this instance's share or by Redis, then
// the other demands as without share; a refusal gives back what the
// request took, so that it is decided all or nothing.
func (s *Store) takeShared(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	deadline := time.Now().Add(s.opt.CallTimeout)
	var howArr [4]uint8
	how := howArr[:0]
	allowed := true
	var err error
	rest := false
	for i := range d.Buckets {
		rest = rest || s.zones[d.Buckets[i].Zone].shares == nil
	}
	// With other demands, what a share gives is held until they are
	// decided: reports tell Redis only of what was spent for good.
	tentative := rest || len(d.Counters)+len(d.Slots) > 0 || len(d.Buckets) > 1
	for i := range d.Buckets {
		b := &d.Buckets[i]
		sz := s.zones[b.Zone].shares
		if sz == nil {
			how = append(how, shareNone)
			continue
		}
		if !allowed {
			s.peekShare(sz, now, b)
			how = append(how, shareNone)
			continue
		}
		var h uint8
		var ok bool
		ok, h, err = s.takeShare(ctx, deadline, sz, now, b, d, tentative)
		how = append(how, h)
		if err != nil {
			allowed = false
			break
		}
		if !ok && !b.Soft {
			allowed = false
		}
	}
	if allowed && (rest || len(d.Counters)+len(d.Slots) > 0) {
		var r store.Demands
		for i := range d.Buckets {
			if s.zones[d.Buckets[i].Zone].shares == nil {
				r.Buckets = append(r.Buckets, d.Buckets[i])
			}
		}
		r.Counters, r.Slots = d.Counters, d.Slots
		allowed, err = s.takeExact(ctx, now, &r)
		j := 0
		for i := range d.Buckets {
			if s.zones[d.Buckets[i].Zone].shares == nil {
				d.Buckets[i] = r.Buckets[j]
				j++
			}
		}
		d.Remembered = d.Remembered || r.Remembered
		allowed = allowed && err == nil
	}
	if tentative {
		s.settleShares(d, how, allowed)
	}
	if !allowed {
		s.undoShares(d, how)
	}
	return allowed, err
}

// settleShares spends for good what d's buckets held of this instance's
// shares, when the request was allowed, else lets go of it.
func (s *Store) settleShares(d *store.Demands, how []uint8, allowed bool) {
	for i, h := range how {
		if h != shareHere {
			continue
		}
		b := &d.Buckets[i]
		sh, e := s.zones[b.Zone].shares.lock(b.Key, false)
		if e != nil && e.held >= b.Cost {
			e.held -= b.Cost
			if allowed {
				e.spent += b.Cost
			}
		}
		sh.mu.Unlock()
	}
}

// takeShare decides b, of a zone with share: from this instance's share
// when it holds the cost, as a refusal remembered, or by Redis.
func (s *Store) takeShare(ctx context.Context, deadline time.Time, sz *shareZone, now time.Time, b *store.BucketDemand, d *store.Demands, tentative bool) (bool, uint8, error) {
	sh, e := sz.lock(b.Key, true)
	if e == nil { // too many keys: Redis decides, as without share
		sh.mu.Unlock()
		ok, err := s.shareCall(ctx, deadline, sz, nil, b, b.Cost, false)
		if !ok || err != nil {
			return false, shareNone, err
		}
		return true, shareRedis, nil
	}
	rate := e.demand(now, b.Cost, sz.ttl)
	if b.Cost <= e.left(now) {
		e.spend(b.Cost, tentative)
		b.OK, b.Debt = true, max(e.lastDebt(now)-e.left(now), 0)
		renew := !e.asking && (e.until.Sub(now) < sz.ttl/2 || e.left(now) < b.Cost)
		if renew {
			e.asking = true
		}
		sh.mu.Unlock()
		sz.here.Add(1)
		if renew {
			s.renew(sz, *b) // a copy: b is the request's, which it reuses
		}
		return true, shareHere, nil
	}
	if now.Before(e.full) && b.Cost >= e.need {
		b.OK = false
		b.Debt = b.Limit.BurstTime - b.Cost + e.full.Sub(now)
		d.Remembered = true
		sh.mu.Unlock()
		sz.here.Add(1)
		return false, shareNone, nil
	}
	ask := rate >= shareBusy*b.Cost && !e.asking
	if ask {
		e.asking = true
	}
	plain := !ask && e.holder == "" && !e.refused && !b.Soft && len(d.Buckets) == 1 && len(d.Counters)+len(d.Slots) == 0
	sh.mu.Unlock()
	if plain {
		// A key with no share here, used rarely: a plain take, which
		// clips the bucket by the shares out as the share op would. A
		// refusal sends its next request as a share op, whose answer
		// tells the shares out, so that refusals are remembered.
		ok, err := s.ask(ctx, s.opt.CallTimeout, d)
		if err == nil {
			sz.exact.Add(1)
			sh.mu.Lock()
			e.refused = !ok
			sh.mu.Unlock()
		}
		if !ok || err != nil {
			return false, shareNone, err
		}
		return true, shareRedis, nil
	}
	ok, err := s.shareCall(ctx, deadline, sz, e, b, b.Cost, ask)
	if err == nil && ok {
		return true, shareRedis, nil
	}
	if err == nil && s.spendHere(sz, now, b, tentative) {
		// A renewal in flight meanwhile moved the tokens Redis lacked to
		// this instance's share.
		return true, shareHere, nil
	}
	return false, shareNone, err
}

// renew asks Redis for more of b's share, in the background: it reports
// what the share spent, and moves its end on.
func (s *Store) renew(sz *shareZone, b store.BucketDemand) {
	if !s.Hold() { // the store is going: its shares go back
		sh, e := sz.lock(b.Key, false)
		if e != nil {
			e.asking = false
		}
		sh.mu.Unlock()
		return
	}
	go func() {
		defer s.Done()
		ctx, cancel := context.WithTimeout(context.Background(), s.opt.CallTimeout)
		defer cancel()
		_, _ = s.shareCall(ctx, time.Now().Add(s.opt.CallTimeout), sz, nil, &b, 0, true)
	}()
}

// spendHere spends b's cost from this instance's share, if it holds it:
// tentatively (held until the request's other demands are decided),
// or for good.
func (s *Store) spendHere(sz *shareZone, now time.Time, b *store.BucketDemand, tentative bool) bool {
	sh, e := sz.lock(b.Key, false)
	defer sh.mu.Unlock()
	if e == nil || b.Cost > e.left(now) {
		return false
	}
	e.spend(b.Cost, tentative)
	b.OK, b.Debt = true, max(e.lastDebt(now)-e.left(now), 0)
	sz.here.Add(1)
	return true
}

// shareCall touches b's bucket in Redis: it takes cost (0 for none,
// negative to give back), reports what this instance's share spent, and,
// with ask, asks for more: what the key's requests cost here over two
// ttls. e is b's entry, looked up again when nil; without one, the touch
// reports and asks nothing.
func (s *Store) shareCall(ctx context.Context, deadline time.Time, sz *shareZone, e *shareOf, b *store.BucketDemand, cost time.Duration, ask bool) (bool, error) {
	var sh *shareShard
	if e == nil {
		sh, e = sz.lock(b.Key, false)
	} else {
		sh = &sz.shards[b.Key.Hash(sz.hashKey)&(shareShards-1)]
		sh.mu.Lock()
	}
	holder, known, spent, want := "-", time.Duration(0), time.Duration(0), time.Duration(0)
	sent := s.now()
	if e != nil {
		if e.holder == "" || !sent.Before(e.until) && e.granted > 0 {
			if e.holder != "" && e.granted > e.spent {
				sz.writeOffs.Add(1)
			}
			sz.newHolder(e)
		}
		holder, known, spent = e.holder, e.granted, e.spent
		if ask {
			want = max(2*max(e.cost, e.prev)-e.left(sent), b.Cost)
		}
	}
	sh.mu.Unlock()

	var r rediswire.Reply
	err := rediswire.ErrDown
	if s.client.Up() {
		call := rediswire.NewCall(rediswire.Share, deadline)
		if s.opt.Clock != nil {
			call.Clock(s.opt.Clock())
		}
		hash, field := s.bucketName(b.Zone, b.Key)
		call.Share(hash, field, s.shapeOf(b, false), cost, holder, known, spent, want, sz.ttl, false)
		began := time.Now()
		r, err = s.client.Run(ctx, call)
		if err == nil {
			s.client.NoteRTT(time.Since(began))
		}
		s.tell(ctx, err, false)
	}
	if err == nil && cost > 0 {
		sz.exact.Add(1)
	}

	if e != nil {
		sh.mu.Lock()
		defer sh.mu.Unlock()
		if ask {
			e.asking = false
		}
	}
	if err != nil {
		return false, err
	}
	allowed, debt, granted, left, out := r.Share()
	if e != nil && e.holder == holder {
		e.refused = false
		switch {
		case granted > e.granted:
			e.granted = granted
			sz.grants.Add(1)
			fallthrough
		case granted > 0 && left > 0:
			// Redis ends it at left after it decided, which is after
			// this was sent: a tenth earlier here.
			e.until = later(e.until, sent.Add(left-left/10))
		case known > 0:
			// Redis wrote it off (it ended there before its report
			// came): a new share starts at the next grant.
			e.holder = ""
		}
		e.debt, e.out, e.at = debt, out, sent
		if !allowed && cost > 0 {
			// Even with every share returned, the bucket lacks cost for
			// this long.
			if w := b.Limit.Wait(debt-out, cost); w > 0 {
				e.full, e.need = sent.Add(w), cost
			}
		}
	}
	b.OK = allowed
	b.Debt = debt
	if e != nil && allowed {
		b.Debt = max(debt-e.left(sent), 0)
	}
	return allowed, nil
}

// later is the later of two instants.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// peekShare sets b's answer from what this instance knows, deciding
// nothing: a request another zone refused first.
func (s *Store) peekShare(sz *shareZone, now time.Time, b *store.BucketDemand) {
	sh, e := sz.lock(b.Key, false)
	defer sh.mu.Unlock()
	b.OK, b.Debt = true, 0
	if e != nil {
		left := e.left(now)
		b.OK, b.Debt = b.Cost <= left || b.Cost <= b.Limit.BurstTime-e.lastDebt(now), max(e.lastDebt(now)-left, 0)
	}
}

// undoShares gives back what takeShared took of d's buckets in zones
// with share: to this instance's share what was spent from it, to Redis
// what it took.
func (s *Store) undoShares(d *store.Demands, how []uint8) {
	for i, h := range how {
		b := &d.Buckets[i]
		sz := s.zones[b.Zone].shares
		switch h {
		case shareRedis:
			sh, e := sz.lock(b.Key, false)
			if e != nil {
				e.full = time.Time{}
			}
			sh.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), s.opt.CallTimeout)
			_, _ = s.shareCall(ctx, time.Now().Add(s.opt.CallTimeout), sz, nil, b, -b.Cost, false)
			cancel()
		}
	}
}

// adjustShared makes the adjustments of d's buckets in zones with share,
// each a touch that keeps the bucket clipped by the shares out, and
// takes them out of d.
func (s *Store) adjustShared(ctx context.Context, d *store.Demands) error {
	var err error
	kept := d.Buckets[:0]
	for i := range d.Buckets {
		b := d.Buckets[i]
		sz := s.zones[b.Zone].shares
		if sz == nil {
			kept = append(kept, b)
			continue
		}
		sh, e := sz.lock(b.Key, false)
		if e != nil {
			e.full = time.Time{} // a refusal remembered from before the adjustment
		}
		sh.mu.Unlock()
		if _, e := s.shareCall(ctx, time.Now().Add(s.opt.CallTimeout), sz, nil, &b, b.Cost, false); e != nil && err == nil {
			err = e
		}
	}
	d.Buckets = kept
	return err
}
