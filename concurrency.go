// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Zones with concurrency limit the requests of a key in flight: each
// request asks for a slot with its other demands (decide.go), and the
// store takes it with them, all or nothing; it is given back when the
// handlers after this one return, however they return. The local store
// counts slots in memory (internal/memstore), the Redis store keeps them as leases
// shared by every instance (lua/decide/60_slots.lua).

// concurrencyConfig is a zone's limit on requests in flight.
type concurrencyConfig struct {
	// The most requests of one key in flight at once: a request takes a
	// slot before it goes on, or is refused with 429 and `Retry-After: 1`,
	// and gives the slot back when the handlers after this one return,
	// however they return. A zone with concurrency needs no rate; with
	// both, both apply. With the Redis store, the slots are shared by
	// every instance (see `lease`). Not with quota. Default: no limit on
	// requests in flight.
	Concurrency int64 `json:"concurrency,omitempty"`

	// How long a slot of a zone with concurrency is held at most, in a
	// store shared between instances (Redis), where an instance that dies
	// cannot give its slots back: its slots come back when their leases
	// end. A lease is not renewed: a request that runs longer than its
	// lease loses its slot then (renewing would cost a timer and a Redis
	// write per request in flight, and keep the slots of an instance that
	// is stuck), so set it above the longest request. A duration. Unused
	// by the local store. Needs concurrency. Default: 60s.
	Lease caddy.Duration `json:"lease,omitempty"`
}

// concurrencyInfo is a zone's limit on requests in flight in the admin
// API, concurrencyKeyView a key's slots.
type (
	concurrencyInfo struct {
		// Requests in flight per key, and how long a Redis slot is held.
		Concurrency int64  `json:"concurrency,omitempty"`
		Lease       string `json:"lease,omitempty"`
	}
	concurrencyKeyView struct {
		Concurrency int64  `json:"concurrency,omitempty"`
		InFlight    *int64 `json:"in_flight,omitempty"` // slots held (leases not ended, in Redis)
		Free        *int64 `json:"free,omitempty"`
	}
)

var concurrencyKind = kind{
	in: func(z *Zone) bool { return z.Concurrency != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"concurrency": func(d *caddyfile.Dispenser, z *Zone) error {
			if adaptive, err := z.unmarshalAdaptive(d); adaptive || err != nil {
				return err
			}
			var err error
			if z.Concurrency, err = intArg[int64](d); err != nil {
				return err
			}
			return wrapErr(d, checkConcurrency(z.Concurrency))
		},
		"lease": durationSub("60s", func(z *Zone) *caddy.Duration { return &z.Lease }, checkLease),
	},
	check: func(z *Zone) error {
		if z.Concurrency != 0 {
			if err := checkConcurrency(z.Concurrency); err != nil {
				return err
			}
		}
		if z.Lease != 0 {
			if z.Concurrency == 0 {
				return errors.New("lease needs concurrency: it is how long a slot is held")
			}
			return checkLease(time.Duration(z.Lease))
		}
		return nil
	},
	provision: func(z *Zone) error {
		if z.Concurrency != 0 {
			z.Lease = cmp.Or(z.Lease, caddy.Duration(defaultLease))
			z.slotPolicy = fmt.Sprintf(`%s;q=%d;qu="concurrent-requests"`, z.quotedName, z.Concurrency)
		}
		return nil
	},
	describe: func(z *Zone) string {
		if z.Concurrency == 0 {
			return ""
		}
		return "concurrency " + strconv.FormatInt(z.Concurrency, 10)
	},
	info: func(z *Zone, stats store.ZoneStats, info *zoneInfo) {
		if z.Concurrency == 0 {
			return
		}
		info.Concurrency = z.Concurrency
		if stats.Client != nil {
			info.Lease = time.Duration(z.Lease).String()
		}
	},
	demand: func(z *Zone, k store.Key, d *store.Demands) {
		if z.Concurrency != 0 {
			d.Slots = append(d.Slots, store.SlotDemand{Zone: z.index, Key: k, Limit: z.Concurrency, Lease: time.Duration(z.Lease)})
		}
	},
	view: func(_ context.Context, _ *Handler, _ *Zone, _ store.Key, d *store.Demands, v *keyView) error {
		if len(d.Slots) > 0 {
			q := &d.Slots[0]
			inUse, free := q.Limit-q.Free, q.Free
			v.Concurrency, v.InFlight, v.Free = q.Limit, &inUse, &free
		}
		return nil
	},
}

func checkConcurrency(n int64) error {
	if n < 1 || n > maxBurst {
		return fmt.Errorf("invalid concurrency %d: must be 1 to %d", n, int64(maxBurst))
	}
	return nil
}

func checkLease(d time.Duration) error {
	if d <= 0 || d > gcra.MaxBurstTime {
		return fmt.Errorf("invalid lease %v: must be positive and at most 100 years", d)
	}
	return nil
}

// defaultLease is how long a Redis slot is held when lease is not set.
const defaultLease = 60 * time.Second

// limitsInFlight reports whether the zone limits requests in flight.
func (z *Zone) limitsInFlight() bool { return z.Concurrency != 0 || z.ConcurrencyAdaptive != nil }

// slotRefusal is the slot demand of d that refused the request, a zone
// not in dry run with no slot free; -1 for none.
func slotRefusal(d *store.Demands) int {
	for i := range d.Slots {
		if d.Slots[i].Full && !d.Slots[i].Soft {
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
	for i := range sc.d.Slots {
		held = held || sc.d.Slots[i].Held
	}
	if !held || sc.by == nil {
		return
	}
	if err := sc.by.Release(context.WithoutCancel(r.Context()), sc.d.Slots); err != nil {
		h.refundErrors.Warn(h.logger, "rate limit: slots not given back: they come back when their lease ends", err)
	}
	for i := range sc.d.Slots {
		sc.d.Slots[i].Held = false
	}
}
