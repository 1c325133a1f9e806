// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"net/http"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// decide is a request's first stage: it gathers the demands of every zone
// that applies to r, gives them to the kinds that decide before the store
// (an adaptive limit's place, a delay's place among the waiting
// requests), asks the store for them, all or nothing, applies fail_mode
// when the store fails, counts the outcome (dry runs with it) and sets
// the response headers. Each of those files is entered once. The error
// says why a request that failed cannot go on.
func (h *Handler) decide(w http.ResponseWriter, r *http.Request, sc *scratch) (outcome, error) {
	now, out, err := h.gather(r, sc)
	if out == outcomeAllow && len(sc.adaptive.p) > 0 {
		if out = h.admitAdaptive(r, now, sc); out != outcomeAllow {
			return out, nil
		}
	}
	if out != outcomeAllow || sc.d.Empty() {
		return out, err
	}
	if h.anyDelay {
		sc.waiter = h.enterWaiting(sc)
	}
	if h.holds != nil {
		// Until finish: what the request gives back after the response
		// goes to the store that decided it, whatever a reload does.
		sc.held = h.holds.Hold()
	}
	for {
		out, err = h.take(r.Context(), now, sc, &sc.d)
		// Once more, at most: with the estimates that a key's own burst
		// could not hold clamped to it.
		if out != outcomeDeny || !h.clampOwnBurst(&sc.d) {
			break
		}
	}
	sc.slotOut = slotRefusal(&sc.d)
	if out == outcomeDeny {
		if err := h.costAboveOwnBurst(&sc.d); err != nil {
			return outcomeBadLimit, err
		}
	}
	h.count(r, sc, out)
	if out != outcomeAllow && out != outcomeDeny {
		return out, err
	}
	h.respond(w.Header(), now, sc)
	return out, nil
}

// gather sets the placeholders of r's JSON body that the zones name,
// adds the demands of every zone whose matchers match r, and returns the
// instant of the decision. A matcher that fails, or a zone
// without a valid limit for r, ends the request. The demands of a zone in
// dry run or with spill are soft: they refuse nothing.
func (h *Handler) gather(r *http.Request, sc *scratch) (time.Time, outcome, error) {
	var now time.Time       // read once, when needed
	var body usagescan.Body // read once, for the zones with estimate and the json placeholders
	if h.jsonVars != nil {
		h.setJSONVars(r, &body)
	}
	for i, z := range h.Zones {
		if len(z.matcherSets) > 0 {
			match, err := z.matcherSets.AnyMatchWithError(r)
			if err != nil {
				return now, outcomeFailed, err
			}
			if !match {
				continue
			}
		}
		k, ok := z.bucketKey(r)
		if !ok {
			continue
		}
		l, cost, units, class, ok := h.costOf(r, z, &body)
		if !ok {
			return now, outcomeBadLimit, z.badLimit
		}
		soft := z.inDryRun || z.Spill
		m := match{zone: i, bucket: -1, counter: -1, slot: -1, class: class}
		if !z.rateless {
			m.bucket = len(sc.d.Buckets)
			sc.d.Buckets = append(sc.d.Buckets, store.BucketDemand{Zone: i, Key: k, Limit: l, Cost: cost, Soft: soft})
		}
		if z.quota != nil {
			if now.IsZero() {
				now = time.Now()
			}
			m.counter = len(sc.d.Counters)
			sc.d.Counters = append(sc.d.Counters, store.CounterDemand{Zone: i, Key: k, Limit: z.quota.limit, Cost: units, Window: z.quota.Window(now), Soft: soft})
		}
		if z.Concurrency != 0 {
			m.slot = len(sc.d.Slots)
			sc.d.Slots = append(sc.d.Slots, store.SlotDemand{Zone: i, Key: k, Limit: z.Concurrency, Lease: time.Duration(z.Lease), Soft: soft})
		}
		if z.adaptive != nil {
			sc.adaptive.add(i, k)
			if z.adaptiveOnly() {
				continue // nothing for the store, the headers or count
			}
		}
		sc.matches = append(sc.matches, m)
	}
	if now.IsZero() && !sc.d.Empty() {
		now = time.Now()
	}
	return now, outcomeAllow, nil
}

