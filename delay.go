// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"net/http"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Zones with delay let a request that finds too few tokens, but would
// have them within the delay, wait for them instead of being refused.
// The store decides as for any request, with the take's bound moved by
// the delay (see limit.take): the tokens are reserved at once, all or
// nothing with the request's other zones, and the request then waits
// until they are there, the longest of its zones' waits. Nothing waits
// in memory but the request itself, and at most max_delayed of them per
// handler.

// enterWaiting takes a place among the handler's waiting requests for a
// request that one of its zones may delay, before the store decides it,
// and reports whether it did. When max_delayed requests hold a place
// already, the request's zones decide it as if they had no delay.
func (h *Handler) enterWaiting(reqs []request) bool {
	delays := false
	for i := range reqs {
		if q := &reqs[i]; q.zone.limit.delay > 0 && !q.zone.inDryRun {
			delays = true
			break
		}
	}
	if !delays {
		return false
	}
	if h.waiting.Add(1) <= h.maxDelayed {
		return true
	}
	h.waiting.Add(-1)
	for i := range reqs {
		if q := &reqs[i]; q.zone.limit.delay > 0 && !q.zone.inDryRun {
			q.noDelay = true
		}
	}
	return false
}

// noteDelay settles the request's place once it is decided: an allowed
// request that must wait keeps it, with sc.delay set; any other gives it
// back. It counts the requests refused only because max_delayed requests
// were waiting already.
func (h *Handler) noteDelay(sc *scratch, out outcome) {
	if sc.waiter && out == outcomeAllow {
		for i := range sc.reqs {
			if q := &sc.reqs[i]; !q.zone.inDryRun {
				sc.delay = max(sc.delay, q.delayed())
			}
		}
	}
	if sc.waiter && sc.delay == 0 {
		h.waiting.Add(-1)
		sc.waiter = false
	}
	if out != outcomeDeny {
		return
	}
	for i := range sc.reqs {
		if q := &sc.reqs[i]; q.noDelay && !q.ok && q.plan().limit.wait(q.debt, q.plan().costTime) == 0 {
			q.zone.state.delayRefused.Add(1)
		}
	}
}

// await holds an allowed request until the tokens its zones reserved are
// there, and gives its place back. It reports false when the client left
// first: the tokens are then given back too.
func (h *Handler) await(r *http.Request, sc *scratch) bool {
	defer h.waiting.Add(-1)
	var top *request
	for i := range sc.reqs {
		q := &sc.reqs[i]
		if d := q.delayed(); d > 0 && !q.zone.inDryRun {
			if q.zone.delays != nil {
				q.zone.delays.Observe(d.Seconds())
			}
			if top == nil || d > top.delayed() {
				top = q
			}
		}
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit: request waits for its tokens"); c != nil && top != nil {
		fields := []zap.Field{zap.String("zone", top.zone.Name), zap.Duration("delay", sc.delay), zap.String("remote_ip", clientIP(r))}
		if h.LogKey {
			fields = append(fields, zap.String("key", top.key.String()))
		}
		c.Write(fields...)
	}

	timer := time.NewTimer(sc.delay)
	defer timer.Stop()
	select {
	case <-timer.C:
		h.countDelayed(sc.reqs, false)
		return true
	case <-r.Context().Done():
	}
	back := sc.retry[:0]
	for _, q := range sc.reqs {
		if q.ok && !q.wouldDeny {
			back = append(back, q)
		}
	}
	sc.retry = back
	if len(back) > 0 && sc.by != nil {
		if err := sc.by.refund(context.WithoutCancel(r.Context()), time.Now(), back); err != nil {
			h.refundErrors.Warn(h.logger, "rate limit: tokens not given back to a client that left while waiting", err)
		}
	}
	h.countDelayed(sc.reqs, true)
	return false
}

// countDelayed counts, in each zone that delayed the request, how its
// wait ended.
func (h *Handler) countDelayed(reqs []request, abandoned bool) {
	for i := range reqs {
		if q := &reqs[i]; q.delayed() > 0 && !q.zone.inDryRun {
			if abandoned {
				q.zone.state.delayAbandoned.Add(1)
			} else {
				q.zone.state.delayed.Add(1)
			}
		}
	}
}
