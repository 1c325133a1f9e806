// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package memstore keeps zones' state in this process's memory: tables
// of buckets and of calendar quota counters (sharded maps from a keyed
// hash of the key), slot tables, the keys' own limits, snapshots of the
// tables in a storage, and the local store's engine, which decides a
// request's demands on them all or nothing. It knows nothing of HTTP,
// Caddy or the handler's zones: it is given ZoneSpecs and demands, and
// the tables shared across configs through Tables.
package memstore

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A Table holds one zone's state in memory: a map from a keyed 64-bit
// hash of the key to an entry (a bucket, or a calendar quota's counter),
// split into shards so that parallel requests rarely share a lock. Keys
// of any length cost the same eight bytes. Instants are durations since
// the table's epoch.
//
// At most maxKeys entries are kept, an equal share in each shard, so a
// table with many keys starts evicting a little before it holds maxKeys
// (at about 99.5% of a million); a table made with many shards whose
// maxKeys a reload lowers keeps at least 64 a shard (see minShardCap).
// When a shard is full, entries that carry
// nothing any more (a bucket that has refilled, a counter whose window
// has ended) are dropped first: no decision changes. If none has, the
// entry of the lowest rank among a few sampled is evicted and counted:
// for a bucket, the least recently used, as recency, not fullness, is
// what protects the limit (under a flood of one-off keys, a client that
// keeps sending is among the most recently used whatever its bucket's
// shape, while the flood's keys, each used once, age out first); for a
// counter, the smallest count, which forgives the least.
type Table[E Entry] struct {
	id      uint64      // orders locks when one request takes several tables
	epoch   time.Time   // instants in the shards count from here
	key     siphash.Key // keys the hashes: random, or the stored one of a persisted table
	maxKeys atomic.Int64
	shards  []shard[E] // a power of two of them
	mask    uint64     // len(shards) - 1

	evictions atomic.Uint64
	// base is the limit of a zone with a fixed limit (its buckets are
	// carried over eagerly when an override changes it); zero for a zone
	// whose limit comes with each request. overrides counts the keys'
	// own limits in the shards.
	base      gcra.Limit
	overrides atomic.Int64
	stop      chan struct{}
	stopOnce  sync.Once
	p         *persistence // nil: the table lives in memory only
}

// An Entry is what a table keeps per key.
type Entry interface {
	Bucket | Counter
	// spent reports whether the entry carries nothing at now: it can be
	// dropped without changing any decision.
	Spent(now time.Duration) bool
	// rank orders entries for eviction: the lowest goes first.
	rank() int64
}

type shard[E Entry] struct {
	mu sync.Mutex
	m  map[uint64]E
	// ov holds the keys' own limits (overrides) of a table of buckets,
	// by the same hash; nil until the first.
	ov map[uint64]localOverride
	// sweepCredit counts the inserts until a full shard may be swept
	// again, which keeps sweeping O(1) per insert.
	sweepCredit int
	_           [32]byte // keep shards on separate cache lines
}

// A Bucket is one tracked token bucket: the instant it is full again, the
// last instant a request used it, for eviction, and the whole-bucket time
// of the limit that wrote it (for a zone whose limit comes with each
// request: see limit.rescale).
type Bucket struct {
	FullAt time.Duration
	UsedAt time.Duration
	Full   time.Duration
}

func (b Bucket) Spent(now time.Duration) bool { return b.FullAt <= now }
func (b Bucket) rank() int64                  { return int64(b.UsedAt) }

// evictSample is how many entries are looked at to pick one to evict in
// a shard of more than exactBelow: a fraction of a microsecond, where a
// shard of a million keys' table holds 15625.
const (
	evictSample = 8
	exactBelow  = 1024
)

var tableIDs atomic.Uint64

// NewTable is an empty table for maxKeys entries, whose epoch is now.
func NewTable[E Entry](maxKeys int64, now time.Time) *Table[E] {
	n := 64
	if maxKeys < 64*64 {
		n = 1
	}
	t := &Table[E]{
		id:     tableIDs.Add(1),
		epoch:  now,
		key:    siphash.NewKey(),
		shards: make([]shard[E], n),
		mask:   uint64(n - 1),
		stop:   make(chan struct{}),
	}
	t.maxKeys.Store(maxKeys)
	for i := range t.shards {
		t.shards[i].m = make(map[uint64]E)
	}
	return t
}

// NewBuckets is a table of buckets.
func NewBuckets(maxKeys int64, now time.Time) *Table[Bucket] { return NewTable[Bucket](maxKeys, now) }

// Instant converts a clock reading to the table's own time line.
func (t *Table[E]) Instant(now time.Time) time.Duration { return now.Sub(t.epoch) }

