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
// request they alone refuse goes on, uncharged by them. The store takes
// all of a request's demands at once, all or nothing, so when a dry-run
// zone refuses, the request is taken again without the zones that
// refused it. A dry-run zone's slots are soft: when none is free, the
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

// A retry is a second take of a request's demands, without those of the
// dry-run zones that refused it.
type retry struct {
	d        demands
	buckets  []int // where each bucket of d came from in the request's demands
	counters []int
}

// shadow handles a request that dry-run zones may have refused. If only
// dry-run zones refused it, they are noted as such, and the request is
// charged to the other zones and goes on; if an enforced zone refused it,
// it stays refused.
func (h *Handler) shadow(r *http.Request, now time.Time, sc *scratch) (outcome, error) {
	if !h.markDryRun(r, sc) {
		return outcomeDeny, nil
	}
	rt := &sc.retry
	rt.fill(&sc.d)
	if rt.d.empty() {
		return outcomeAllow, nil
	}
	out, err := h.take(r.Context(), now, sc, &rt.d)
	rt.copyBack(&sc.d)
	if out != outcomeDeny {
		return out, err
	}
	// The buckets changed in between. Refused by an enforced zone, or
	// for want of a slot, the request is refused; by dry-run zones only,
	// it goes on uncharged.
	if slotRefusal(&sc.d) >= 0 || !h.markDryRun(r, sc) {
		return outcomeDeny, nil
	}
	sc.by = nil // no store charged the request: nothing to give back
	return outcomeAllow, nil
}

// markDryRun marks the dry-run zones whose bucket or counter refused the
// request, and reports whether only such zones refused it.
func (h *Handler) markDryRun(r *http.Request, sc *scratch) bool {
	onlyDry := true
	for i := range sc.matches {
		m := &sc.matches[i]
		if m.wouldDeny || m.ok(&sc.d) {
			continue
		}
		z := h.Zones[m.zone]
		if !z.inDryRun {
			onlyDry = false
			continue
		}
		m.wouldDeny = true
		h.noteDryRun(r, z, sc.wait(m), h.keyOf(sc, m))
	}
	return onlyDry
}

// fill makes rt the demands of d that had what they asked, and d's slots.
func (rt *retry) fill(d *demands) {
	rt.d.clear()
	rt.buckets, rt.counters = rt.buckets[:0], rt.counters[:0]
	for i := range d.buckets {
		if d.buckets[i].ok {
			rt.d.buckets = append(rt.d.buckets, d.buckets[i])
			rt.buckets = append(rt.buckets, i)
		}
	}
	for i := range d.counters {
		if d.counters[i].ok {
			rt.d.counters = append(rt.d.counters, d.counters[i])
			rt.counters = append(rt.counters, i)
		}
	}
	rt.d.slots = append(rt.d.slots, d.slots...)
}

// copyBack gives the demands of d the answers of the second take.
func (rt *retry) copyBack(d *demands) {
	for j, i := range rt.buckets {
		d.buckets[i] = rt.d.buckets[j]
	}
	for j, i := range rt.counters {
		d.counters[i] = rt.d.counters[j]
	}
	copy(d.slots, rt.d.slots)
	d.at, d.remembered = rt.d.at, rt.d.remembered
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

// noteDryRun records that a dry-run zone would have refused r.
func (h *Handler) noteDryRun(r *http.Request, z *Zone, wait time.Duration, key bucketKey) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(z.wouldDenyVar, true)
		repl.Set("http.rate_limit.would_deny", z.boxedName)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit would be exceeded (dry run)"); c != nil {
		c.Write(h.logFields(r, z, wait, key)...)
	}
}

// noteDryRunSlot records that a dry-run zone with concurrency had no slot
// free for r.
func (h *Handler) noteDryRunSlot(r *http.Request, z *Zone) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(z.wouldDenyVar, true)
	}
}

// noteDryRunPassed sets the would_deny placeholder of the dry-run zones
// that would have let r through, so that it is known for every request a
// dry-run zone applies to.
func (h *Handler) noteDryRunPassed(r *http.Request, sc *scratch) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	for i := range sc.matches {
		m := &sc.matches[i]
		if z := h.Zones[m.zone]; z.inDryRun && !m.wouldDeny && (m.slot < 0 || !sc.d.slots[m.slot].full) && !sc.adaptive.wouldShed(m.zone) {
			repl.Set(z.wouldDenyVar, false)
		}
	}
}
