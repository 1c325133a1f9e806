// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// decide asks Redis. Demands whose keys share a hash tag go in one atomic
// call. On a cluster, keys in different slots are taken one at a time,
// and when one refuses, the buckets and counters already charged get
// their tokens back, and the slots already taken are given back.
func (s *Store) decide(ctx context.Context, deadline time.Time, d *store.Demands) (bool, error) {
	if !s.client.Cluster || oneTag(d) {
		return s.run(ctx, deadline, rediswire.Take, d)
	}
	var one store.Demands
	for i := range d.Buckets {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, d.Buckets[i:i+1], nil, nil)); !ok || err != nil {
			notAsked(d.Buckets[i+1:], d.Counters)
			return false, s.undo(ctx, deadline, err, d.Buckets[:i], nil, nil, d.Slots)
		}
	}
	for i := range d.Counters {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, d.Counters[i:i+1], nil)); !ok || err != nil {
			notAsked(nil, d.Counters[i+1:])
			return false, s.undo(ctx, deadline, err, d.Buckets, d.Counters[:i], nil, d.Slots)
		}
	}
	for i := range d.Slots {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, nil, d.Slots[i:i+1])); !ok || err != nil {
			return false, s.undo(ctx, deadline, err, d.Buckets, d.Counters, d.Slots[:i], d.Slots[i+1:])
		}
	}
	return true, nil
}

// notAsked answers the buckets and counters that a refusal before them
// left unasked: they refused nothing.
func notAsked(b []store.BucketDemand, c []store.CounterDemand) {
	for i := range b {
		b[i].OK, b[i].Debt = true, 0
	}
	for i := range c {
		c[i].OK, c[i].Used, c[i].Left = true, 0, 0
	}
}

// part is one as the demands of the given parts.
func part(one *store.Demands, b []store.BucketDemand, c []store.CounterDemand, sl []store.SlotDemand) *store.Demands {
	one.Buckets, one.Counters, one.Slots = b, c, sl
	return one
}

// undo gives back what the demands taken one call each took, after the
// call of another failed with err (or refused: err nil): the tokens of
// b and c, the slots of taken; the slots not asked are left unheld.
func (s *Store) undo(ctx context.Context, deadline time.Time, err error, b []store.BucketDemand, c []store.CounterDemand, taken, notAsked []store.SlotDemand) error {
	// A soft demand that lacked was charged nothing: it gets nothing back.
	var backB []store.BucketDemand
	var backC []store.CounterDemand
	for i := range b {
		if b[i].OK {
			backB = append(backB, b[i])
			backB[len(backB)-1].Cost = -b[i].Cost
		}
	}
	for i := range c {
		if c[i].OK {
			backC = append(backC, c[i])
			backC[len(backC)-1].Cost = -c[i].Cost
		}
	}
	if len(backB)+len(backC) > 0 {
		if rerr := s.adjustApart(ctx, backB, backC); rerr != nil {
			err = errors.Join(err, fmt.Errorf("refund: %w", rerr))
		}
		// Each now owes what its refund left.
		j := 0
		for i := range b {
			if b[i].OK {
				b[i].Debt, j = backB[j].Debt, j+1
			}
		}
		j = 0
		for i := range c {
			if c[i].OK {
				c[i].Used, c[i].Left, j = backC[j].Used, backC[j].Left, j+1
			}
		}
	}
	if len(taken) > 0 {
		if rerr := s.Release(ctx, taken); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release: %w", rerr))
		}
		for i := range taken {
			taken[i].Held, taken[i].Free = false, taken[i].Free+1
		}
	}
	for i := range notAsked {
		notAsked[i].Held, notAsked[i].Free = false, 0
	}
	return err
}

// adjustApart adjusts each bucket and counter in a call of its own: their
// keys are in different cluster slots.
func (s *Store) adjustApart(ctx context.Context, b []store.BucketDemand, c []store.CounterDemand) error {
	var errs []error
	var one store.Demands
	for i := range b {
		if err := s.adjustEach(ctx, part(&one, b[i:i+1], nil, nil)); err != nil {
			errs = append(errs, err)
		}
	}
	for i := range c {
		if err := s.adjustEach(ctx, part(&one, nil, c[i:i+1], nil)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// adjustEach sends one adjustment call for d. The client may have gone:
// the adjustment is made all the same.
func (s *Store) adjustEach(ctx context.Context, d *store.Demands) error {
	deadline := time.Now().Add(s.opt.CallTimeout)
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	_, err := s.run(ctx, deadline, rediswire.Adjust, d)
	return err
}

// oneTag reports whether all of d's keys share one hash tag, so one
// cluster slot.
func oneTag(d *store.Demands) bool {
	var first store.Key
	switch {
	case len(d.Buckets) > 0:
		first = d.Buckets[0].Key
	case len(d.Counters) > 0:
		first = d.Counters[0].Key
	case len(d.Slots) > 0:
		first = d.Slots[0].Key
	}
	for i := range d.Buckets {
		if d.Buckets[i].Key != first {
			return false
		}
	}
	for i := range d.Counters {
		if d.Counters[i].Key != first {
			return false
		}
	}
	for i := range d.Slots {
		if d.Slots[i].Key != first {
			return false
		}
	}
	return true
}