// Hash is the keyed hash that stands for k in the table (store.Key.Hash
// under the table's key).
func (t *Table[E]) Hash(k store.Key) uint64 { return k.Hash(t.key) }

func (t *Table[E]) shard(h uint64) *shard[E] {
	return &t.shards[h&t.mask]
}

// SetMaxKeys sets the most entries the table keeps.
func (t *Table[E]) SetMaxKeys(n int64) { t.maxKeys.Store(n) }

// Update sets k's entry to what f makes of it, under its shard's lock: f
// gets the entry and whether it is tracked, and reports whether to write
// what it returns. now is the table instant, which tells the eviction
// what carries nothing.
func (t *Table[E]) Update(k store.Key, now time.Duration, f func(e E, tracked bool) (E, bool)) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, tracked := s.m[h]
	if e, write := f(e, tracked); write {
		s.set(t, h, e, now)
	}
}

// shardCap is how many entries one shard may hold.
func (t *Table[E]) shardCap() int {
	return max(int(t.maxKeys.Load())/len(t.shards), minShardCap(len(t.shards)))
}

// capacity is the most entries the table keeps: maxKeys, rounded down to
// a whole share per shard, or the shards' minimum when that is more.
func (t *Table[E]) capacity() int { return t.shardCap() * len(t.shards) }

// minShardCap is the fewest entries a shard of a table of n shards keeps:
// a table made with many shards (for max_keys of 4096 or more) whose
// max_keys a reload lowers keeps room for 64 entries a shard, so that
// each shard still holds enough for its eviction to tell clients apart.
func minShardCap(n int) int {
	if n == 1 {
		return 1
	}
	return 64
}

// insert records e for a key that is not tracked yet, making room first
// if the shard is full. Requires s.mu to be held.
func (s *shard[E]) insert(t *Table[E], h uint64, e E, now time.Duration) {
	if s.makeRoom(now, t.shardCap()) {
		t.evictions.Add(1)
	}
	s.sweepCredit--
	s.m[h] = e
}

// set records e, making room first if the key is new and the shard full.
// Requires s.mu to be held.
func (s *shard[E]) set(t *Table[E], h uint64, e E, now time.Duration) {
	if _, ok := s.m[h]; !ok {
		s.insert(t, h, e, now)
		return
	}
	s.m[h] = e
}

// makeRoom frees one place in a full shard. Requires s.mu to be held.
func (s *shard[E]) makeRoom(now time.Duration, capacity int) (evicted bool) {
	if len(s.m) < capacity {
		return false
	}
	if s.sweepCredit <= 0 {
		s.sweep(now)
		s.sweepCredit = max(capacity/8, 1)
		if len(s.m) < capacity {
			return false
		}
	}
	for len(s.m) >= capacity {
		victim, spent := s.victim(now)
		delete(s.m, victim)
		evicted = evicted || !spent
	}
	return evicted
}

// victim picks the entry to drop: a spent one, else the lowest ranked. A
// shard of up to exactBelow entries is looked at whole (its true least
// recently used goes, as a small table must keep a client that keeps
// sending); a larger one is sampled, two entries at each of four places
// where a range starts (random ones). Eight in a row would be neighbours
// in the map, and a map refills where it was emptied, so that the
// neighbours of a bucket used a moment ago can all be newer still and
// make it the oldest of them. Requires s.mu to be held.
func (s *shard[E]) victim(now time.Duration) (victim uint64, spent bool) {
	lowest := int64(math.MaxInt64)
	if len(s.m) <= exactBelow {
		for h, e := range s.m {
			if e.Spent(now) {
				return h, true
			}
			if r := e.rank(); r < lowest {
				victim, lowest = h, r
			}
		}
		return victim, false
	}
	for range evictSample / 2 {
		seen := 0
		for h, e := range s.m {
			if e.Spent(now) {
				return h, true
			}
			if r := e.rank(); r < lowest {
				victim, lowest = h, r
			}
			if seen++; seen == 2 {
				break
			}
		}
	}
	return victim, false
}

// sweep drops the entries that are spent at now. Requires s.mu to be
// held.
func (s *shard[E]) sweep(now time.Duration) {
	for h, e := range s.m {
		if e.Spent(now) {
			delete(s.m, h)
		}
	}
}

// Lookup returns k's entry, and whether it is tracked.
func (t *Table[E]) Lookup(k store.Key) (E, bool) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[h]
	return e, ok
}

// Forget drops k's entry, and returns it.
func (t *Table[E]) Forget(k store.Key) E {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.m[h]
	delete(s.m, h)
	return e
}

// Clear forgets every entry.
func (t *Table[E]) Clear() {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		clear(s.m)
		s.mu.Unlock()
	}
}

