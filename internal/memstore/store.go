// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"context"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A Store decides the demands of a handler's zones on tables in this
// process's memory: the local store's engine, and fail_mode local's.
type Store struct {
	zones []localZone // by zone index
}

// Tables gets the tables a store's zones use, shared with other
// configs (the local store module's pools).
type Tables interface {
	Buckets(id TableID, most time.Duration) (*Table[Bucket], error)
	Counters(id TableID) (*Table[Counter], error)
	Slots(name string) (*SlotTable, error)
}

// New is the engine of zones, on the tables ts gives.
func New(zones []store.ZoneSpec, ts Tables) (*Store, error) {
	s := &Store{zones: make([]localZone, len(zones))}
	for i, z := range zones {
		lz := &s.zones[i]
		var err error
		if z.Bucket {
			l := z.Shape
			lz.buckets, err = ts.Buckets(TableID{name: z.Name, tokenTime: l.TokenTime, burst: l.Burst}, l.Most())
			if err == nil && l.Burst != 0 {
				lz.buckets.base = l
			}
			lz.maxOv = z.MaxOverrides
		}
		if err == nil && z.Quota != "" {
			lz.counters, err = ts.Counters(TableID{name: z.Name, quota: z.Quota})
		}
		if err == nil && z.Slots {
			lz.slots, err = ts.Slots(z.Name)
		}
		if err != nil {
			return nil, err
		}
	}
	return s, nil
}

// A localZone is what the local store keeps for one zone.
type localZone struct {
	buckets  *Table[Bucket]  // nil: the zone has no bucket
	maxOv    int64           // the most overrides of its buckets (max_overrides)
	counters *Table[Counter] // nil: the zone has no calendar quota
	slots    *SlotTable      // nil: the zone does not limit requests in flight
}

// Take decides the demands on the zones' tables in one all-or-nothing
// step (see takeAll).
func (s *Store) Take(_ context.Context, now time.Time, d *store.Demands) (bool, error) {
	d.At = now
	if len(d.Buckets) == 1 && len(d.Counters)+len(d.Slots) == 0 {
		return s.takeOne(now, &d.Buckets[0]), nil // the common case
	}
	return s.takeAll(now, d), nil
}

// takeAll is take of several demands. It is a function of its own so
// that the common case's stack frame stays small: a request's goroutine
// grows its stack less often.
//
//go:noinline
func (s *Store) takeAll(now time.Time, d *store.Demands) bool {
	// Room for the usual few zones, on the stack; more spill.
	var cs []charge
	if len(d.Buckets) > 0 {
		var cbuf [2]charge
		cs = cbuf[:0]
	}
	var ks []count
	if len(d.Counters) > 0 {
		var kbuf [1]count
		ks = kbuf[:0]
	}
	var sl []slotClaim
	if len(d.Slots) > 0 {
		var sbuf [1]slotClaim
		sl = sbuf[:0]
	}
	for i := range d.Buckets {
		b := &d.Buckets[i]
		t := s.zones[b.Zone].buckets
		n := t.Instant(now)
		if b.Floor > 0 {
			raise(t, b.Key, b.Limit, n+b.Floor, n)
		}
		cs = append(cs, charge{l: b.Limit, cost: b.Cost, t: t, h: t.Hash(b.Key), now: n, req: i, soft: b.Soft})
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.Instant(now)
		ks = append(ks, count{t: t, h: t.Hash(c.Key), now: n, endAt: n + c.Window.End.Sub(now), limit: c.Limit, units: c.Cost, req: i, soft: c.Soft})
	}
	for i := range d.Slots {
		q := &d.Slots[i]
		sl = append(sl, slotClaim{t: s.zones[q.Zone].slots, key: q.Key, n: q.Limit, soft: q.Soft, req: i})
	}
	allowed := takeAll(cs, ks, sl)
	for i := range cs {
		b := &d.Buckets[cs[i].req]
		b.OK, b.Ban, b.Debt = cs[i].ok, cs[i].ban, cs[i].debt
		if cs[i].overridden {
			b.SetOwnLimit(cs[i].l.TokenTime, cs[i].l.Burst)
		}
	}
	for i := range ks {
		c := &d.Counters[ks[i].req]
		c.OK, c.Used, c.Left = ks[i].ok, ks[i].used, ks[i].left()
	}
	for i := range sl {
		q := &d.Slots[sl[i].req]
		q.Held, q.Free, q.Full = sl[i].held, sl[i].free, sl[i].full
	}
	return allowed
}