// costOf is the limit of z's bucket for r (keeping the reserves of the
// classes above r's), what r takes of it and of z's quota (the zone's
// cost, its plan's, or r's estimate), and r's class. body is what the
// zones with estimate read of r's body. It reports false when z has no
// valid limit for r.
func (h *Handler) costOf(r *http.Request, z *Zone, body *usagescan.Body) (gcra.Limit, time.Duration, int64, int, bool) {
	l, cost, n, class := z.limit, z.costTime, z.Cost, 0
	if z.plans != nil && !z.rateless {
		p := z.planFor(r)
		if p == nil {
			return l, 0, 0, 0, false
		}
		l, cost, n = p.limit, p.costTime, p.cost
	}
	if z.reserves != nil {
		l, class = z.reserves.keeping(r, l)
	}
	if z.Estimate == nil {
		return l, cost, z.Cost, class, true
	}
	cost, units := z.reserve(h.estimate(r, z, body, n), &l)
	return l, cost, units, class, true
}

// take asks the store to take d, and applies fail_mode when it fails. It
// sets sc.by, the store that took d.
func (h *Handler) take(ctx context.Context, now time.Time, sc *scratch, d *store.Demands) (outcome, error) {
	allowed, err := h.store.Take(ctx, now, d)
	if h.latency != nil {
		h.latency.Observe(time.Since(now).Seconds())
	}
	if err == nil {
		sc.by = h.store
		return verdict(allowed), nil
	}
	for _, m := range sc.matches {
		h.Zones[m.zone].state.storeErrors.Add(1)
	}
	if h.storeErrors != nil {
		h.storeErrors.Inc()
	}
	f, ok := h.store.(store.Fallible)
	if !ok {
		answerAll(d, false)
		sc.by = nil
		return outcomeFailed, caddyhttp.HandlerError{StatusCode: http.StatusInternalServerError, Err: err}
	}
	switch h.failMode {
	case store.FailLocal:
		for i := range d.Buckets {
			d.Buckets[i].Floor = f.Known(now, &d.Buckets[i], err)
		}
		allowed, err := h.fallback.Take(ctx, now, d)
		for i := range d.Buckets {
			d.Buckets[i].Floor = 0
		}
		sc.by = h.fallback
		return verdict(allowed), err
	case store.FailOpen:
		answerAll(d, true)
		sc.by = nil
		return outcomeFailOpen, nil
	default:
		answerAll(d, false)
		sc.by = nil
		if !d.Soft() {
			return outcomeFailClosed, caddyhttp.HandlerError{StatusCode: http.StatusServiceUnavailable, Err: err}
		}
		// Only zones that never refuse (dry run, spill) apply: closed
		// takes the unknown for over their limits, which they let
		// through, as would-be refusals or spilled (see count).
		for i := range d.Slots {
			d.Slots[i].Full = true
		}
		return outcomeFailOpen, nil
	}
}

// costAboveOwnBurst is the error of a request refused where its key's
// own limit has a burst below the request's cost, in a zone that
// enforces: no request of that cost could ever pass. A zone whose cost
// comes with each request (or that a reload gave a larger cost) could
// not check it when the limit was set, so the request is answered as one
// whose plan has a cost above its burst (plans.go): 500 rather than a
// 429 that would promise tokens, logged at most once a minute for the
// zone.
func (h *Handler) costAboveOwnBurst(d *store.Demands) error {
	for i := range d.Buckets {
		b := &d.Buckets[i]
		z := h.Zones[b.Zone]
		if !b.Overridden || b.Cost <= b.Limit.BurstTime || z.inDryRun {
			continue
		}
		if held, ok := z.state.ownBurst.Allow(time.Minute); ok {
			fields := []zap.Field{zap.String("zone", z.Name), zap.Int64("cost", int64(b.Cost/b.Limit.TokenTime)),
				zap.Int64("burst", b.Limit.Burst), zap.Int64("more_since_last", held)}
			if h.LogKey {
				fields = append(fields, zap.String("key", b.Key.String()))
			}
			h.logger.Error("rate limit: the request's cost is above its key's own burst: answered 500", fields...)
		}
		return z.badLimit
	}
	return nil
}

// answerAll answers every demand of d as ok says, as a failed store's
// fail_mode decides: no bucket charged, no slot held.
func answerAll(d *store.Demands, ok bool) {
	for i := range d.Buckets {
		d.Buckets[i].OK, d.Buckets[i].Ban, d.Buckets[i].Debt = ok, false, 0
	}
	for i := range d.Counters {
		d.Counters[i].OK, d.Counters[i].Used, d.Counters[i].Left = ok, 0, 0
	}
	for i := range d.Slots {
		d.Slots[i].Held, d.Slots[i].Free, d.Slots[i].Full = false, 0, false
	}
}

// verdict is the outcome of a store's decision.
func verdict(allowed bool) outcome {
	if allowed {
		return outcomeAllow
	}
	return outcomeDeny
}

