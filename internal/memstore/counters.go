// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A Counter is a calendar quota's count of one key in one window. Once
// its window has ended it carries nothing, as a full bucket.
type Counter struct {
	EndAt time.Duration // the instant its window ends
	Used  int64         // units counted in the window
}

func (c Counter) Spent(now time.Duration) bool { return c.EndAt <= now }
func (c Counter) rank() int64                  { return c.Used }

// NewCounters is a table of counters.
func NewCounters(maxKeys int64, now time.Time) *Table[Counter] {
	return NewTable[Counter](maxKeys, now)
}

// CountAt returns k's count at now and the instant its window ends (0, 0
// when nothing is counted).
func CountAt(t *Table[Counter], k store.Key, now time.Duration) (int64, time.Duration) {
	c, ok := t.Lookup(k)
	if !ok || c.Spent(now) {
		return 0, 0
	}
	return c.Used, c.EndAt
}

// adjustCounter counts units more in k's counter, refusing nothing: in
// the window it counts in while it runs, else in a new one that ends at
// endAt. Negative units take off, only in the window that counted them.
// now is the current table instant.
func adjustCounter(t *Table[Counter], k store.Key, units int64, endAt, now time.Duration) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.m[h]
	running := ok && !c.Spent(now)
	switch {
	case units > 0 && running:
		s.m[h] = Counter{c.EndAt, c.Used + units}
	case units > 0:
		s.set(t, h, Counter{endAt, units}, now)
	case !running:
	case c.Used+units > 0:
		s.m[h] = Counter{c.EndAt, c.Used + units}
	default:
		delete(s.m, h)
	}
}

// A count is one counter a request counts units in, located in its table.
type count struct {
	t     *Table[Counter]
	h     uint64
	now   time.Duration // t.instant of the request
	endAt time.Duration // the instant the current window ends, should a new one start
	limit int64
	units int64
	req   int  // the demand this count answers
	soft  bool // without the units, it refuses nothing (store.CounterDemand.Soft)

	ok   bool
	used int64 // the count after the decision
}

// try decides k against a counter c (tracked or not).
func (k *count) try(c Counter, tracked bool) {
	used := int64(0)
	if tracked && !c.Spent(k.now) {
		used, k.endAt = c.Used, c.EndAt
	}
	k.ok = used+k.units <= k.limit
	if k.ok {
		used += k.units
	}
	k.used = used
}

// commit writes what try counted, or, for a request refused elsewhere,
// undoes it. Requires the shard's lock to be held.
func (k *count) commit(s *shard[Counter], allowed bool) {
	switch {
	case allowed:
		s.set(k.t, k.h, Counter{k.endAt, k.used}, k.now)
	case k.ok:
		k.used -= k.units
	}
}

// left is how long until the counter's window ends, 0 while nothing is
// counted.
func (k *count) left() time.Duration {
	if k.used == 0 {
		return 0
	}
	return k.endAt - k.now
}
