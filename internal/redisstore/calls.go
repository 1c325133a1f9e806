// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A window is a quota window and its boundaries as the script reads them.
type window struct {
	w    *calendar.Window
	args *rediswire.Window
}

// run calls the script for d, and sets d's answers: the buckets' debts
// and bans, the counters' counts and the slots' held, free and full,
// after the call.
func (s *Store) run(ctx context.Context, deadline time.Time, op rediswire.Op, d *store.Demands) (bool, error) {
	c := rediswire.NewCall(op, deadline)
	if s.opt.Clock != nil {
		c.Clock(s.opt.Clock())
	}
	s.build(c, op, d)
	sent := time.Now()
	r, err := s.client.Run(ctx, c)
	return s.answered(r, err, sent, op, d)
}

// answered sets d's answers from r, the reply of its call of op sent at
// sent, or returns err.
func (s *Store) answered(r rediswire.Reply, err error, sent time.Time, op rediswire.Op, d *store.Demands) (bool, error) {
	if err != nil {
		return false, err
	}
	d.At = s.client.DecidedAt(r, sent)
	if n := r.Repaired(); n > 0 && op != rediswire.Peek {
		s.repairs.Warn(s.opt.Logger, "redis store: keys under key_prefix held another type: overwritten",
			fmt.Errorf("%d in a call of zone %s", n, s.zones[callZone(d)].name))
	}
	read(r, op, d)
	return r.Allowed(), nil
}

// build adds d's demands to the call.
func (s *Store) build(c *rediswire.Call, op rediswire.Op, d *store.Demands) {
	for i := range d.Buckets {
		// The script applies the key's own limit itself: it is sent the
		// limit that an override replaces, and the cost in its tokens.
		b := &d.Buckets[i]
		var hash, field, limit string
		if s.mayOverride(b.Zone) {
			hash, field, limit = s.keys.BucketLimit(s.zones[b.Zone].field, b.Key.String())
		} else {
			hash, field = s.keys.Bucket(s.zones[b.Zone].field, b.Key.String())
			limit = hash // the script reads no override
		}
		if op == rediswire.Adjust {
			c.AdjustBucket(hash, field, limit, s.shapeOf(b, true), b.BaseCost())
		} else {
			c.Bucket(hash, field, limit, s.shapeOf(b, false), !b.Limit.NoDelay || b.Limit.Kept > 0, b.Soft)
		}
	}
	for i := range d.Counters {
		k := &d.Counters[i]
		rz := &s.zones[k.Zone]
		counter, untagged := s.counterKeys(k.Zone, k.Key)
		if op == rediswire.Adjust {
			c.AdjustCounter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.Window), k.Cost)
		} else {
			c.Counter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.Window), k.Soft)
		}
	}
	for i := range d.Slots {
		q := &d.Slots[i]
		c.Slot(s.slotKey(q.Zone, q.Key), q.Claim, s.slotShape(&s.zones[q.Zone], q))
	}
}

// callZone is the zone of a call's first demand.
func callZone(d *store.Demands) int {
	switch {
	case len(d.Buckets) > 0:
		return d.Buckets[0].Zone
	case len(d.Counters) > 0:
		return d.Counters[0].Zone
	}
	return d.Slots[0].Zone
}

// read sets d's answers from the reply of its call.
func read(r rediswire.Reply, op rediswire.Op, d *store.Demands) {
	allowed := r.Allowed()
	others := true // every bucket and counter had what the request takes
	for i := range d.Buckets {
		b := &d.Buckets[i]
		b.Debt, b.Ban = r.Bucket(i)
		if token, burst := r.Override(i); token > 0 {
			b.SetOwnLimit(token, burst)
		} else {
			b.ClearOwnLimit()
		}
		b.OK = allowed && !r.BucketShort(i) || !allowed && b.Wait() == 0
		others = others && (b.OK || b.Soft)
	}
	for j := range d.Counters {
		c := &d.Counters[j]
		used, left := r.Counter(j)
		c.Used, c.Left = used, 0
		if used > 0 {
			c.Left = left
		}
		c.OK = allowed && !r.CounterShort(j) || !allowed && used+c.Cost <= c.Limit
		others = others && (c.OK || c.Soft)
	}
	for j := range d.Slots {
		q := &d.Slots[j]
		q.Held, q.Free = r.Slot(j)
		q.Full = op == rediswire.Take && !q.Held && others && q.Free == 0
	}
}

