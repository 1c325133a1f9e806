// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package redisstore is the Redis store's engine: it decides a
// request's demands in Redis, a flight of requests in one script call
// (internal/rediswire), with an over-limit cache that refuses what Redis
// has shown cannot be allowed yet, calls apart where a cluster splits a
// request's keys, leases for slots, the keys' own limits, and the copies
// of zones with sync and their reconciliation. It knows nothing of HTTP,
// Caddy or the handler's zones: its module makes it with New, from the
// client, its config (Options, with the pool it shares across reloads)
// and ZoneSpecs.
package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"go.uber.org/zap"
)

// A Store decides the demands of a handler's zones in Redis, one script
// call a flight. New makes it.
type Store struct {
	opt    Options
	client *rediswire.Client
	// users counts what keeps the client from being given back: the
	// store's maker until it drops the store (its module's config, until
	// its Cleanup), and each request that holds the store (see
	// store.Holder). The last to let go gives it back.
	users     atomic.Int64
	keys      rediswire.Keys
	zones     []zoneState        // by zone index
	shapes    *shapeCache        // the shapes of limits that come with requests (plans)
	leaseIDs  string             // what this store's lease IDs start with: unique among instances
	flights   *flights           // calls in flight for the buckets in the over-limit cache
	syncIDs   []SyncID           // the copies of the zones with sync it holds (copies.go)
	shares    bool               // a zone has share (share.go)
	leave     func()             // ends its use of the client (see Client.Join)
	keyErrors *throttle.Throttle // errors that Redis answered for one call's keys
	repairs   *throttle.Throttle // keys of another type that the script overwrote
}

// Options are a store's config, as its module gives it.
type Options struct {
	// FailMode decides a request when Redis cannot: local, open or closed
	// (see store.FailModes).
	FailMode string
	// DisableOverLimitCache has Redis asked about every request (see
	// fromCache).
	DisableOverLimitCache bool
	// KeyPrefix starts every key the store writes; HashKeys hashes the
	// keys' text before it is written (see rediswire.Keys).
	KeyPrefix string
	HashKeys  bool
	// CallTimeout is the longest a decision waits for Redis, after which
	// fail_mode decides it. It must be positive.
	CallTimeout time.Duration
	// Setup names the client's connection setup: the stores of one setup
	// share the copies of their zones with sync (see SyncID).
	Setup string
	// SyncPool holds the copies of the zones with sync across reloads.
	// nil: the store's copies are its own, made by New and stopped when
	// the store's last user lets go of it.
	SyncPool SyncPool
	// GiveBack gives the client back to its pool when the store's last
	// user lets go of it. nil: nothing is given back.
	GiveBack func() error
	// Logger says what the store finds of Redis: outages, refusals, keys
	// it repaired. nil: nothing is said.
	Logger *zap.Logger
	// Clock, in tests, replaces Redis's clock, so that a table of
	// instants can be replayed. nil: Redis's clock.
	Clock func() time.Time
}

// New is the engine of zones on client (a demand's zone is its place in
// zones), ready to decide. It has one user, its caller, who lets go of it
// with Drop. On error, what New acquired is given back, but not the
// client: it stays the caller's.
func New(client *rediswire.Client, zones []store.ZoneSpec, opt Options) (*Store, error) {
	if opt.CallTimeout <= 0 {
		return nil, fmt.Errorf("redis store: call timeout %v: must be positive", opt.CallTimeout)
	}
	if opt.Logger == nil {
		opt.Logger = zap.NewNop()
	}
	if opt.GiveBack == nil {
		opt.GiveBack = func() error { return nil }
	}
	if opt.SyncPool == nil {
		opt.SyncPool = make(ownCopies)
	}
	s := &Store{opt: opt, client: client}
	s.users.Store(1)
	if err := s.bind(zones); err != nil {
		s.users.Store(0)
		return nil, errors.Join(err, s.release())
	}
	return s, nil
}

