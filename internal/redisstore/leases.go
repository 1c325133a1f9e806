// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// leaseSeq numbers the leases this process takes.
var leaseSeq atomic.Uint64

// Release gives back the slots that Take took, in one call where their
// keys share a cluster slot. A slot whose release fails comes back when
// its lease ends.
func (s *Store) Release(ctx context.Context, slots []store.SlotDemand) error {
	if !s.client.Up() {
		return rediswire.ErrDown // the leases will end
	}
	held := 0
	for i := range slots {
		if slots[i].Held {
			held++
		}
	}
	if held == 0 {
		return nil
	}
	deadline := time.Now().Add(s.opt.CallTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if held == len(slots) && (!s.client.Cluster || oneTag(&store.Demands{Slots: slots})) {
		return s.releaseCall(ctx, deadline, slots)
	}
	var errs []error
	for i := range slots {
		if slots[i].Held {
			if err := s.releaseCall(ctx, deadline, slots[i:i+1]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// releaseCall gives back the slots in one call.
func (s *Store) releaseCall(ctx context.Context, deadline time.Time, slots []store.SlotDemand) error {
	c := rediswire.NewCall(rediswire.Release, deadline)
	for i := range slots {
		c.Slot(s.slotKey(slots[i].Zone, slots[i].Key), slots[i].Claim, nil)
	}
	_, err := s.client.Run(ctx, c)
	return err
}
