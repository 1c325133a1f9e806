// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// Zones with spill never refuse: a request over their limit goes on,
// marked, for a route to send to a fallback upstream. Their demands are
// soft, as a dry run's are (see store.BucketDemand.Soft): the store
// decides the request, in its one all-or-nothing take, without those
// that lack, and charges the others; the zone then says in the request's
// placeholders that it spilled it (decide.go's count and noteSpill).

// spillConfig lets a zone send on, marked, what it would refuse.
type spillConfig struct {
	// Never refuse: a request that this zone's bucket, quota or slots
	// cannot take goes on without taking anything from the zone, and
	// `{http.rate_limit.spilled}` names the zone
	// (`{http.rate_limit.<name>.spilled}` is true; false for a request
	// the zone took), so that a route can send it to a fallback upstream
	// (`@spilled vars {http.rate_limit.spilled} <name>`). The handler's
	// other zones refuse as they do. Counted as `spilled`, logged at
	// DEBUG. In dry run the zone spills nothing: it tells what it would
	// refuse, as any zone in dry run. Not with delay or concurrency
	// adaptive. Default: false.
	Spill bool `json:"spill,omitempty"`
}

var spillKind = kind{
	in: func(z *Zone) bool { return z.Spill },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"spill": func(d *caddyfile.Dispenser, z *Zone) error { return flag(d, &z.Spill) },
	},
	provision: func(z *Zone) error {
		z.spilledVar = "http.rate_limit." + z.Name + ".spilled"
		return nil
	},
	join: func(_ *Handler, z *Zone, st *zoneState) {
		if z.Spill {
			st.spillZone.Store(true)
		}
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if z.Spill {
			info.Spill = true
			info.Requests["spilled"] = z.state.spilled.Load()
		}
	},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, requests *prometheus.Desc, _ zoneID, s *zoneState) {
		if s.spillZone.Load() {
			counter(requests, &s.spilled, "spilled")
		}
	},
}

// spillCounts are what spill counts, in a zone's state.
type spillCounts struct {
	spilled   atomic.Uint64 // went on over the zone's limit
	spillZone atomic.Bool   // a zone of this name has spill: export spilled
}

// spillInfo is a zone's spill in the admin API.
type spillInfo struct {
	Spill bool `json:"spill,omitempty"`
}