// ok reports whether m's bucket and counter had what the request takes.
func (m *match) ok(d *store.Demands) bool {
	return (m.bucket < 0 || d.Buckets[m.bucket].OK) && (m.counter < 0 || d.Counters[m.counter].OK)
}

// count adds a request's outcome to its zones' counters: once per zone,
// whatever its demands. A request that the store failed on is counted as
// a store error (by take), and as what fail_mode decided when that was a
// decision: allowed by open, allowed or refused by the local buckets;
// closed refuses without deciding, unless only zones that never refuse
// apply (dry run, spill): it then lets the request through as their
// would-be refusal, which they count and name as they do any. A zone in dry run, whose demands are
// soft (the store decided the request without those that lacked), is
// counted as one that would have refused, or not, and says so in the
// request's placeholders (see noteDryRun). A zone with spill, whose
// demands are soft too, counts an allowed request that it could not take
// as spilled, and says so in the placeholders (see noteSpill).
func (h *Handler) count(r *http.Request, sc *scratch, out outcome) {
	if out == outcomeFailClosed || out == outcomeFailed {
		return
	}
	allowed := out == outcomeAllow || out == outcomeFailOpen
	decided := out == outcomeAllow || out == outcomeDeny
	for i := range sc.matches {
		m := &sc.matches[i]
		z := h.Zones[m.zone]
		st := z.state
		for _, f := range z.decided {
			f(st, &sc.d, m)
		}
		ok := m.ok(&sc.d)
		if !ok && sc.d.Remembered {
			st.cacheHits.Add(1)
		}
		full := m.slot >= 0 && sc.d.Slots[m.slot].Full
		m.wouldDeny = (z.inDryRun || z.Spill) && (!ok || full)
		if z.inDryRun && (decided || m.wouldDeny) {
			h.noteDryRun(r, sc, m, z)
		}
		if z.Spill && allowed {
			h.noteSpill(r, sc, m, z, m.wouldDeny && !z.inDryRun)
		}
		switch {
		case m.wouldDeny && z.inDryRun:
			st.dryRunDenied.Add(1)
			st.top.Add(topKey(m.key(&sc.d)))
		case m.wouldDeny:
			if allowed { // else another zone refused it: nothing spilled
				st.spilled.Add(1)
			}
		case !ok || full:
			st.denied.Add(1)
			st.top.Add(topKey(m.key(&sc.d)))
		case allowed:
			st.allowed.Add(1)
		}
	}
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
			c.Write(h.logFields(r, z, m.wait(&sc.d), m.key(&sc.d))...)
		}
	case m.wouldDeny:
		h.noteDryRunSlot(r, z)
	case repl != nil && !sc.adaptive.wouldShed(m.zone):
		repl.Set(z.wouldDenyVar, false)
	}
}

// noteSpill says in r's placeholders whether m's zone z, with spill, sent
// the allowed request on over its limit (spilled; in dry run it spills
// nothing): it then names the zone in http.rate_limit.spilled, unless a
// zone before it did, and logs it at DEBUG. A request that no zone
// spilled has the placeholder empty, rather than unknown (which header
// operations would leave as written).
func (h *Handler) noteSpill(r *http.Request, sc *scratch, m *match, z *Zone, spilled bool) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(z.spilledVar, spilled)
		if name, _ := repl.Get(spilledVar); name == nil || name == "" {
			repl.Set(spilledVar, spilledName(spilled, z))
		}
	}
	if !spilled {
		return
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit exceeded: the request goes on, spilled"); c != nil {
		c.Write(h.logFields(r, z, m.wait(&sc.d), m.key(&sc.d))...)
	}
}

// spilledName is what http.rate_limit.spilled says of zone z: its name
// when it spilled the request, else "".
func spilledName(spilled bool, z *Zone) any {
	if spilled {
		return z.boxedName
	}
	return noZone
}

// noZone is "", boxed once for the replacer.
var noZone any = ""

// spilledVar is the placeholder that names the zone that spilled a
// request.
const spilledVar = "http.rate_limit.spilled"

// wait is how long the request would wait for m's zone: its bucket's
// wait, or its counter's, the longer.
func (m *match) wait(d *store.Demands) time.Duration {
	var w time.Duration
	if m.bucket >= 0 {
		w = d.Buckets[m.bucket].Wait()
	}
	if m.counter >= 0 {
		w = max(w, d.Counters[m.counter].Wait())
	}
	return w
}

// key is the key of m's zone for the request.
func (m *match) key(d *store.Demands) store.Key {
	switch {
	case m.bucket >= 0:
		return d.Buckets[m.bucket].Key
	case m.counter >= 0:
		return d.Counters[m.counter].Key
	}
	return d.Slots[m.slot].Key
}
