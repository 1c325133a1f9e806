// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(LocalStore{})
}

// LocalStore keeps buckets in this process's memory. It is the default
// store: one Caddy instance needs nothing else.
//
// Buckets survive config reloads for every zone whose name, rate and
// burst are unchanged, and restarts through Caddy's storage (see
// `persist`). Memory is bounded by `max_keys` per zone; a tracked key
// costs about 84 bytes whatever its length.
type LocalStore struct {
	// The most buckets kept per zone. When a zone is full, buckets that
	// have refilled are dropped first, which changes no decision; if none
	// has, the least recently used is evicted (its client gets a full
	// bucket back) and counted: exactly in a zone of up to 1024 keys,
	// among a few sampled in a larger one. A zone first loaded with 4096
	// or more, whose max_keys a reload lowers, keeps up to 4096 until
	// Caddy restarts. Default: 1000000.
	MaxKeys int64 `json:"max_keys,omitempty"`

	// Keep the buckets across restarts, in Caddy's storage (where
	// certificates are kept): they are written when Caddy exits and
	// every persist_interval, and loaded when it starts. Default: true.
	Persist *bool `json:"persist,omitempty"`

	// How often the buckets are written: how much of them a crash can
	// lose. A duration, at least 100ms. Default: 30s.
	PersistInterval caddy.Duration `json:"persist_interval,omitempty"`

	zones    []localZone // by zone index
	acquired []any       // the keys of what it acquired in localTables and localSlots
	snaps    *snapshots  // where the tables are persisted; nil: they are not
}

// A localZone is what the local store keeps for one zone.
type localZone struct {
	buckets  *table[bucket]  // nil: the zone has no bucket
	maxOv    int64           // the most overrides of its buckets (max_overrides)
	counters *table[counter] // nil: the zone has no calendar quota
	slots    *slotTable      // nil: the zone does not limit requests in flight
}

const defaultMaxKeys = 1_000_000

// localTables holds the tables of every zone of every loaded config, so
// that a reload which keeps a zone keeps its buckets and counters: the
// new config acquires a table before the old one releases it.
var localTables = caddy.NewUsagePool()

// localSlots holds the slot tables of the zones with concurrency, by
// zone name: across a reload, the new config counts the old one's
// requests still running, which give their slots back to the same table.
var localSlots = caddy.NewUsagePool()

// tableID is what a zone's table is shared by. A zone whose rate or
// burst changes starts with fresh buckets.
type tableID struct {
	name      string
	tokenTime time.Duration
	burst     int64
	// quota, for the table of a zone's calendar quota counters, is its
	// period and time zone (see zoneSpec.quota): its limit may change.
	quota string
}

// A slotsID names a zone's slot table in localSlots.
type slotsID string

// CaddyModule returns the Caddy module information.
func (LocalStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.local",
		New: func() caddy.Module { return new(LocalStore) },
	}
}

// Provision sets defaults, and finds where the buckets are persisted.
func (s *LocalStore) Provision(ctx caddy.Context) error {
	if s.MaxKeys == 0 {
		s.MaxKeys = defaultMaxKeys
	}
	if s.PersistInterval == 0 {
		s.PersistInterval = caddy.Duration(defaultPersistInterval)
	}
	if err := s.Validate(); err != nil {
		return err
	}
	if s.Persist == nil || *s.Persist {
		s.snaps = openSnapshots(ctx, time.Duration(s.PersistInterval))
	}
	return nil
}

// Validate checks the configuration.
func (s *LocalStore) Validate() error {
	if s.MaxKeys != 0 {
		if err := checkMin("max_keys", s.MaxKeys, 1); err != nil {
			return err
		}
	}
	if s.PersistInterval != 0 {
		return checkPersistInterval(time.Duration(s.PersistInterval))
	}
	return nil
}

func checkPersistInterval(d time.Duration) error {
	if d < minPersistInterval {
		return fmt.Errorf("invalid persist_interval %v: must be at least %v", d, minPersistInterval)
	}
	return nil
}

