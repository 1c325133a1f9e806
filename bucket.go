// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"hash/maphash"
	"math"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// This file holds the token-bucket math and the in-memory table of
// buckets. It knows nothing of HTTP, Caddy or Redis, and never reads a
// clock: every instant is a parameter.
//
// A token bucket with rate r and capacity C is kept as one number, the
// instant f at which it will be full again (GCRA's "theoretical arrival
// time"). At instant now it holds C − r·max(0, f−now) tokens; taking n
// tokens moves f to max(f, now) + n/r, which is allowed while the result
// lies no further than C/r ahead of now. A bucket with f ≤ now is full and
// carries no information, so it can be forgotten without changing any
// decision.

// A limit is the shape of a token bucket, in time: a token is worth tau
// of refill, a full bucket worth full = burst·tau. Both are whole
// nanoseconds, so that the sums the math makes are exact: a full bucket
// always gives burst tokens at once, and nothing drifts. (A rate whose
// token is not a whole number of nanoseconds, such as 7r/s, is kept to
// the nearest one: 1 part in 10⁸ at most.)
type limit struct {
	tau   int64 // 1/r: time to refill one token
	full  int64 // C/r: time to refill the whole bucket from empty
	burst int64 // C: capacity in tokens
}

// maxFull bounds C/r so that instants and sums of them never overflow.
const maxFull = 100 * 365 * 24 * time.Hour

// maxRate is the fastest rate: a token a nanosecond.
const maxRate = 1e9

// newLimit is the shape of a bucket. The caller checks that the rate is
// at most maxRate and that burst·tau is at most maxFull.
func newLimit(ratePerSec float64, burst int64) limit {
	tau := max(int64(math.Round(float64(time.Second)/ratePerSec)), 1)
	return limit{tau: tau, full: burst * tau, burst: burst}
}

// cost is the time that n tokens are worth, or -1 when n can never fit.
func (l limit) cost(n int64) int64 {
	if n > l.burst {
		return -1
	}
	return n * l.tau
}

// debt is how long a bucket full at f needs, seen at now, to be full
// again: 0 when it is full, never more than l.full (a clock that went
// backwards must not leave a bucket owing more than a whole bucket).
func (l limit) debt(f, now int64) int64 {
	return min(max(f-now, 0), l.full)
}

// take charges cost (from l.cost) to a bucket full at f. It returns the
// bucket's new instant and whether the tokens were there; when they were
// not, f is returned unchanged.
func (l limit) take(f, now, cost int64) (int64, bool) {
	d := l.debt(f, now)
	if cost < 0 || d+cost > l.full {
		return f, false
	}
	return now + d + cost, true
}

// remaining is the number of tokens, possibly fractional, in a bucket that
// owes debt.
func (l limit) remaining(debt int64) float64 {
	return float64(l.full-debt) / float64(l.tau)
}

// wait is how long a bucket that owes debt needs before it can give cost
// tokens, or -1 if it never can.
func (l limit) wait(debt, cost int64) int64 {
	if cost < 0 {
		return -1
	}
	return max(debt+cost-l.full, 0)
}

// A bucketKey names one bucket within a zone: an IP network when the
// zone's key expanded to an IP address, else the expanded string.
type bucketKey struct {
	s  string
	ip netip.Prefix
}

func (k bucketKey) String() string {
	if !k.ip.IsValid() {
		return k.s
	}
	if k.ip.IsSingleIP() {
		return k.ip.Addr().String()
	}
	return k.ip.String()
}

// table holds the buckets of one zone in memory: a map from a keyed
// 64-bit hash of the bucket key to the bucket's full-again instant, split
// into shards so that parallel requests rarely share a lock. Keys of any
// length cost the same eight bytes.
//
// At most maxKeys buckets are kept, an equal share in each shard, so a
// table with many keys starts evicting a little before it holds maxKeys
// (at about 99.5% of a million). When a shard is full, buckets that
// have refilled are dropped first (no decision changes); if none has, the
// bucket closest to full among a few sampled ones is evicted and counted:
// its client finds a full bucket next time.
type table struct {
	id      uint64    // orders locks when one request takes several tables
	epoch   time.Time // instants in the shards are nanoseconds since epoch
	seed    maphash.Seed
	maxKeys atomic.Int64
	shards  []shard // a power of two of them
	mask    uint64  // len(shards) - 1

	evictions atomic.Uint64
	stop      chan struct{}
	stopOnce  sync.Once
}

type shard struct {
	mu sync.Mutex
	// full maps a key hash to the instant its bucket is full again.
	full map[uint64]int64
	// sweepCredit counts the inserts until a full shard may be swept
	// again, which keeps sweeping O(1) per insert.
	sweepCredit int
	_           [40]byte // keep shards on separate cache lines
}

// evictSample is how many buckets are looked at to pick one to evict.
const evictSample = 8

var tableIDs atomic.Uint64

func newTable(maxKeys int64, now time.Time) *table {
	n := 64
	if maxKeys < 64*64 {
		n = 1
	}
	t := &table{
		id:     tableIDs.Add(1),
		epoch:  now,
		seed:   maphash.MakeSeed(),
		shards: make([]shard, n),
		mask:   uint64(n - 1),
		stop:   make(chan struct{}),
	}
	t.maxKeys.Store(maxKeys)
	for i := range t.shards {
		t.shards[i].full = make(map[uint64]int64)
	}
	return t
}

// instant converts a clock reading to the table's own time line.
func (t *table) instant(now time.Time) int64 { return int64(now.Sub(t.epoch)) }

func (t *table) hash(k bucketKey) uint64 {
	if !k.ip.IsValid() {
		return maphash.String(t.seed, k.s)
	}
	return maphash.Comparable(t.seed, k.ip)
}