// A zoneState is what the store keeps for one zone.
type zoneState struct {
	name  string
	field string // how its buckets' fields start: the name and a tag of the shape (rediswire.BucketField)
	keys  string // how its slots' keys start after the hash: the name (rediswire.ZoneField)
	// counters is how its quota counters' keys start after the hash: the
	// name and a tag of the quota's window (rediswire.CounterZone). Keys
	// start with keys alone in builds before the tag: such a counter is
	// read while the tagged one is absent (see lua/decide/50_counters.lua).
	counters string
	refunds  bool // its buckets may be given tokens back
	plans    bool // its limit comes with each request: its buckets are scaled
	// The shapes of its demands as the script reads them, the last ones
	// asked for: a zone whose limit is fixed asks for the same each time.
	shape   atomic.Pointer[rediswire.Shape]
	counter atomic.Pointer[rediswire.CounterShape]
	slots   atomic.Pointer[rediswire.SlotShape]
	window  atomic.Pointer[window]           // the quota window last sent
	cache   *memstore.Table[memstore.Bucket] // over-limit cache; nil when disabled
	learned learnedOverrides                 // the keys' own limits Redis's answers told the cache
	// maxOverrides is the most keys with their own limit (max_overrides).
	maxOverrides int64
	// overridden is how many keys of the zone have their own limit, as
	// Redis said when last asked; polled lest it is stale (see
	// mayOverride).
	overridden     atomic.Pointer[countedOverrides]
	overriddenPoll atomic.Int64 // when it was last polled, in nanoseconds of the process's clock
	// overriddenGen counts the times the zone's first override was
	// found: a call sent before then, without reading overrides, teaches
	// the over-limit cache nothing.
	overriddenGen atomic.Uint64
	counts        *memstore.Table[memstore.Counter] // the quota counts Redis last gave (see fromCache); nil without a quota or the cache
	copies        *SyncZone                         // this instance's copies of its buckets (see sync.go); nil without sync
	shares        *shareZone                        // this instance's shares of its buckets (see share.go); nil without share
}

// overLimitCacheKeys bounds the over-limit cache of each zone. It holds
// only the keys that recently ran out of tokens, and losing an entry only
// costs a call to Redis.
const overLimitCacheKeys = 100_000

