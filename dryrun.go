// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap/zapcore"
)

// Dry-run zones decide, count, log and send headers like any zone, but a
// request they alone refuse goes on, uncharged by them: their demands are
// soft (see bucketDemand.soft), so the store decides the request, in its
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
	info: func(z *Zone, _ zoneStats, info *zoneInfo) { info.DryRun = z.inDryRun },
}

// noteDryRun says in r's placeholders whether m's zone z, in dry run,
// would have refused the request: its bucket or counter lacked (logged,
// and named in http.rate_limit.would_deny), or it had no slot free; or,
// for a request the store decided, that it would not.
func (h *Handler) noteDryRun(r *http.Request, sc *scratch, m *match, z *Zone) {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	switch {
	case m.wouldDeny && !m.ok(&sc.d):
		if repl != nil {
			repl.Set(z.wouldDenyVar, true)
			repl.Set("http.rate_limit.would_deny", z.boxedName)
		}
		if c := h.logger.Check(zapcore.DebugLevel, "rate limit would be exceeded (dry run)"); c != nil {
			c.Write(h.logFields(r, z, sc.wait(m), h.keyOf(sc, m))...)
		}
	case m.wouldDeny:
		h.noteDryRunSlot(r, z)
	case repl != nil && !sc.adaptive.wouldShed(m.zone):
		repl.Set(z.wouldDenyVar, false)
	}
}

// wait is how long the request would wait for m's zone: its bucket's
// wait, or its counter's, the longer.
func (sc *scratch) wait(m *match) time.Duration {
	var w time.Duration
	if m.bucket >= 0 {
		w = sc.d.buckets[m.bucket].wait()
	}
	if m.counter >= 0 {
		w = max(w, sc.d.counters[m.counter].wait())
	}
	return w
}

// noteDryRunSlot records that a dry-run zone with a limit on requests in
// flight had no place free for r.
func (h *Handler) noteDryRunSlot(r *http.Request, z *Zone) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(z.wouldDenyVar, true)
	}
}
