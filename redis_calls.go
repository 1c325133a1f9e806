// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

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
)

// A window is a quota window and its boundaries as the script reads them.
type window struct {
	w    *calendar.Window
	args *rediswire.Window
}

// run calls the script for d, and sets d's answers: the buckets' debts
// and bans, the counters' counts and the slots' held, free and full,
// after the call.
func (s *RedisStore) run(ctx context.Context, deadline time.Time, op rediswire.Op, d *demands) (bool, error) {
	c := rediswire.NewCall(op, deadline)
	if s.testClock != nil {
		c.Clock(s.testClock())
	}
	s.build(c, op, d)
	sent := time.Now()
	r, err := s.client.Run(ctx, c)
	return s.answered(r, err, sent, op, d)
}

// runAll decides each of ds by op, in order, in one flight of its own:
// the keys of each share a cluster slot (see oneTag).
func (s *RedisStore) runAll(op rediswire.Op, ds []*demands) ([]bool, []error) {
	deadline := time.Now().Add(s.callTimeout)
	calls := make([]*rediswire.Call, len(ds))
	for i, d := range ds {
		calls[i] = rediswire.NewCall(op, deadline)
		if s.testClock != nil {
			calls[i].Clock(s.testClock())
		}
		s.build(calls[i], op, d)
	}
	sent := time.Now()
	replies, errs := s.client.RunAll(calls)
	allowed := make([]bool, len(ds))
	for i, d := range ds {
		allowed[i], errs[i] = s.answered(replies[i], errs[i], sent, op, d)
	}
	return allowed, errs
}

// answered sets d's answers from r, the reply of its call of op sent at
// sent, or returns err.
func (s *RedisStore) answered(r rediswire.Reply, err error, sent time.Time, op rediswire.Op, d *demands) (bool, error) {
	if err != nil {
		return false, err
	}
	d.at = s.client.DecidedAt(r, sent)
	if n := r.Repaired(); n > 0 && op != rediswire.Peek {
		s.repairs.Warn(s.logger, "redis store: keys under key_prefix held another type: overwritten",
			fmt.Errorf("%d in a call of zone %s", n, s.zones[callZone(d)].name))
	}
	read(r, op, d)
	return r.Allowed(), nil
}

// build adds d's demands to the call.
func (s *RedisStore) build(c *rediswire.Call, op rediswire.Op, d *demands) {
	for i := range d.buckets {
		// The script applies the key's own limit itself: it is sent the
		// limit that an override replaces, and the cost in its tokens.
		b := &d.buckets[i]
		var hash, field, limit string
		if s.mayOverride(b.zone) {
			hash, field, limit = s.keys.BucketLimit(s.zones[b.zone].field, b.key.String())
		} else {
			hash, field = s.keys.Bucket(s.zones[b.zone].field, b.key.String())
			limit = hash // the script reads no override
		}
		if op == rediswire.Adjust {
			c.AdjustBucket(hash, field, limit, s.shapeOf(b, true), b.baseCost())
		} else {
			c.Bucket(hash, field, limit, s.shapeOf(b, false), !b.limit.NoDelay, b.soft)
		}
	}
	for i := range d.counters {
		k := &d.counters[i]
		rz := &s.zones[k.zone]
		counter, untagged := s.counterKeys(k.zone, k.key)
		if op == rediswire.Adjust {
			c.AdjustCounter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.window), k.cost)
		} else {
			c.Counter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.window), k.soft)
		}
	}
	for i := range d.slots {
		q := &d.slots[i]
		c.Slot(s.slotKey(q.zone, q.key), q.claim, s.slotShape(&s.zones[q.zone], q))
	}
}

// callZone is the zone of a call's first demand.
func callZone(d *demands) int {
	switch {
	case len(d.buckets) > 0:
		return d.buckets[0].zone
	case len(d.counters) > 0:
		return d.counters[0].zone
	}
	return d.slots[0].zone
}