// Hold keeps the client for a request, unless the store let go of it
// already.
func (s *Store) Hold() bool {
	for {
		n := s.users.Load()
		if n == 0 {
			return false
		}
		if s.users.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Done ends a request's hold.
func (s *Store) Done() {
	if err := s.Drop(); err != nil {
		s.opt.Logger.Error("rate limit: redis client not given back", zap.Error(err))
	}
}

// Drop drops one user of the client; the last gives it back to the pool.
func (s *Store) Drop() error {
	if s.users.Add(-1) != 0 {
		return nil
	}
	return errors.Join(s.release(), s.opt.GiveBack())
}

// release gives back what bind acquired: the copies of the zones with
// sync first, as their last reconciliation needs the client, then the
// store's place among the client's users.
func (s *Store) release() error {
	s.releaseShares()
	err := s.releaseSync()
	if s.leave != nil {
		s.leave()
	}
	return err
}

// bind makes the store's state for zones: the keys' names, the
// over-limit cache, the copies of the zones with sync.
func (s *Store) bind(zones []store.ZoneSpec) error {
	s.flights = &flights{m: make(map[flightKey]flight)}
	s.keys = rediswire.Keys{Prefix: s.opt.KeyPrefix, Hash: s.opt.HashKeys}
	s.shapes, s.keyErrors, s.repairs = new(shapeCache), new(throttle.Throttle), new(throttle.Throttle)
	var id [9]byte
	_, _ = rand.Read(id[:])
	s.leaseIDs = base64.RawURLEncoding.EncodeToString(id[:]) + ":"
	s.zones = make([]zoneState, len(zones))
	var asking []string // the zones that ask Redis
	for _, z := range zones {
		if z.Bucket || z.Quota != "" || z.Slots {
			asking = append(asking, z.Name)
		}
	}
	if len(asking) > 0 {
		s.leave = s.client.Join(s.opt.Logger, s.opt.FailMode, asking)
	}
	for i, z := range zones {
		rz := &s.zones[i]
		rz.name, rz.keys, rz.refunds, rz.maxOverrides = z.Name, rediswire.ZoneField(z.Name), z.Refunds, z.MaxOverrides
		// A bucket's state is its zone's name and shape, as a local
		// table's is (tableID).
		rz.field = bucketField(z.Name, z.Shape)
		if z.Quota != "" {
			rz.counters = rediswire.CounterZone(z.Name, z.Quota)
		}
		// Not known yet, and asked at the first decision.
		rz.overridden.Store(&countedOverrides{n: -1, at: math.MinInt64 / 2})
		rz.overriddenPoll.Store(math.MinInt64 / 2)
		rz.plans = z.Bucket && z.Shape.Burst == 0
		if !s.opt.DisableOverLimitCache {
			rz.cache = memstore.NewBuckets(overLimitCacheKeys, time.Now())
			if z.Quota != "" {
				rz.counts = memstore.NewCounters(overLimitCacheKeys, time.Now())
			}
		}
		// A store whose zones ask Redis something asks it at load
		// whether it runs scripts, so that a refusal is said then rather
		// than at the first request; one whose zones ask nothing (an
		// adaptive limit alone) never calls Redis.
		if z.Bucket || z.Quota != "" || z.Slots {
			s.client.Check(s.opt.Logger, s.opt.CallTimeout)
		}
	}
	s.bindShares(zones)
	return s.bindSync(zones)
}

func (s *Store) FailureMode() store.FailMode { return store.FailModes[s.opt.FailMode] }

// Known is what the over-limit cache knows of b's bucket. When the
// request gave up waiting for the calls in flight for its bucket
// (errNoAnswer), those calls may yet take their tokens: they count too.
func (s *Store) Known(now time.Time, b *store.BucketDemand, err error) time.Duration {
	if sz := s.zones[b.Zone].shares; sz != nil {
		sh, e := sz.lock(b.Key, false)
		defer sh.mu.Unlock()
		if e == nil {
			return 0
		}
		return e.lastDebt(now)
	}
	t := s.zones[b.Zone].cache
	if t == nil {
		return 0
	}
	debt := b.Limit.Debt(memstore.BucketAt(t, b.Key), t.Instant(now))
	if errors.Is(err, errNoAnswer) && b.Cost > 0 {
		// No more than the bucket may owe, which a take clamps it to
		// anyway: the calls' costs could pass a time.Duration.
		n, most := s.flights.calls(flightKey{b.Zone, t.Hash(b.Key)}), b.Limit.Most()
		if n > int64((most-debt)/b.Cost) {
			return most
		}
		debt += time.Duration(n) * b.Cost
	}
	return debt
}

// Take decides d: from this instance's copies, for zones with sync (see
// takeSync), else in Redis.
func (s *Store) Take(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	if s.shares && s.shared(d) {
		return s.takeShared(ctx, now, d)
	}
	if len(s.syncIDs) > 0 && s.synced(d) {
		return s.takeSync(ctx, now, d)
	}
	return s.takeExact(ctx, now, d)
}

// takeExact decides d in one call where their keys share a cluster slot.
// Each slot taken is a lease (see lua/decide/60_slots.lua): a member of a
// sorted set whose score is the instant, on Redis's clock, when it ends.
// A lease is not renewed: a request that runs longer than its zone's
// lease loses its slot then, so that a slot held by an instance that died
// comes back after the lease however it died, with no timers or writes
// for the requests in flight. Demands the over-limit cache can refuse
// are refused without asking Redis.
func (s *Store) takeExact(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	if len(d.Slots) > 0 {
		id := s.leaseIDs + strconv.FormatUint(leaseSeq.Add(1), 36)
		for i := range d.Slots {
			d.Slots[i].Claim = id
		}
	}
	// One timeout for the whole decision: a request that waits for the
	// calls in flight for its buckets has that much less for its own.
	budget := s.opt.CallTimeout
	var flight flightKey
	cached := !s.opt.DisableOverLimitCache && len(d.Buckets)+len(d.Counters) > 0
	if cached {
		arrived := now
		var decided, allowed bool
		var err error
		if now, flight, decided, allowed, err = s.fromCache(ctx, now, d); decided || err != nil {
			return allowed && err == nil, err
		}
		defer s.flights.land(flight)
		budget -= now.Sub(arrived)
	}
	gen := s.overriddenGen(d)
	allowed, err := s.ask(ctx, budget, d)
	if err == nil && cached && s.overriddenGen(d) == gen {
		s.remember(now, d, flight)
	}
	return allowed, err
}

// ask has Redis decide d within budget, and tells the breaker what the
// call said of Redis.
func (s *Store) ask(ctx context.Context, budget time.Duration, d *store.Demands) (bool, error) {
	waited := budget < s.opt.CallTimeout
	if !s.client.Up() {
		return false, rediswire.ErrDown
	}
	// The pipeline times the call; a request that waited for others'
	// calls brings a timer of its own (see the pipeline's run).
	deadline := time.Now().Add(budget)
	call := ctx
	if waited {
		var cancel context.CancelFunc
		call, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	sent := deadline.Add(-budget)
	allowed, err := s.decide(call, deadline, d)
	late := !time.Now().Before(deadline)
	if err == nil {
		s.client.NoteRTT(time.Since(sent))
	}
	s.tell(ctx, err, waited && late)
	if err != nil {
		for i := range d.Slots {
			d.Slots[i].Held, d.Slots[i].Free = false, 0
		}
	}
	return allowed, err
}

// tell tells the breaker what a call that failed with err (nil: it was
// answered) said of Redis. short: the call had only what was left of the
// timeout, and ran out of it.
func (s *Store) tell(ctx context.Context, err error, short bool) {
	switch kind := rediswire.Classify(err); {
	case err == nil || kind == rediswire.Answered:
		s.client.Answered(s.opt.Logger)
		if err != nil {
			s.keyErrors.Warn(s.opt.Logger, "redis refused one decision: fail_mode decides that request", err)
		}
	case ctx.Err() != nil || kind == rediswire.Unknown || short:
		// The client went away, a reload closed this config's
		// connections, the pool had no connection free, or a call that
		// had only what was left of the timeout ran out of it: nothing
		// is known of Redis.
	default:
		s.client.Failed(s.opt.Logger, err)
	}
}

// Adjust charges the demands' costs, in one call where their keys share
// a slot, and makes this instance's over-limit cache forget them (other
// instances' caches do not deny a zone whose buckets get tokens back,
// but for a ban, which a refund never shortens).
func (s *Store) Adjust(ctx context.Context, _ time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		if t := s.zones[d.Buckets[i].Zone].cache; t != nil {
			t.Forget(d.Buckets[i].Key)
		}
	}
	for i := range d.Counters {
		if t := s.zones[d.Counters[i].Zone].counts; t != nil {
			t.Forget(d.Counters[i].Key)
		}
	}
	if !s.client.Up() {
		return rediswire.ErrDown
	}
	if s.shares && s.shared(d) {
		if err := s.adjustShared(ctx, d); err != nil || d.Empty() {
			return err
		}
	}
	if !s.client.Cluster || oneTag(d) {
		return s.adjustEach(ctx, d)
	}
	return s.adjustApart(ctx, d.Buckets, d.Counters)
}

func (s *Store) Peek(ctx context.Context, _ time.Time, d *store.Demands) error {
	deadline := time.Now().Add(s.opt.CallTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	_, err := s.run(ctx, deadline, rediswire.Peek, d)
	if err == nil && len(s.syncIDs) > 0 {
		s.peekSync(d)
	}
	return err
}

// Reset deletes the buckets and counters, and what this instance's
// over-limit cache and copies knew of them. Other instances' caches
// learn it when their entry runs out, until then they may still deny
// those keys; their copies, at their next reconciliation.
func (s *Store) Reset(ctx context.Context, d *store.Demands) (bool, error) {
	if len(s.syncIDs) > 0 {
		s.forgetSync(d)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opt.CallTimeout)
	defer cancel()
	found := false
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if t := s.zones[b.Zone].cache; t != nil {
			t.Forget(b.Key)
		}
		hash, field := s.bucketName(b.Zone, b.Key)
		n, err := s.client.HDel(ctx, hash, field).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		if t := s.zones[c.Zone].counts; t != nil {
			t.Forget(c.Key)
		}
		// The untagged key too: it would be read in the tagged one's place.
		counter, untagged := s.counterKeys(c.Zone, c.Key)
		n, err := s.client.Del(ctx, counter, untagged).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	return found, nil
}

func (s *Store) Stats(zone int) store.ZoneStats {
	st := store.ZoneStats{OverLimitCache: !s.opt.DisableOverLimitCache, Client: s.client, Unavailable: !s.client.Up()}
	if sz := s.zones[zone].shares; sz != nil {
		sz.stats(&st)
	}
	if sz := s.zones[zone].copies; sz != nil {
		st.SyncCopies = sz
		st.SyncCalls, st.SyncFailed, st.SyncKeys, st.SyncHeld = sz.calls.Load(), sz.failed.Load(), sz.keys.Load(), sz.size.Load()
	}
	return st
}

var (
	_ store.Store    = (*Store)(nil)
	_ store.Sharer   = (*Store)(nil)
	_ store.Fallible = (*Store)(nil)
	_ store.Holder   = (*Store)(nil)
)
