// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap/zapcore"
)

// Dry-run zones decide, count, log and send headers like any zone, but a
// request they alone refuse goes on, uncharged by them. The store takes
// all of a request's zones at once, all or nothing, so when a dry-run
// zone refuses, the request is taken again from the zones that allowed
// it.

// shadow handles a request that dry-run zones may have refused. If only
// dry-run zones refused it, they are noted as such, and the request is
// charged to the other zones and goes on; if an enforced zone refused it,
// it stays refused.
//
// slots, for a store that keeps slots, were not taken (the store takes
// all or nothing): they are taken with the second charge.
func (h *Handler) shadow(r *http.Request, now time.Time, sc *scratch, slots []slot) (outcome, error) {
	enforced := true
	for i := range sc.reqs {
		if q := &sc.reqs[i]; !q.ok {
			if !q.zone.inDryRun {
				enforced = false
				continue
			}
			q.wouldDeny = true
			h.noteDryRun(r, q)
		}
	}
	if !enforced {
		return outcomeDeny, nil
	}
	charge := sc.retry[:0]
	for _, q := range sc.reqs {
		if q.ok {
			charge = append(charge, q)
		}
	}
	sc.retry = charge
	if len(charge) == 0 && len(slots) == 0 {
		return outcomeAllow, nil
	}
	out, by, err := h.take(r.Context(), now, charge, slots)
	sc.by = by
	for _, c := range charge {
		for i := range sc.reqs {
			if sc.reqs[i].zone == c.zone && sc.reqs[i].isQuota() == c.isQuota() {
				sc.reqs[i].ok, sc.reqs[i].debt, sc.reqs[i].used = c.ok, c.debt, c.used
			}
		}
	}
	if out != outcomeDeny {
		return out, err
	}
	if by == h.store && slotRefused(slots) {
		return outcomeDeny, nil // refused by a zone with concurrency
	}
	// The buckets changed in between. Refused by an enforced zone, the
	// request is refused; by dry-run zones only, it goes on uncharged.
	for i := range sc.reqs {
		if q := &sc.reqs[i]; !q.ok && !q.wouldDeny {
			if !q.zone.inDryRun {
				return outcomeDeny, nil
			}
			q.wouldDeny = true
			h.noteDryRun(r, q)
		}
	}
	return outcomeAllow, nil
}

// noteDryRun records that a dry-run zone would have refused r.
func (h *Handler) noteDryRun(r *http.Request, q *request) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(q.zone.wouldDenyVar, true)
		repl.Set("http.rate_limit.would_deny", q.zone.boxedName)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit would be exceeded (dry run)"); c != nil {
		c.Write(h.logFields(r, q)...)
	}
}

// noteDryRunPassed sets the would_deny placeholder of the dry-run zones
// that would have let r through, so that it is known for every request a
// dry-run zone applies to.
func (h *Handler) noteDryRunPassed(r *http.Request, reqs []request) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	for i := range reqs {
		if q := &reqs[i]; q.zone.inDryRun && !q.wouldDeny {
			repl.Set(q.zone.wouldDenyVar, false)
		}
	}
}
