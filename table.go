// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/binary"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// table holds the buckets of one zone in memory: a map from a keyed
// 64-bit hash of the bucket key to the instant the bucket is full again,
// split into shards so that parallel requests rarely share a lock. Keys
// of any length cost the same eight bytes. Instants are durations since
// the table's epoch.
//
// At most maxKeys buckets are kept, an equal share in each shard, so a
// table with many keys starts evicting a little before it holds maxKeys
// (at about 99.5% of a million). When a shard is full, buckets that
// have refilled are dropped first (no decision changes); if none has, the
// least recently used among a few sampled ones is evicted and counted:
// its client finds a full bucket next time. Recency, not fullness, is
// what protects the limit: under a flood of one-off keys, a client that
// keeps sending is among the most recently used whatever its bucket's
// shape, while the flood's keys, each used once, age out first.
type table struct {
	id      uint64    // orders locks when one request takes several tables
	epoch   time.Time // instants in the shards count from here
	key     hashKey   // keys the hashes: random, or the stored one of a persisted table
	maxKeys atomic.Int64
	shards  []shard // a power of two of them
	mask    uint64  // len(shards) - 1

	evictions atomic.Uint64
	stop      chan struct{}
	stopOnce  sync.Once
	p         *persistence // nil: the table lives in memory only
}

type shard struct {
	mu sync.Mutex
	// buckets maps a key hash to its bucket.
	buckets map[uint64]bucket
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
		key:    randomHashKey(),
		shards: make([]shard, n),
		mask:   uint64(n - 1),
		stop:   make(chan struct{}),
	}
	t.maxKeys.Store(maxKeys)
	for i := range t.shards {
		t.shards[i].buckets = make(map[uint64]bucket)
	}
	return t
}

// instant converts a clock reading to the table's own time line.
func (t *table) instant(now time.Time) time.Duration { return now.Sub(t.epoch) }

// hash is the keyed hash that stands for k in the table. String keys
// hash with SipHash. An IP network of at most 64 bits (any IPv4 network;
// IPv6 up to the usual /64) is one 64-bit word, which a keyed bijection
// maps to its hash: two networks of one family and length never share a
// bucket, and the hash costs a few multiplications. (A zone's networks
// all have one length per family.) The two families are mapped by
// different bijections, longer IPv6 networks by SipHash under a key of
// their own, so keys of different kinds share a bucket only by a chance
// of 1 in 2⁶⁴, as SipHash's do.
func (t *table) hash(k bucketKey) uint64 {
	if !k.ip.IsValid() {
		return sipHash(t.key, k.s)
	}
	b := k.ip.Addr().AsSlice() // inlined, it allocates nothing (As16 costs 10 ns more)
	if len(b) == 4 {
		return mix64(uint64(binary.BigEndian.Uint32(b))^t.key[0]) ^ t.key[1]
	}
	bits := uint64(k.ip.Bits())
	if bits <= 64 {
		return mix64(binary.BigEndian.Uint64(b)^t.key[1]) ^ t.key[0]
	}
	words := [2]uint64{binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint64(b[8:])}
	return sipHashWords(hashKey{t.key[0], t.key[1] ^ 1}, words[:], 17<<56|bits)
}

func (t *table) shard(h uint64) *shard {
	return &t.shards[h&t.mask]
}

// shardCap is how many buckets one shard may hold.
func (t *table) shardCap() int {
	return max(int(t.maxKeys.Load())/len(t.shards), 1)
}

// A bucket is one tracked bucket: the instant it is full again, and the
// last instant a request used it, for eviction.
type bucket struct {
	fullAt time.Duration
	usedAt time.Duration
}

// get returns the instant a bucket is full again, 0 if not tracked.
// Requires s.mu to be held.
func (s *shard) get(h uint64) time.Duration { return s.buckets[h].fullAt }

// set records fullAt, used at now, for a bucket of table t, making room
// first if the bucket is new and the shard full. Requires s.mu to be held.
func (s *shard) set(t *table, h uint64, fullAt, now time.Duration) {
	if _, ok := s.buckets[h]; !ok {
		s.insert(t, h, fullAt, now)
		return
	}
	s.buckets[h] = bucket{fullAt, now}
}

// touch records that a request used a tracked bucket at now, without
// changing it. Requires s.mu to be held.
func (s *shard) touch(h uint64, fullAt, now time.Duration) {
	if fullAt != 0 {
		s.buckets[h] = bucket{fullAt, now}
	}
}