// sweepAll drops every spent entry of the table.
func (t *Table[E]) sweepAll(now time.Time) {
	n := t.Instant(now)
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		s.sweep(n)
		s.mu.Unlock()
	}
	if bt, ok := any(t).(*Table[Bucket]); ok {
		endOverrides(bt, n)
	}
}

// size is the number of entries tracked.
func (t *Table[E]) size() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}

// sweepEvery is how often idle tables drop spent entries, so that the
// map stays near the number of clients that are actually being limited.
const sweepEvery = time.Minute

func (t *Table[E]) SweepLoop() {
	tick := time.NewTicker(sweepEvery)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case now := <-tick.C:
			t.sweepAll(now)
		}
	}
}

// Destruct stops the sweeper and the table's persistence, once, when the
// last config using the table is gone: when the process is exiting, it
// saves the table's snapshot, else it deletes the snapshot it wrote (see
// closePersisted).
func (t *Table[E]) Destruct() error {
	t.stopOnce.Do(func() {
		close(t.stop)
		closePersisted(t, t.exiting())
	})
	return nil
}

// exiting reports whether the process is exiting, as the snapshots the
// table is persisted to tell.
func (t *Table[E]) exiting() bool {
	if t.p == nil {
		return false
	}
	sn := t.p.to.Load()
	return sn != nil && sn.Exiting != nil && sn.Exiting()
}

// BucketAt returns the instant k's bucket is full again, 0 if not
// tracked.
func BucketAt(t *Table[Bucket], k store.Key) time.Duration {
	b, _ := t.Lookup(k)
	return b.FullAt
}

// raise makes k's bucket of limit l full again no sooner than fullAt.
// now is the current table instant, which tells the eviction what has
// refilled.
func raise(t *Table[Bucket], k store.Key, l gcra.Limit, fullAt, now time.Duration) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.m[h]
	if fullAt > l.Rescale(b.FullAt, now, b.Full) {
		s.set(t, h, Bucket{fullAt, now, l.BurstTime}, now)
	}
}

// adjustBucket charges cost to k's bucket of limit l, refusing nothing
// (see limit.adjust). now is the current table instant.
func adjustBucket(t *Table[Bucket], k store.Key, l gcra.Limit, cost, now time.Duration) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.m[h]
	if !ok && cost <= 0 {
		return // full already
	}
	was := l.Rescale(b.FullAt, now, b.Full)
	switch fullAt := l.Adjust(was, now, cost); {
	case fullAt == b.FullAt:
	case fullAt <= now:
		delete(s.m, h) // full again
	default:
		s.set(t, h, Bucket{fullAt, now, l.BurstTime}, now)
	}
}

// A charge is one bucket a request takes tokens from, located in its
// table. The charges and counts of one request are in distinct tables
// (one per zone and kind).
type charge struct {
	l    gcra.Limit
	cost time.Duration // l.costTime(n)
	t    *Table[Bucket]
	h    uint64
	now  time.Duration // t.instant of the request
	req  int           // the demand this charge answers
	soft bool          // without the tokens, it refuses nothing (store.BucketDemand.Soft)

	fullAt time.Duration // the bucket's instant, with this charge if ok
	ok     bool
	ban    bool          // this refusal started a ban
	debt   time.Duration // how long until the bucket is full, after the decision
	// overridden: the key's own limit decided, in l and cost.
	overridden bool
}

// try decides c against a bucket b (tracked or not), on c's time line. A
// full bucket (most, among many keys) needs no rescaling, and b.full is
// not read.
func (c *charge) try(b Bucket) {
	fullAt := b.FullAt
	if fullAt > c.now {
		fullAt = c.l.Rescale(fullAt, c.now, b.Full)
	}
	c.fullAt, c.ok = c.l.Take(fullAt, c.now, c.cost)
	c.ban = !c.ok && c.l.StartsBan(c.l.Debt(fullAt, c.now), c.cost)
}

// entry is the bucket c leaves.
func (c *charge) entry() Bucket { return Bucket{c.fullAt, c.now, c.l.BurstTime} }

// commit writes what try decided, once every charge of the request is
// decided: the take when all allowed, a ban that started, and the
// recency of a bucket used. Requires the shard's lock to be held.
func (c *charge) commit(s *shard[Bucket], allowed bool) {
	switch b, tracked := s.m[c.h]; {
	case allowed || c.ban:
		s.set(c.t, c.h, c.entry(), c.now)
	case !tracked:
		c.fullAt = 0 // not charged after all, and full
	case c.ok:
		c.fullAt = c.l.Clamp(c.l.Rescale(b.FullAt, c.now, b.Full), c.now) // not charged after all
		s.m[c.h] = c.entry()
	default:
		s.m[c.h] = c.entry()
	}
	c.debt = c.l.Debt(c.fullAt, c.now)
}