// read sets d's answers from the reply of its call.
func read(r rediswire.Reply, op rediswire.Op, d *demands) {
	allowed := r.Allowed()
	others := true // every bucket and counter had what the request takes
	for i := range d.buckets {
		b := &d.buckets[i]
		b.debt, b.ban = r.Bucket(i)
		if token, burst := r.Override(i); token > 0 {
			b.setOwnLimit(token, burst)
		} else {
			b.clearOwnLimit()
		}
		b.ok = allowed && !r.BucketShort(i) || !allowed && b.wait() == 0
		others = others && (b.ok || b.soft)
	}
	for j := range d.counters {
		c := &d.counters[j]
		used, left := r.Counter(j)
		c.used, c.left = used, 0
		if used > 0 {
			c.left = left
		}
		c.ok = allowed && !r.CounterShort(j) || !allowed && used+c.cost <= c.limit
		others = others && (c.ok || c.soft)
	}
	for j := range d.slots {
		q := &d.slots[j]
		q.held, q.free = r.Slot(j)
		q.full = op == rediswire.Take && !q.held && others && q.free == 0
	}
}

// shapeOf is the script's shape of b's bucket: its zone's last one when
// the limit is the same, else one from the store's cache. An adjustment
// takes any shape of its bucket's limit: its cost travels on its own.
func (s *RedisStore) shapeOf(b *bucketDemand, adjust bool) *rediswire.Shape {
	rz := &s.zones[b.zone]
	l, cost := b.limit, b.cost
	if b.overridden {
		l, cost = b.base(), b.baseCost()
	}
	if last := rz.shape.Load(); last != nil && last.Full == l.BurstTime && (adjust || last.Cost == cost) && last.Token == l.TokenTime &&
		last.Ban == l.Ban && last.Beyond == l.Delay+l.Owe && last.Reserve == l.Delay && last.Scaled == rz.plans {
		return last
	}
	if adjust {
		cost = l.TokenTime
	}
	shape := s.shapes.get(shapeKey{l.BurstTime, l.TokenTime, cost, l.Ban, l.Delay + l.Owe, l.Delay, rz.plans})
	if !adjust {
		rz.shape.Store(shape)
	}
	return shape
}

// counterShape is the script's shape of k's counter.
func (s *RedisStore) counterShape(rz *redisZone, k *counterDemand) *rediswire.CounterShape {
	cost := max(k.cost, -k.cost)
	if last := rz.counter.Load(); last != nil && last.Limit == k.limit && last.Cost == cost {
		return last
	}
	shape := rediswire.NewCounterShape(k.limit, cost)
	rz.counter.Store(shape)
	return shape
}

// slotShape is the script's shape of q's slots.
func (s *RedisStore) slotShape(rz *redisZone, q *slotDemand) *rediswire.SlotShape {
	if last := rz.slots.Load(); last != nil && last.Limit == q.limit && last.Lease == q.lease && last.Soft == q.soft {
		return last
	}
	shape := rediswire.NewSlotShape(q.limit, q.lease, q.soft)
	rz.slots.Store(shape)
	return shape
}

// windowOf is the script's view of the quota window w, made once per
// window.
func (s *RedisStore) windowOf(rz *redisZone, w *calendar.Window) *rediswire.Window {
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
func (s *RedisStore) bucketName(zone int, key bucketKey) (hash, field string) {
	return s.keys.Bucket(s.zones[zone].field, key.String())
}

// counterKeys are the key of the quota counter of key in a zone, and the
// key that builds before rediswire.CounterZone gave it.
func (s *RedisStore) counterKeys(zone int, key bucketKey) (counter, untagged string) {
	k := key.String()
	return s.keys.Counter(s.zones[zone].counters, k), s.keys.Counter(s.zones[zone].keys, k)
}

// slotKey is the key of the sorted set of the slots of key in a zone.
func (s *RedisStore) slotKey(zone int, key bucketKey) string {
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
	scaled                                  bool
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
	if len(m) < maxShapes {
		next := make(map[shapeKey]*rediswire.Shape, len(m)+1)
		maps.Copy(next, m)
		next[k] = s
		c.m.Store(&next)
	}
	return s
}
