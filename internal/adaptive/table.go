// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package adaptive

import (
	"hash/maphash"
	"sync"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
)

// A Key is the controller of one key, and its lock.
type Key struct {
	mu sync.Mutex
	c  controller
}

// A Change is a change of a key's limit by half or more since it
// was last logged.
type Change struct {
	From, To        int64
	Latency, NoLoad time.Duration
}

// Release gives back a place; it reports a large change of the limit.
func (k *Key) Release(now time.Time, t Ticket, kind Sample, lat time.Duration) (Change, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	c := &k.c
	if !c.done(now, t, kind, lat) || c.limit < 1.5*c.logged && c.limit > c.logged/1.5 {
		return Change{}, false
	}
	ch := Change{From: int64(c.logged), To: int64(c.limit), Latency: c.latency, NoLoad: c.noLoad}
	c.logged = c.limit
	return ch, true
}

// Admit takes a place in flight at now for a request of class (0 is the
// highest; a class beyond the table's is its lowest), if one is free
// under the class's part of the limit. Without classes, class is
// ignored.
func (k *Key) Admit(now time.Time, class int) (Ticket, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.c.admit(now, class)
}

// State is a key's state, for the admin API and the metrics.
type State struct {
	Limit, InFlight int64
	Latency, NoLoad time.Duration
	Probing         bool
}

// State is the key's state now.
func (k *Key) State() State {
	k.mu.Lock()
	defer k.mu.Unlock()
	c := &k.c
	return State{Limit: int64(c.limit), InFlight: c.inFlight, Latency: c.latency, NoLoad: c.noLoad, Probing: c.probing}
}

// InFlightByClass appends the key's requests in flight of each class,
// from the highest, to dst; nil without classes.
func (k *Key) InFlightByClass(dst []int64) []int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.c.classIn == nil {
		return dst
	}
	return append(dst, k.c.classIn...)
}

// Forget starts the key's learning again, from min; its requests in
// flight stay counted, by class too.
func (k *Key) Forget() {
	k.mu.Lock()
	defer k.mu.Unlock()
	c := &k.c
	fresh := newController(int64(c.min), int64(c.max), nil)
	fresh.inFlight, fresh.gen, fresh.probeN = c.inFlight, c.gen+1, c.probeN
	fresh.shares, fresh.classIn = c.shares, c.classIn
	*c = fresh
}

// A Table holds the keys of an adaptive limit (a zone shares its table
// with the zones of its name and limit, across reloads). It keeps at most
// adaptiveMaxKeys keys: a new key takes the place of the key idle for
// longest in its shard, and when every key of the shard has requests in
// flight, its request is shed.
type Table[K comparable] struct {
	seed     maphash.Seed
	Min, Max int64
	shares   []float64 // what each class may use of a limit; nil without classes
	shards   [adaptiveShards]adaptiveShard[K]
	Logged   throttle.Throttle // the INFO lines of large changes
}

const (
	adaptiveShards  = 16
	adaptiveMaxKeys = 16384
)

type adaptiveShard[K comparable] struct {
	mu sync.Mutex
	m  map[K]*Key
}

// NewTable is an empty table of keys whose limits lie in [min, max].
// With reserves, its keys' requests have classes, one more than the
// reserves: reserves[c] is the fraction of the limit held back for class
// c and the classes above it, from the highest (class 0) down; each lies
// in (0, 1), and together they leave the lowest class part of the limit
// (the caller checks both).
func NewTable[K comparable](min, max int64, reserves ...float64) *Table[K] {
	t := &Table[K]{seed: maphash.MakeSeed(), Min: min, Max: max}
	if len(reserves) > 0 {
		t.shares = make([]float64, len(reserves)+1)
		t.shares[0] = 1
		for i, r := range reserves {
			t.shares[i+1] = t.shares[i] - r
		}
	}
	for i := range t.shards {
		t.shards[i].m = make(map[K]*Key)
	}
	return t
}

// Classes is the number of classes of the table's requests: 1 without
// reserves.
func (t *Table[K]) Classes() int { return max(1, len(t.shares)) }

// Key finds k's state, or makes it; nil when the shard is full of keys
// with requests in flight.
func (t *Table[K]) Key(k K, now time.Time) *Key {
	s := &t.shards[maphash.Comparable(t.seed, k)%adaptiveShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.m[k]; a != nil {
		return a
	}
	if len(s.m) >= adaptiveMaxKeys/adaptiveShards && !s.evict() {
		return nil
	}
	a := &Key{c: newController(t.Min, t.Max, t.shares)}
	a.c.last = now
	s.m[k] = a
	return a
}

// evict drops the key idle for longest, and reports whether there was
// one.
func (s *adaptiveShard[K]) evict() bool {
	var oldest K
	var at time.Time
	found := false
	for k, a := range s.m {
		a.mu.Lock()
		idle, used := a.c.inFlight == 0, a.c.last
		a.mu.Unlock()
		if idle && (!found || used.Before(at)) {
			oldest, at, found = k, used, true
		}
	}
	if found {
		delete(s.m, oldest)
	}
	return found
}

// Lookup finds k's state, nil when the table has none.
func (t *Table[K]) Lookup(k K) *Key {
	s := &t.shards[maphash.Comparable(t.seed, k)%adaptiveShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[k]
}

// Totals sum up the keys of a table.
type Totals struct {
	Keys            int
	Limit, InFlight int64
	NoLoad          time.Duration // the mean of the keys that measured one
}

// Totals sums the limits and the requests in flight of every key.
func (t *Table[K]) Totals() Totals {
	var tot Totals
	var noLoad time.Duration
	measured := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for _, a := range s.m {
			st := a.State()
			tot.Keys++
			tot.Limit += st.Limit
			tot.InFlight += st.InFlight
			if st.NoLoad > 0 {
				noLoad += st.NoLoad
				measured++
			}
		}
		s.mu.Unlock()
	}
	if measured > 0 {
		tot.NoLoad = noLoad / time.Duration(measured)
	}
	return tot
}