func (s *LocalStore) Bind(zones []store.ZoneSpec) error {
	if len(s.zones) > 0 {
		return errors.New("local store is already in use by another handler")
	}
	s.zones = make([]localZone, len(zones))
	for i, z := range zones {
		lz := &s.zones[i]
		var err error
		if z.Bucket {
			l := z.Shape
			lz.buckets, err = acquireTable[bucket](s, tableID{name: z.Name, tokenTime: l.TokenTime, burst: l.Burst}, l.Most())
			if err == nil && l.Burst != 0 {
				lz.buckets.base = l
			}
			lz.maxOv = z.MaxOverrides
		}
		if err == nil && z.Quota != "" {
			lz.counters, err = acquireTable[counter](s, tableID{name: z.Name, quota: z.Quota}, 0)
		}
		if err == nil && z.Slots {
			lz.slots, err = s.acquireSlots(z.Name)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// acquireTable gets the table of id, shared with the other configs that
// use it; most is the longest one of its buckets may owe.
func acquireTable[E entry](s *LocalStore, id tableID, most time.Duration) (*table[E], error) {
	v, _, err := localTables.LoadOrNew(id, func() (caddy.Destructor, error) {
		t := newTable[E](s.MaxKeys, time.Now())
		go t.sweepLoop()
		if s.snaps != nil {
			t.key = s.snaps.key
			t.persist(s.snaps, id, most)
		}
		return t, nil
	})
	if err != nil {
		return nil, err
	}
	s.acquired = append(s.acquired, id)
	t := v.(*table[E])
	t.maxKeys.Store(s.MaxKeys)
	// The config that uses the table last says where it is kept; a
	// store that was not provisioned (fail_mode local's fallback)
	// has no say.
	if s.snaps != nil || s.Persist != nil && !*s.Persist {
		t.rebind(s.snaps)
	}
	return t, nil
}

// acquireSlots gets the slot table of the zone named name.
func (s *LocalStore) acquireSlots(name string) (*slotTable, error) {
	v, _, err := localSlots.LoadOrNew(slotsID(name), func() (caddy.Destructor, error) {
		return newSlotTable(s.MaxKeys), nil
	})
	if err != nil {
		return nil, err
	}
	s.acquired = append(s.acquired, slotsID(name))
	t := v.(*slotTable)
	t.maxKeys.Store(s.MaxKeys)
	return t, nil
}

// Cleanup releases the tables, which stop when no config uses them.
func (s *LocalStore) Cleanup() error {
	var errs []error
	for _, id := range s.acquired {
		pool := localTables
		if _, ok := id.(slotsID); ok {
			pool = localSlots
		}
		if _, err := pool.Delete(id); err != nil {
			errs = append(errs, err)
		}
	}
	s.acquired = nil
	return errors.Join(errs...)
}

// take decides the demands on the zones' tables in one all-or-nothing
// step (see takeAll).
func (s *LocalStore) Take(_ context.Context, now time.Time, d *store.Demands) (bool, error) {
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
func (s *LocalStore) takeAll(now time.Time, d *store.Demands) bool {
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
		n := t.instant(now)
		if b.Floor > 0 {
			raise(t, b.Key, b.Limit, n+b.Floor, n)
		}
		cs = append(cs, charge{l: b.Limit, cost: b.Cost, t: t, h: t.hash(b.Key), now: n, req: i, soft: b.Soft})
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.instant(now)
		ks = append(ks, count{t: t, h: t.hash(c.Key), now: n, endAt: n + c.Window.End.Sub(now), limit: c.Limit, units: c.Cost, req: i, soft: c.Soft})
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
func (s *LocalStore) takeOne(now time.Time, b *store.BucketDemand) bool {
	t := s.zones[b.Zone].buckets
	n := t.instant(now)
	if b.Floor > 0 {
		raise(t, b.Key, b.Limit, n+b.Floor, n)
	}
	c := charge{l: b.Limit, cost: b.Cost, t: t, h: t.hash(b.Key), now: n, soft: b.Soft}
	allowed := takeOne(&c)
	b.OK, b.Ban, b.Debt = c.ok, c.ban, c.debt
	if c.overridden {
		b.SetOwnLimit(c.l.TokenTime, c.l.Burst)
	}
	return allowed
}

func (s *LocalStore) Adjust(_ context.Context, now time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		t := s.zones[b.Zone].buckets
		adjustBucket(t, b.Key, b.Limit, b.Cost, t.instant(now))
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.instant(now)
		adjustCounter(t, c.Key, c.Cost, n+c.Window.End.Sub(now), n)
	}
	return nil
}

func (s *LocalStore) Release(_ context.Context, slots []store.SlotDemand) error {
	for i := range slots {
		if q := &slots[i]; q.Held {
			s.zones[q.Zone].slots.release(q.Key)
		}
	}
	return nil
}

func (s *LocalStore) Peek(_ context.Context, now time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		t := s.zones[b.Zone].buckets
		fullAt, o, own := ownBucket(t, b.Key, now)
		if own {
			b.SetOwnLimit(o.TokenTime, o.Burst)
		}
		b.Debt = b.Limit.Debt(fullAt, t.instant(now))
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		t := s.zones[c.Zone].counters
		n := t.instant(now)
		used, endAt := countAt(t, c.Key, n)
		c.Used, c.Left = used, max(endAt-n, 0)
	}
	for i := range d.Slots {
		q := &d.Slots[i]
		q.Free = s.zones[q.Zone].slots.free(q.Key, q.Limit)
	}
	return nil
}

func (s *LocalStore) Reset(_ context.Context, d *store.Demands) (bool, error) {
	found := false
	for i := range d.Buckets {
		t := s.zones[d.Buckets[i].Zone].buckets
		found = t.forget(d.Buckets[i].Key).fullAt > t.instant(time.Now()) || found
	}
	for i := range d.Counters {
		t := s.zones[d.Counters[i].Zone].counters
		found = !t.forget(d.Counters[i].Key).spent(t.instant(time.Now())) || found
	}
	return found, nil
}

func (s *LocalStore) SetOverride(_ context.Context, now time.Time, zone int, key store.Key, o store.Override) error {
	z := &s.zones[zone]
	return setOverride(z.buckets, key, o, z.maxOv, now)
}

func (s *LocalStore) DeleteOverride(_ context.Context, now time.Time, zone int, key store.Key) (bool, error) {
	return deleteOverride(s.zones[zone].buckets, key, now), nil
}

func (s *LocalStore) Override(_ context.Context, zone int, key store.Key) (store.Override, bool, error) {
	o, ok := overrideOf(s.zones[zone].buckets, key, time.Now())
	return o, ok, nil
}

func (s *LocalStore) Overrides(_ context.Context, zone int) ([]store.KeyOverride, error) {
	return listOverrides(s.zones[zone].buckets, time.Now()), nil
}

func (s *LocalStore) OverrideCount(_ context.Context, zone int) (int, error) {
	return countOverrides(s.zones[zone].buckets, time.Now()), nil
}

func (s *LocalStore) Stats(zone int) store.ZoneStats {
	z := &s.zones[zone]
	n, e, c := 0, uint64(0), 0
	if z.buckets != nil {
		n, e, c = z.buckets.len(), z.buckets.evictions.Load(), z.buckets.capacity()
	}
	if z.counters != nil {
		n, e, c = n+z.counters.len(), e+z.counters.evictions.Load(), c+z.counters.capacity()
	}
	return store.ZoneStats{Keys: &n, Evictions: &e, Capacity: c, Table: *z}
}

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	store local {
//		max_keys         <n>
//		persist          on|off
//		persist_interval <duration>
//	}
func (s *LocalStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume store name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "max_keys":
			if s.MaxKeys != 0 {
				return d.Err("max_keys already specified")
			}
			n, err := intArg[int64](d)
			if err != nil {
				return err
			}
			if err := checkMin("max_keys", n, 1); err != nil {
				return d.WrapErr(err)
			}
			s.MaxKeys = n
		case "persist":
			if s.Persist != nil {
				return d.Err("persist already specified")
			}
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			if v != "on" && v != "off" {
				return d.Errf("invalid persist '%s': expected on or off", v)
			}
			on := v == "on"
			s.Persist = &on
		case "persist_interval":
			if s.PersistInterval != 0 {
				return d.Err("persist_interval already specified")
			}
			dur, err := durationArg(d, "30s")
			if err != nil {
				return err
			}
			if err := checkPersistInterval(dur); err != nil {
				return d.WrapErr(err)
			}
			s.PersistInterval = caddy.Duration(dur)
		default:
			return d.Errf("unrecognized store local subdirective '%s'", d.Val())
		}
	}
	if s.Persist != nil && !*s.Persist && s.PersistInterval != 0 {
		return d.Err("persist_interval set with persist off: remove one of them")
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner     = (*LocalStore)(nil)
	_ caddy.Validator       = (*LocalStore)(nil)
	_ caddy.CleanerUpper    = (*LocalStore)(nil)
	_ caddyfile.Unmarshaler = (*LocalStore)(nil)
	_ store.Store           = (*LocalStore)(nil)
)