// insert records fullAt for a bucket that is not tracked yet.
// Requires s.mu to be held.
func (s *shard) insert(t *table, h uint64, fullAt, now time.Duration) {
	if s.makeRoom(now, t.shardCap()) {
		t.evictions.Add(1)
	}
	s.sweepCredit--
	s.buckets[h] = bucket{fullAt, now}
}

// makeRoom frees one slot in a full shard. Requires s.mu to be held.
func (s *shard) makeRoom(now time.Duration, capacity int) (evicted bool) {
	if len(s.buckets) < capacity {
		return false
	}
	if s.sweepCredit <= 0 {
		s.sweep(now)
		s.sweepCredit = max(capacity/8, 1)
		if len(s.buckets) < capacity {
			return false
		}
	}
	for len(s.buckets) >= capacity {
		var victim uint64
		full, lru := false, time.Duration(math.MaxInt64)
		// The sample is two buckets at each of four places where a
		// range starts (random ones). Eight in a row would be
		// neighbours in the map, and a map refills where it was
		// emptied, so that the neighbours of a bucket used a moment
		// ago can all be newer still and make it the oldest of them.
		for range evictSample / 2 {
			seen := 0
			for h, b := range s.buckets {
				if b.fullAt <= now {
					victim, full = h, true
					break
				}
				if b.usedAt < lru {
					victim, lru = h, b.usedAt
				}
				if seen++; seen == 2 {
					break
				}
			}
			if full {
				break
			}
		}
		delete(s.buckets, victim)
		evicted = evicted || !full
	}
	return evicted
}

// sweep drops the buckets that are full at now. Requires s.mu to be held.
func (s *shard) sweep(now time.Duration) {
	for h, b := range s.buckets {
		if b.fullAt <= now {
			delete(s.buckets, h)
		}
	}
}

// get returns the instant k's bucket is full again, 0 if not tracked.
func (t *table) get(k bucketKey) time.Duration {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.get(h)
}

// raise makes k's bucket full again no sooner than fullAt. now is the
// current table instant, which tells the eviction what has refilled.
func (t *table) raise(k bucketKey, fullAt, now time.Duration) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	if fullAt > s.get(h) {
		s.set(t, h, fullAt, now)
	}
}

// refund gives cost back to k's bucket, unless it is banned. now is the
// current table instant.
func (t *table) refund(k bucketKey, l limit, cost, now time.Duration) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.buckets[h]
	if !ok || l.banned(l.debt(b.fullAt, now)) {
		return
	}
	if b.fullAt-cost <= now {
		delete(s.buckets, h) // full again
		return
	}
	s.buckets[h] = bucket{b.fullAt - cost, now}
}

// forget drops a bucket: it is full again. It returns the instant the
// bucket was full at, 0 if it was not tracked.
func (t *table) forget(k bucketKey) time.Duration {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	fullAt := s.buckets[h].fullAt
	delete(s.buckets, h)
	return fullAt
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
		n += len(s.buckets)
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

// Destruct stops the sweeper once the last config using the table is
// gone, and saves or deletes the table's snapshot (see persist.go).
func (t *table) Destruct() error {
	t.stopOnce.Do(func() {
		close(t.stop)
		t.close(caddy.Exiting())
	})
	return nil
}

// A charge is one bucket a request wants tokens from, located in its
// table. The charges of one request are in distinct tables (one per zone).
type charge struct {
	l    limit
	cost time.Duration // l.costTime(n)
	t    *table
	h    uint64
	now  time.Duration // t.instant of the request
	req  int           // index of the request this charge answers

	fullAt time.Duration // the bucket's instant, with this charge if ok
	ok     bool
	ban    bool          // this denial started a ban
	debt   time.Duration // how long until the bucket is full, after the decision

	// A charge to a calendar quota's counter (quota set) keeps its
	// window's end in fullAt and its count in usedAt: a counter whose
	// window has ended carries nothing, as a full bucket, and eviction
	// takes the smallest counts first (they forgive the least).
	quota *quota
	units int64 // the request's cost
	used  int64 // the count after the decision
}

// tryQuota decides c against a counter b (tracked or not); endAt is the
// instant the current window ends, should the counter start again.
func (c *charge) tryQuota(b bucket, tracked bool, endAt time.Duration) {
	used := int64(0)
	if tracked && b.fullAt > c.now {
		used, endAt = int64(b.usedAt), b.fullAt
	}
	c.ok = used+c.units <= c.quota.limit
	if c.ok {
		used += c.units
	}
	c.used, c.fullAt = used, endAt
	c.setQuotaDebt()
}

// uncharge undoes what tryQuota counted, for a request denied elsewhere.
func (c *charge) uncharge() {
	if c.ok {
		c.used -= c.units
		c.setQuotaDebt()
	}
}

func (c *charge) setQuotaDebt() {
	c.debt = 0
	if c.used > 0 {
		c.debt = c.fullAt - c.now
	}
}

// setCount records a quota's count in a window that ends at endAt.
// Requires s.mu to be held.
func (s *shard) setCount(t *table, h uint64, endAt time.Duration, used int64, now time.Duration) {
	if _, ok := s.buckets[h]; !ok {
		s.insert(t, h, endAt, now)
	}
	s.buckets[h] = bucket{endAt, time.Duration(used)}
}

// count returns a quota's count at now and the instant its window ends
// (0, 0 when nothing is counted).
func (t *table) count(k bucketKey, now time.Duration) (int64, time.Duration) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.buckets[h]
	if !ok || b.fullAt <= now {
		return 0, 0
	}
	return int64(b.usedAt), b.fullAt
}

