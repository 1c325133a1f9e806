// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"net/http"
)

// Zones with concurrency limit the requests of a key in flight: each
// request asks for a slot with its other demands (decide.go), and the
// store takes it with them, all or nothing; it is given back when the
// handlers after this one return, however they return. The local store
// counts slots in memory (slots.go), the Redis store keeps them as leases
// shared by every instance (lua/token_bucket.lua).

// slotRefusal is the slot demand of d that refused the request, a zone
// not in dry run with no slot free; -1 for none.
func slotRefusal(d *demands) int {
	for i := range d.slots {
		if d.slots[i].full && !d.slots[i].soft {
			return i
		}
	}
	return -1
}

// releaseSlots gives back the slots the request holds, in one call
// before the response is done, so that the client's next request finds
// its slot free. The client may have gone; a release that fails is
// covered by the lease.
func (h *Handler) releaseSlots(r *http.Request, sc *scratch) {
	held := false
	for i := range sc.d.slots {
		held = held || sc.d.slots[i].held
	}
	if !held || sc.by == nil {
		return
	}
	if err := sc.by.release(context.WithoutCancel(r.Context()), sc.d.slots); err != nil {
		h.refundErrors.Warn(h.logger, "rate limit: slots not given back: they come back when their lease ends", err)
	}
	for i := range sc.d.slots {
		sc.d.slots[i].held = false
	}
}