// takeOne is take of one bucket alone.
func (s *Store) takeOne(now time.Time, b *store.BucketDemand) bool {
	t := s.zones[b.Zone].buckets
	n := t.Instant(now)
	if b.Floor > 0 {
		raise(t, b.Key, b.Limit, n+b.Floor, n)
	}
	c := charge{l: b.Limit, cost: b.Cost, t: t, h: t.Hash(b.Key), now: n, soft: b.Soft}
	allowed := takeOne(&c)
	b.OK, b.Ban, b.Debt = c.ok, c.ban, c.debt
	if c.overridden {
		b.SetOwnLimit(c.l.TokenTime, c.l.Burst)
	}
	return allowed
}

func (s *Store) Adjust(_ context.Context, now time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		t := s.zones[b.Zone].buckets
		adjustBucket(t, b.Key, b.Limit, b.Cost, t.Instant(now))
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.Instant(now)
		adjustCounter(t, c.Key, c.Cost, n+c.Window.End.Sub(now), n)
	}
	return nil
}

func (s *Store) Release(_ context.Context, slots []store.SlotDemand) error {
	for i := range slots {
		if q := &slots[i]; q.Held {
			s.zones[q.Zone].slots.release(q.Key)
		}
	}
	return nil
}

func (s *Store) Peek(_ context.Context, now time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		t := s.zones[b.Zone].buckets
		fullAt, o, own := ownBucket(t, b.Key, now)
		if own {
			b.SetOwnLimit(o.TokenTime, o.Burst)
		}
		b.Debt = b.Limit.Debt(fullAt, t.Instant(now))
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.Instant(now)
		used, endAt := CountAt(t, c.Key, n)
		c.Used, c.Left = used, max(endAt-n, 0)
	}
	for i := range d.Slots {
		q := &d.Slots[i]
		q.Free = s.zones[q.Zone].slots.free(q.Key, q.Limit)
	}
	return nil
}

func (s *Store) Reset(_ context.Context, d *store.Demands) (bool, error) {
	found := false
	for i := range d.Buckets {
		t := s.zones[d.Buckets[i].Zone].buckets
		found = t.Forget(d.Buckets[i].Key).FullAt > t.Instant(time.Now()) || found
	}
	for i := range d.Counters {
		t := s.zones[d.Counters[i].Zone].counters
		found = !t.Forget(d.Counters[i].Key).Spent(t.Instant(time.Now())) || found
	}
	return found, nil
}

func (s *Store) SetOverride(_ context.Context, now time.Time, zone int, key store.Key, o store.Override) error {
	z := &s.zones[zone]
	return setOverride(z.buckets, key, o, z.maxOv, now)
}

func (s *Store) DeleteOverride(_ context.Context, now time.Time, zone int, key store.Key) (bool, error) {
	return deleteOverride(s.zones[zone].buckets, key, now), nil
}

func (s *Store) Override(_ context.Context, zone int, key store.Key) (store.Override, bool, error) {
	o, ok := overrideOf(s.zones[zone].buckets, key, time.Now())
	return o, ok, nil
}

func (s *Store) Overrides(_ context.Context, zone int) ([]store.KeyOverride, error) {
	return listOverrides(s.zones[zone].buckets, time.Now()), nil
}

func (s *Store) OverrideCount(_ context.Context, zone int) (int, error) {
	return countOverrides(s.zones[zone].buckets, time.Now()), nil
}

func (s *Store) Stats(zone int) store.ZoneStats {
	z := &s.zones[zone]
	n, e, c := 0, uint64(0), 0
	if z.buckets != nil {
		n, e, c = z.buckets.size(), z.buckets.evictions.Load(), z.buckets.capacity()
	}
	if z.counters != nil {
		n, e, c = n+z.counters.size(), e+z.counters.evictions.Load(), c+z.counters.capacity()
	}
	return store.ZoneStats{Keys: &n, Evictions: &e, Capacity: c, Table: *z}
}

// SlotsOf is the table of a zone's slots: nil for none.
func (s *Store) SlotsOf(zone int) *SlotTable { return s.zones[zone].slots }

var _ store.Store = (*Store)(nil)

// TableID is what a zone's table is shared by. A zone whose rate or
// burst changes starts with fresh buckets.
type TableID struct {
	name      string
	tokenTime time.Duration
	burst     int64
	// quota, for the table of a zone's calendar quota counters, is its
	// period and time zone (see store.ZoneSpec.Quota): its limit may change.
	quota string
}