// shapeOf is the script's shape of b's bucket: its zone's last one when
// the limit is the same, else one from the store's cache. An adjustment
// takes any shape of its bucket's limit: its cost travels on its own.
func (s *Store) shapeOf(b *store.BucketDemand, adjust bool) *rediswire.Shape {
	rz := &s.zones[b.Zone]
	l, cost := b.Limit, b.Cost
	if b.Overridden {
		l, cost = b.Base(), b.BaseCost()
	}
	if last := rz.shape.Load(); last != nil && last.Full == l.BurstTime && (adjust || last.Cost == cost) && last.Token == l.TokenTime &&
		last.Ban == l.Ban && last.Beyond == l.Delay+l.Owe && last.Reserve == l.Delay-l.Kept && last.Scaled == rz.plans {
		return last
	}
	if adjust {
		cost = l.TokenTime
	}
	shape := s.shapes.get(shapeKey{l.BurstTime, l.TokenTime, cost, l.Ban, l.Delay + l.Owe, l.Delay - l.Kept, rz.plans, rz.shares != nil})
	if !adjust {
		rz.shape.Store(shape)
	}
	return shape
}

// counterShape is the script's shape of k's counter.
func (s *Store) counterShape(rz *zoneState, k *store.CounterDemand) *rediswire.CounterShape {
	cost := max(k.Cost, -k.Cost)
	if last := rz.counter.Load(); last != nil && last.Limit == k.Limit && last.Cost == cost {
		return last
	}
	shape := rediswire.NewCounterShape(k.Limit, cost)
	rz.counter.Store(shape)
	return shape
}

// slotShape is the script's shape of q's slots.
func (s *Store) slotShape(rz *zoneState, q *store.SlotDemand) *rediswire.SlotShape {
	if last := rz.slots.Load(); last != nil && last.Limit == q.Limit && last.Lease == q.Lease && last.Soft == q.Soft {
		return last
	}
	shape := rediswire.NewSlotShape(q.Limit, q.Lease, q.Soft)
	rz.slots.Store(shape)
	return shape
}

// windowOf is the script's view of the quota window w, made once per
// window.
func (s *Store) windowOf(rz *zoneState, w *calendar.Window) *rediswire.Window {
	if last := rz.window.Load(); last != nil && last.w == w {
		return last.args
	}
	args := rediswire.NewWindow(w.Prev, w.Start, w.End, w.Next)
	rz.window.Store(&window{w, args})
	return args
}

// bucketField is how the fields of the buckets of a zone of shape l start
// (the zero limit for a zone whose limit comes with each request).
func bucketField(name string, l gcra.Limit) string {
	return rediswire.BucketField(name, strconv.FormatInt(int64(l.TokenTime), 10)+"/"+strconv.FormatInt(l.Burst, 10))
}

// bucketName is the hash and the field of the bucket of key in a zone.
func (s *Store) bucketName(zone int, key store.Key) (hash, field string) {
	return s.keys.Bucket(s.zones[zone].field, key.String())
}

// counterKeys are the key of the quota counter of key in a zone, and the
// key that builds before rediswire.CounterZone gave it.
func (s *Store) counterKeys(zone int, key store.Key) (counter, untagged string) {
	k := key.String()
	return s.keys.Counter(s.zones[zone].counters, k), s.keys.Counter(s.zones[zone].keys, k)
}

// slotKey is the key of the sorted set of the slots of key in a zone.
func (s *Store) slotKey(zone int, key store.Key) string {
	return s.keys.Slots(s.zones[zone].keys, key.String())
}

// A shapeCache keeps the shapes of the limits that requests bring
// (plans), each made once: at most maxShapes of them, beyond which a
// shape is made per call.
type shapeCache struct {
	m  atomic.Pointer[map[shapeKey]*rediswire.Shape]
	mu sync.Mutex
}

type shapeKey struct {
	full, token, cost, ban, beyond, reserve time.Duration
	scaled, shared                          bool // shared: of a zone with share
}

const maxShapes = 4096

func (c *shapeCache) get(k shapeKey) *rediswire.Shape {
	if m := c.m.Load(); m != nil {
		if s := (*m)[k]; s != nil {
			return s
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var m map[shapeKey]*rediswire.Shape
	if p := c.m.Load(); p != nil {
		m = *p
	}
	if s := m[k]; s != nil {
		return s
	}
	s := rediswire.NewShape(k.full, k.token, k.cost, k.ban, k.beyond, k.reserve, k.scaled)
	if k.shared {
		s = rediswire.NewSharedShape(k.full, k.token, k.cost)
	}
	if len(m) < maxShapes {
		next := make(map[shapeKey]*rediswire.Shape, len(m)+1)
		maps.Copy(next, m)
		next[k] = s
		c.m.Store(&next)
	}
	return s
}