func (t *table) shard(h uint64) *shard {
	return &t.shards[h&t.mask]
}

// shardCap is how many buckets one shard may hold.
func (t *table) shardCap() int {
	return max(int(t.maxKeys.Load())/len(t.shards), 1)
}

// get returns the instant a bucket is full again, 0 if not tracked.
// Requires s.mu to be held.
func (s *shard) get(h uint64) int64 { return s.full[h] }

// set records f for a bucket of table t, making room first if the bucket
// is new and the shard full. Requires s.mu to be held.
func (s *shard) set(t *table, h uint64, f, now int64) {
	if _, ok := s.full[h]; !ok {
		s.insert(t, h, f, now)
		return
	}
	s.full[h] = f
}

// insert records f for a bucket that is not tracked yet.
// Requires s.mu to be held.
func (s *shard) insert(t *table, h uint64, f, now int64) {
	if s.makeRoom(now, t.shardCap()) {
		t.evictions.Add(1)
	}
	s.sweepCredit--
	s.full[h] = f
}

// makeRoom frees one slot in a full shard. Requires s.mu to be held.
func (s *shard) makeRoom(now int64, capacity int) (evicted bool) {
	if len(s.full) < capacity {
		return false
	}
	if s.sweepCredit <= 0 {
		s.sweep(now)
		s.sweepCredit = max(capacity/8, 1)
		if len(s.full) < capacity {
			return false
		}
	}
	for len(s.full) >= capacity {
		var victim uint64
		oldest, seen := int64(math.MaxInt64), 0
		for h, f := range s.full {
			if f <= now {
				victim, oldest = h, f
				break
			}
			if f < oldest {
				victim, oldest = h, f
			}
			if seen++; seen == evictSample {
				break
			}
		}
		delete(s.full, victim)
		if oldest > now {
			evicted = true
		}
	}
	return evicted
}

// sweep drops the buckets that are full at now. Requires s.mu to be held.
func (s *shard) sweep(now int64) {
	for h, f := range s.full {
		if f <= now {
			delete(s.full, h)
		}
	}
}

// get returns the instant k's bucket is full again, 0 if not tracked.
func (t *table) get(k bucketKey) int64 {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.get(h)
}

// raise makes k's bucket full again no sooner than f. now is the current
// table instant, which tells the eviction what has refilled.
func (t *table) raise(k bucketKey, f, now int64) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if f > s.get(h) {
		s.set(t, h, f, now)
	}
}

// forget drops a bucket: it is full again.
func (t *table) forget(k bucketKey) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	delete(s.full, h)
	s.mu.Unlock()
}

// sweep drops every full bucket of the table.
func (t *table) sweep(now time.Time) {
	n := t.instant(now)
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		s.sweep(n)
		s.mu.Unlock()
	}
}

// len is the number of buckets tracked.
func (t *table) len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += len(s.full)
		s.mu.Unlock()
	}
	return n
}

// sweepEvery is how often idle tables drop refilled buckets, so that the
// map stays near the number of clients that are actually being limited.
const sweepEvery = time.Minute

func (t *table) sweepLoop() {
	tick := time.NewTicker(sweepEvery)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case now := <-tick.C:
			t.sweep(now)
		}
	}
}

// Destruct stops the sweeper once the last config using the table is gone.
func (t *table) Destruct() error {
	t.stopOnce.Do(func() { close(t.stop) })
	return nil
}

// A charge is one bucket a request wants tokens from, located in its
// table. The charges of one request are in distinct tables (one per zone).
type charge struct {
	l    limit
	cost int64 // l.cost(n)
	t    *table
	h    uint64
	now  int64 // t.instant of the request
	req  int   // index of the request this charge answers

	f    int64 // the bucket's instant, with this charge if ok
	ok   bool
	debt int64 // how long until the bucket is full, after the decision
}

// takeAll charges every bucket or none: a request denied by one bucket
// spends nothing in the others. Shards are locked in one global order (by
// table), so concurrent multi-zone requests cannot deadlock. It fills in
// each charge's ok and debt and reports whether all were allowed.
func takeAll(cs []charge) (allowed bool) {
	if len(cs) == 1 { // the common case, with one map lookup less
		c := &cs[0]
		s := c.t.shard(c.h)
		s.mu.Lock()
		f, tracked := s.full[c.h]
		if c.f, c.ok = c.l.take(f, c.now, c.cost); c.ok {
			if tracked {
				s.full[c.h] = c.f
			} else {
				s.insert(c.t, c.h, c.f, c.now)
			}
		}
		s.mu.Unlock()
		c.debt = c.l.debt(c.f, c.now)
		return c.ok
	}
	sortCharges(cs)
	allowed = true
	for i := range cs {
		c := &cs[i]
		s := c.t.shard(c.h)
		s.mu.Lock()
		c.f, c.ok = c.l.take(s.get(c.h), c.now, c.cost)
		allowed = allowed && c.ok
	}
	for i := range cs {
		c := &cs[i]
		s := c.t.shard(c.h)
		if allowed {
			s.set(c.t, c.h, c.f, c.now)
		} else if c.ok {
			c.f = s.get(c.h) // not charged after all
		}
		c.debt = c.l.debt(c.f, c.now)
		s.mu.Unlock()
	}
	return allowed
}

// sortCharges orders charges by table: the global lock order. Requests
// carry a few zones, so insertion sort is the fastest.
func sortCharges(cs []charge) {
	for i := 1; i < len(cs); i++ {
		for j := i; j > 0 && cs[j].t.id < cs[j-1].t.id; j-- {
			cs[j], cs[j-1] = cs[j-1], cs[j]
		}
	}
}
