// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A localOverride is an override in a table's shard.
type localOverride struct {
	key store.Key
	o   store.Override
	// at is the table instant at which it ends; 0: never.
	at time.Duration
}

func (e *localOverride) ended(now time.Duration) bool { return e.at != 0 && e.at <= now }

// applyOverride puts the key's own limit, if it has one, in c: its shape
// and its cost. An override that has ended is removed, and the bucket
// goes back to the zone's limit. Requires the shard's lock.
func (c *charge) applyOverride(s *shard[Bucket]) {
	e, ok := s.ov[c.h]
	if !ok {
		return
	}
	if e.ended(c.now) {
		endOverride(c.t, s, c.h, c.now)
		return
	}
	c.cost = c.cost / c.l.TokenTime * e.o.TokenTime
	c.l = e.o.Limit(c.l)
	c.overridden = true
}

// retuneBucket carries the bucket of hash h over from limit from to limit
// to, in a table of a zone with a fixed limit (a zone with plans rescales
// its buckets as each request comes: see charge.try). Requires the
// shard's lock.
func retuneBucket(t *Table[Bucket], s *shard[Bucket], h uint64, from, to gcra.Limit, now time.Duration) {
	if t.base.BurstTime == 0 {
		return
	}
	b, ok := s.m[h]
	if !ok {
		return
	}
	b.FullAt, b.Full = to.Retune(b.FullAt, now, from), to.BurstTime
	s.m[h] = b
}

// endOverride removes the override of hash h, and carries its bucket back
// to the zone's limit. Requires the shard's lock.
//
// Until then, an override that has ended stays in the shard: in a zone
// with a fixed limit, its bucket is still on the time line of the limit
// that wrote it, and only the override says which limit that is. So it
// is carried back when the key's next request, a change of its limit or
// the sweep finds it, as the Redis store carries its bucket back at the
// key's next call; what reads the bucket meanwhile (ownBucket, the
// snapshot) reads it as carried back then.
func endOverride(t *Table[Bucket], s *shard[Bucket], h uint64, now time.Duration) {
	e := s.ov[h]
	delete(s.ov, h)
	t.overrides.Add(-1)
	retuneBucket(t, s, h, e.o.Limit(t.base), t.base, now)
}

// ownBucket is the instant k's bucket is full again under the limit k
// has at now, and k's own limit if it has one that has not ended. A
// bucket whose own limit has ended is read as carried back at now, as the
// key's next request would carry it back, and is not written.
func ownBucket(t *Table[Bucket], k store.Key, now time.Time) (time.Duration, store.Override, bool) {
	n := t.Instant(now)
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.m[h]
	e, ok := s.ov[h]
	switch {
	case !ok:
		return b.FullAt, store.Override{}, false
	case !e.ended(n):
		return b.FullAt, e.o, true
	case t.base.BurstTime == 0:
		return b.FullAt, store.Override{}, false // rescaled by the next request, as a change of plan
	}
	return t.base.Retune(b.FullAt, n, e.o.Limit(t.base)), store.Override{}, false
}

// setOverride gives k the override o, at most max in the table, carrying
// its bucket over to the new limit.
func setOverride(t *Table[Bucket], k store.Key, o store.Override, most int64, now time.Time) error {
	n := t.Instant(now)
	if t.overrides.Load() >= most {
		endOverrides(t, n)
	}
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	old, had := s.ov[h]
	if had && old.ended(n) {
		endOverride(t, s, h, n)
		had = false
	}
	if !had && t.overrides.Load() >= most {
		return store.ErrTooManyOverrides
	}
	from := t.base
	if had {
		from = old.o.Limit(t.base)
	}
	retuneBucket(t, s, h, from, o.Limit(t.base), n)
	e := localOverride{key: k, o: o}
	if !o.Expires.IsZero() {
		e.at = max(t.Instant(o.Expires), 1)
	}
	if s.ov == nil {
		s.ov = make(map[uint64]localOverride)
	}
	s.ov[h] = e
	if !had {
		t.overrides.Add(1)
	}
	return nil
}

// deleteOverride removes k's override, and reports whether it had one
// that had not ended.
func deleteOverride(t *Table[Bucket], k store.Key, now time.Time) bool {
	n := t.Instant(now)
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.ov[h]
	if !ok {
		return false
	}
	endOverride(t, s, h, n)
	return !e.ended(n)
}

// override is k's override, if it has one that has not ended.
func overrideOf(t *Table[Bucket], k store.Key, now time.Time) (store.Override, bool) {
	h := t.Hash(k)
	s := t.shard(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.ov[h]
	if !ok || e.ended(t.Instant(now)) {
		return store.Override{}, false
	}
	return e.o, true
}

// listOverrides lists the overrides that have not ended.
func listOverrides(t *Table[Bucket], now time.Time) []store.KeyOverride {
	out := []store.KeyOverride{}
	liveOverrides(t, now, func(e *localOverride) { out = append(out, store.KeyOverride{Key: e.key.String(), Override: e.o}) })
	return out
}

// countOverrides counts the overrides that have not ended: those that
// have, until their buckets are carried back (see endOverride), are no
// key's own limit any more, and leave room under max_overrides.
func countOverrides(t *Table[Bucket], now time.Time) int {
	n := 0
	if t.overrides.Load() > 0 {
		liveOverrides(t, now, func(*localOverride) { n++ })
	}
	return n
}

// liveOverrides calls f with each override that has not ended, under its
// shard's lock.
func liveOverrides(t *Table[Bucket], now time.Time, f func(*localOverride)) {
	n := t.Instant(now)
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for _, e := range s.ov {
			if !e.ended(n) {
				f(&e)
			}
		}
		s.mu.Unlock()
	}
}

// endOverrides removes the overrides that have ended by now.
func endOverrides(t *Table[Bucket], now time.Duration) {
	if t.overrides.Load() == 0 {
		return
	}
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for h, e := range s.ov {
			if e.ended(now) {
				endOverride(t, s, h, now)
			}
		}
		s.mu.Unlock()
	}
}
