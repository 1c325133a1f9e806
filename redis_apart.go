// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
)

// decide asks Redis. Demands whose keys share a hash tag go in one atomic
// call. On a cluster, keys in different slots are taken one at a time,
// and when one refuses, the buckets and counters already charged get
// their tokens back, and the slots already taken are given back.
func (s *RedisStore) decide(ctx context.Context, deadline time.Time, d *demands) (bool, error) {
	if !s.client.Cluster || oneTag(d) {
		return s.run(ctx, deadline, rediswire.Take, d)
	}
	var one demands
	for i := range d.buckets {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, d.buckets[i:i+1], nil, nil)); !ok || err != nil {
			notAsked(d.buckets[i+1:], d.counters)
			return false, s.undo(ctx, deadline, err, d.buckets[:i], nil, nil, d.slots)
		}
	}
	for i := range d.counters {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, d.counters[i:i+1], nil)); !ok || err != nil {
			notAsked(nil, d.counters[i+1:])
			return false, s.undo(ctx, deadline, err, d.buckets, d.counters[:i], nil, d.slots)
		}
	}
	for i := range d.slots {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, nil, d.slots[i:i+1])); !ok || err != nil {
			return false, s.undo(ctx, deadline, err, d.buckets, d.counters, d.slots[:i], d.slots[i+1:])
		}
	}
	return true, nil
}

// notAsked answers the buckets and counters that a refusal before them
// left unasked: they refused nothing.
func notAsked(b []bucketDemand, c []counterDemand) {
	for i := range b {
		b[i].ok, b[i].debt = true, 0
	}
	for i := range c {
		c[i].ok, c[i].used, c[i].left = true, 0, 0
	}
}

// part is one as the demands of the given parts.
func part(one *demands, b []bucketDemand, c []counterDemand, sl []slotDemand) *demands {
	one.buckets, one.counters, one.slots = b, c, sl
	return one
}

// undo gives back what the demands taken one call each took, after the
// call of another failed with err (or refused: err nil): the tokens of
// b and c, the slots of taken; the slots not asked are left unheld.
func (s *RedisStore) undo(ctx context.Context, deadline time.Time, err error, b []bucketDemand, c []counterDemand, taken, notAsked []slotDemand) error {
	// A soft demand that lacked was charged nothing: it gets nothing back.
	var backB []bucketDemand
	var backC []counterDemand
	for i := range b {
		if b[i].ok {
			backB = append(backB, b[i])
			backB[len(backB)-1].cost = -b[i].cost
		}
	}
	for i := range c {
		if c[i].ok {
			backC = append(backC, c[i])
			backC[len(backC)-1].cost = -c[i].cost
		}
	}
	if len(backB)+len(backC) > 0 {
		if rerr := s.adjustApart(ctx, backB, backC); rerr != nil {
			err = errors.Join(err, fmt.Errorf("refund: %w", rerr))
		}
		// Each now owes what its refund left.
		j := 0
		for i := range b {
			if b[i].ok {
				b[i].debt, j = backB[j].debt, j+1
			}
		}
		j = 0
		for i := range c {
			if c[i].ok {
				c[i].used, c[i].left, j = backC[j].used, backC[j].left, j+1
			}
		}
	}
	if len(taken) > 0 {
		if rerr := s.release(ctx, taken); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release: %w", rerr))
		}
		for i := range taken {
			taken[i].held, taken[i].free = false, taken[i].free+1
		}
	}
	for i := range notAsked {
		notAsked[i].held, notAsked[i].free = false, 0
	}
	return err
}

// adjustApart adjusts each bucket and counter in a call of its own: their
// keys are in different cluster slots.
func (s *RedisStore) adjustApart(ctx context.Context, b []bucketDemand, c []counterDemand) error {
	var errs []error
	var one demands
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
func (s *RedisStore) adjustEach(ctx context.Context, d *demands) error {
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	_, err := s.run(ctx, deadline, rediswire.Adjust, d)
	return err
}

// oneTag reports whether all of d's keys share one hash tag, so one
// cluster slot.
func oneTag(d *demands) bool {
	var first bucketKey
	switch {
	case len(d.buckets) > 0:
		first = d.buckets[0].key
	case len(d.counters) > 0:
		first = d.counters[0].key
	case len(d.slots) > 0:
		first = d.slots[0].key
	}
	for i := range d.buckets {
		if d.buckets[i].key != first {
			return false
		}
	}
	for i := range d.counters {
		if d.counters[i].key != first {
			return false
		}
	}
	for i := range d.slots {
		if d.slots[i].key != first {
			return false
		}
	}
	return true
}