// A slotClaim is a slot a request takes, located in its table.
type slotClaim struct {
	t    *SlotTable
	key  store.Key
	n    int64 // slots per key
	soft bool  // a key with no slot free does not refuse the request
	req  int   // the demand this claim answers

	held bool
	free int64
	full bool
}

// takeAll charges every bucket, counts in every counter and takes every
// slot, or does none of it: a request refused by one spends nothing in
// the others. A soft bucket or counter that lacks refuses nothing, and is
// charged nothing. Shards are locked in one global order (by table), so
// concurrent multi-zone requests cannot deadlock; the slots are taken
// once the buckets and counters allowed, before anything is written (a
// slot table's locks are taken one at a time, after the tables', and
// none is held while waiting for another). A refusal that starts a ban
// is kept, in the bucket that refused. It fills in the answers, and
// reports whether all were allowed.
func takeAll(cs []charge, ks []count, sl []slotClaim) bool {
	switch {
	case len(cs) == 1 && len(ks) == 0 && len(sl) == 0:
		return takeOne(&cs[0])
	case len(cs) == 0 && len(ks) == 1 && len(sl) == 0:
		return countOne(&ks[0])
	}
	var buf [4]lockRef
	locks := lockOrder(buf[:0], cs, ks)
	for _, l := range locks {
		l.mu.Lock()
	}
	allowed := true
	for i := range cs {
		c := &cs[i]
		s := c.t.shard(c.h)
		if len(s.ov) > 0 {
			c.applyOverride(s)
		}
		c.try(s.m[c.h])
		allowed = allowed && (c.ok || c.soft)
	}
	for i := range ks {
		k := &ks[i]
		e, tracked := k.t.shard(k.h).m[k.h]
		k.try(e, tracked)
		allowed = allowed && (k.ok || k.soft)
	}
	if allowed {
		allowed = claimAll(sl)
	}
	for i := range cs {
		cs[i].commit(cs[i].t.shard(cs[i].h), allowed && cs[i].ok)
	}
	for i := range ks {
		ks[i].commit(ks[i].t.shard(ks[i].h), allowed && ks[i].ok)
	}
	for _, l := range locks {
		l.mu.Unlock()
	}
	return allowed
}

// takeOne is takeAll of one charge, the common case, with a map lookup
// less.
func takeOne(c *charge) bool {
	s := c.t.shard(c.h)
	s.mu.Lock()
	if len(s.ov) > 0 {
		c.applyOverride(s)
	}
	b, tracked := s.m[c.h]
	c.try(b)
	switch {
	case tracked:
		s.m[c.h] = c.entry()
	case c.ok || c.ban:
		s.insert(c.t, c.h, c.entry(), c.now)
	}
	s.mu.Unlock()
	c.debt = c.l.Debt(c.fullAt, c.now)
	return c.ok || c.soft
}

// countOne is takeAll of one count alone.
func countOne(k *count) bool {
	s := k.t.shard(k.h)
	s.mu.Lock()
	e, tracked := s.m[k.h]
	k.try(e, tracked)
	k.commit(s, k.ok)
	s.mu.Unlock()
	return k.ok || k.soft
}

// claimAll takes a slot of every claim, or gives back those it took when
// one that is not soft has none free.
func claimAll(sl []slotClaim) bool {
	for i := range sl {
		q := &sl[i]
		q.free, q.held = q.t.acquire(q.key, q.n)
		if q.held {
			continue
		}
		q.full = true
		if q.soft {
			continue
		}
		for j := range i {
			if p := &sl[j]; p.held {
				p.t.release(p.key)
				p.held, p.free = false, p.free+1
			}
		}
		return false
	}
	return true
}

// A lockRef is a shard's lock, and the table it orders by.
type lockRef struct {
	id uint64
	mu *sync.Mutex
}

// lockOrder is the shard locks of a request's charges and counts in the
// global lock order: by table. Requests carry a few zones, so insertion
// sort is the fastest.
func lockOrder(locks []lockRef, cs []charge, ks []count) []lockRef {
	for i := range cs {
		locks = append(locks, lockRef{cs[i].t.id, &cs[i].t.shard(cs[i].h).mu})
	}
	for i := range ks {
		locks = append(locks, lockRef{ks[i].t.id, &ks[i].t.shard(ks[i].h).mu})
	}
	for i := 1; i < len(locks); i++ {
		for j := i; j > 0 && locks[j].id < locks[j-1].id; j-- {
			locks[j], locks[j-1] = locks[j-1], locks[j]
		}
	}
	return locks
}