// uncount takes units off a quota's count, in the window that counted
// them, if it is still running at now.
func (t *table) uncount(k bucketKey, units int64, now time.Duration) {
	h := t.hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.buckets[h]
	if !ok || b.fullAt <= now {
		return
	}
	if used := int64(b.usedAt) - units; used > 0 {
		s.buckets[h] = bucket{b.fullAt, time.Duration(used)}
	} else {
		delete(s.buckets, h)
	}
}

// try decides c against a bucket full at fullAt.
func (c *charge) try(fullAt time.Duration) {
	c.fullAt, c.ok = c.l.take(fullAt, c.now, c.cost)
	c.ban = !c.ok && c.l.ban > 0 && !c.l.banned(c.l.debt(fullAt, c.now))
}

// takeAll charges every bucket or none: a request denied by one bucket
// spends nothing in the others. Shards are locked in one global order (by
// table), so concurrent multi-zone requests cannot deadlock. A denial that
// starts a ban is kept, in the bucket that denied. It fills in each
// charge's ok, ban and debt and reports whether all were allowed.
func takeAll(cs []charge) (allowed bool) {
	if len(cs) == 1 { // the common case, with one map lookup less
		c := &cs[0]
		s := c.t.shard(c.h)
		s.mu.Lock()
		b, tracked := s.buckets[c.h]
		if c.quota != nil {
			c.tryQuota(b, tracked, c.fullAt)
			if c.ok {
				s.setCount(c.t, c.h, c.fullAt, c.used, c.now)
			}
			s.mu.Unlock()
			return c.ok
		}
		c.try(b.fullAt)
		switch {
		case tracked:
			s.buckets[c.h] = bucket{c.fullAt, c.now}
		case c.ok || c.ban:
			s.insert(c.t, c.h, c.fullAt, c.now)
		}
		s.mu.Unlock()
		c.debt = c.l.debt(c.fullAt, c.now)
		return c.ok
	}
	sortCharges(cs)
	allowed = true
	for i := range cs {
		c := &cs[i]
		s := c.t.shard(c.h)
		s.mu.Lock()
		if c.quota != nil {
			b, tracked := s.buckets[c.h]
			c.tryQuota(b, tracked, c.fullAt)
		} else {
			c.try(s.get(c.h))
		}
		allowed = allowed && c.ok
	}
	for i := range cs {
		c := &cs[i]
		s := c.t.shard(c.h)
		if c.quota != nil {
			if allowed {
				s.setCount(c.t, c.h, c.fullAt, c.used, c.now)
			} else {
				c.uncharge()
			}
			s.mu.Unlock()
			continue
		}
		switch {
		case allowed || c.ban:
			s.set(c.t, c.h, c.fullAt, c.now)
		case c.ok:
			c.fullAt = c.l.clamp(s.get(c.h), c.now) // not charged after all
			s.touch(c.h, c.fullAt, c.now)
		default:
			s.touch(c.h, c.fullAt, c.now)
		}
		c.debt = c.l.debt(c.fullAt, c.now)
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
