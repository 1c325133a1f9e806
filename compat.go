// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
)

// Configs written for github.com/mholt/caddy-ratelimit load unchanged:
// its `rate_limits` map of zones, each with `window` and `max_events`
// (read as rate max_events/window with burst max_events) and its meaning
// of `key`; its `sweep_interval` is accepted and ignored, and its
// `distributed` and `storage` are refused with a pointer to the Redis
// store. This file holds what reads them.

// mergeRateLimits moves the zones of rate_limits into Zones, sorted by
// name. It is idempotent: Provision and Validate both call it.
func (h *Handler) mergeRateLimits() error {
	names := slices.Sorted(maps.Keys(h.RateLimits))
	for _, name := range names {
		z := h.RateLimits[name]
		if z == nil {
			return fmt.Errorf("rate_limits: zone %s is null", name)
		}
		if z.Name != "" && z.Name != name {
			return fmt.Errorf("rate_limits: zone %s has the name '%s': leave the name out, the key names it", name, z.Name)
		}
		if slices.ContainsFunc(h.Zones, func(o *Zone) bool { return o != nil && o.Name == name }) {
			return fmt.Errorf("zone %s is both in zones and in rate_limits", name)
		}
		z.Name = name
		h.Zones = append(h.Zones, z)
	}
	h.RateLimits = nil
	return nil
}

// windowForm reports whether the zone is written as caddy-ratelimit
// writes it, with window and max_events.
func (z *Zone) windowForm() bool { return z.Window != 0 || z.MaxEvents != 0 }

// windowLimit reads window and max_events as rate and burst.
func (z *Zone) windowLimit() (perSec float64, burst int64, err error) {
	switch {
	case z.Rate != "" || z.Burst != 0:
		return 0, 0, errors.New("use either rate and burst or window and max_events, not both")
	case z.Window <= 0:
		return 0, 0, fmt.Errorf("invalid window %s: must be a positive duration such as 1m", time.Duration(z.Window))
	case z.MaxEvents == 0:
		// caddy-ratelimit reads a missing max_events as 0 and refuses every
		// request of the zone: a limit nobody meant, or a block better said
		// with `error 429`.
		return 0, 0, errors.New("max_events is required with window, and at least 1 (a zone of 0 events would refuse every request: to do that, use the error directive)")
	}
	if err := cmp.Or(checkMin("max_events", z.MaxEvents, 1), checkBurst(z.MaxEvents)); err != nil {
		return 0, 0, err
	}
	perSec = float64(z.MaxEvents) / time.Duration(z.Window).Seconds()
	if perSec > gcra.MaxRate {
		return 0, 0, fmt.Errorf("%d events per %s is more than %.0fr/s", z.MaxEvents, time.Duration(z.Window), gcra.MaxRate)
	}
	return perSec, z.MaxEvents, nil
}
