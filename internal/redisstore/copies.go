// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

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

// A SyncID names the copies of a zone with sync that configs share: the
// stores of one connection setup, key prefix and hashing, whose zone of
// one name and shape syncs at one interval.
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
	shards   [syncShards]syncShard
	size     atomic.Int64

	mu    sync.Mutex
	users []syncUser // the stores that use it, newest last: the newest reconciles
	last  syncUser   // the last to leave: the final reconciliation's

	stop, done chan struct{}

	// What the reconciliations did, for the metrics: their script calls
	// (one per hash tag on a cluster), those that failed, and the keys
	// they carried.
	calls, failed, keys atomic.Uint64
	// visited counts the copies the reconciliations looked at: their
	// work, which follows the copies used, not those held.
	visited atomic.Uint64

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

// A syncShard is a part of a zone's copies, with its own lock.
type syncShard struct {
	mu sync.Mutex
	m  map[uint64]*syncCopy
	// used are the copies asked or spent since the last reconciliation,
	// each once: what the next one sends.
	used   []*syncCopy
	expiry syncQueue
	_      [56]byte // keep shards on separate cache lines
}

// use lists c for the next reconciliation, once. Requires sh.mu.
func (sh *syncShard) use(c *syncCopy) {
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
	c   *syncCopy
	due time.Duration
}

func (q *syncQueue) push(c *syncCopy, due time.Duration) {
	q.items = append(q.items, syncDue{c, due})
}

// pop takes the first copy whose check is due at n, or nil.
func (q *syncQueue) pop(n time.Duration) *syncCopy {
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

// A syncCopy is this instance's copy of one key's shared bucket. Its
// fields are its shard's, under its lock, but for the names.
type syncCopy struct {
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
	for i := range sz.shards {
		sz.shards[i].m = make(map[uint64]*syncCopy)
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

func (sz *SyncZone) instant(t time.Time) time.Duration { return t.Sub(sz.epoch) }

// keep is how long a copy that has nothing to send and whose bucket is
// full stays at least after Redis last answered for it (the sweep finds
// it within another keep): a key used again within it is decided here at
// once, within its allowance.
func (sz *SyncZone) keep() time.Duration { return max(syncKeep, 2*sz.interval) }

func (sz *SyncZone) shard(h uint64) *syncShard { return &sz.shards[h&(syncShards-1)] }

// lock locks the shard of k's copy, and returns it and k's hash.
func (sz *SyncZone) lock(k store.Key) (*syncShard, uint64) {
	h := k.Hash(sz.hashKey)
	sh := sz.shard(h)
	sh.mu.Lock()
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
func (sz *SyncZone) add(sh *syncShard, h uint64, s *Store, b *store.BucketDemand, n, floor time.Duration) *syncCopy {
	if sz.size.Load() >= maxSyncKeys {
		return nil
	}
	// Its allowance starts spent: the first interval's requests of a key
	// new here are Redis's but for what refills meanwhile, so that the
	// instances flooding a key from its first request spend no allowance
	// that Redis has not seen.
	c := &syncCopy{base: baseLimit(b), lim: baseLimit(b), fullAt: n + floor, allow: n + sz.interval, heard: n, key: h}
	c.hash, c.field, c.limitKey = s.keys.BucketLimit(s.zones[b.Zone].field, b.Key.String())
	sh.m[h] = c
	sh.expiry.push(c, n+sz.keep())
	sz.size.Add(1)
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
func (c *syncCopy) learnt(at, n, debt time.Duration, lim gcra.Limit, tokens int64) {
	c.lim = lim
	c.fullAt = min(max(at+debt, n)+time.Duration(tokens)*lim.TokenTime, n+lim.Most())
	c.heard, c.doubt = n, 0
}

// A SyncPool holds the copies of the zones with sync of every loaded
// config, by SyncID, so that a reload that keeps a zone keeps its copies
// (the Redis store module's pool).
type SyncPool interface {
	// Acquire gets the copies of id, made by newCopies when no config
	// has them; Release lets go of them.
	Acquire(id SyncID, newCopies func() *SyncZone) (*SyncZone, error)
	Release(id SyncID) error
}

// ownCopies is the SyncPool of a store given none: the copies of its
// zones with sync are its own, made when it binds them and stopped, after
// a last reconciliation, when it lets go of them.
type ownCopies map[SyncID]*SyncZone

func (p ownCopies) Acquire(id SyncID, newCopies func() *SyncZone) (*SyncZone, error) {
	if _, ok := p[id]; ok {
		return nil, fmt.Errorf("zone %s: its copies are held already", id.field)
	}
	sz := newCopies()
	p[id] = sz
	return sz, nil
}

func (p ownCopies) Release(id SyncID) error {
	sz := p[id]
	delete(p, id)
	return sz.Destruct()
}
