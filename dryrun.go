// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/http"
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// Dry-run zones decide, count, log and send headers like any zone, but a
// request they alone refuse goes on, uncharged by them: their demands are
// soft (see store.BucketDemand.Soft), so the store decides the request, in its
// one all-or-nothing take, without those that lack, and charges the
// others. A dry-run zone's slots are soft too: when none is free, the
// request goes on without one.

// dryRunConfig puts a zone in dry run.
type dryRunConfig struct {
	// Compute, count and log decisions, and send the headers, but let
	// requests that this zone would refuse go on (uncharged by it). The
	// placeholder `{http.rate_limit.<name>.would_deny}` is then true (false
	// when the zone would let the request through), so that the upstream
	// can be told. Lets a new limit be tried safely. Default: false.
	DryRun bool `json:"dry_run,omitempty"`
}

var dryRunKind = kind{
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"dry_run": func(d *caddyfile.Dispenser, z *Zone) error { return flag(d, &z.DryRun) },
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		info.DryRun = z.inDryRun
		info.Requests["dry_run_denied"] = z.state.dryRunDenied.Load()
	},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, requests *prometheus.Desc, _ zoneID, s *zoneState) {
		counter(requests, &s.dryRunDenied, "dry_run_denied")
	},
}

// dryRunCounts are what dry run counts, in a zone's state.
type dryRunCounts struct {
	dryRunDenied atomic.Uint64 // would have been refused
}

// dryRunInfo is a zone's dry run in the admin API.
type dryRunInfo struct {
	DryRun bool `json:"dry_run"`
}

// noteDryRunSlot records that a dry-run zone with a limit on requests in
// flight had no place free for r.
func (h *Handler) noteDryRunSlot(r *http.Request, z *Zone) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(z.wouldDenyVar, true)
	}
}
