// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// refuse answers a request that does not go on: 429 when a zone refused
// it, 503 when an adaptive limit shed it or the store failed and
// fail_mode is closed, 500 when it cannot be decided, and nothing for a
// client that left while it waited; a gRPC request's 429s and 503s in
// gRPC's form (grpc.go).
// It returns the error for Caddy's error routes, or nil when it wrote the
// response itself.
func (h *Handler) refuse(w http.ResponseWriter, r *http.Request, sc *scratch, out outcome, err error) error {
	switch out {
	case outcomeDeny:
		if sc.slotOut >= 0 {
			return h.denySlot(w, r, &sc.d.Slots[sc.slotOut])
		}
		return h.deny(w, r, sc)
	case outcomeShed:
		return h.shedAdaptive(w, r, sc)
	case outcomeFailClosed:
		w.Header()["Retry-After"] = []string{"1"}
		return h.answer(w, r, http.StatusServiceUnavailable, time.Second, nil, "rate limit store unavailable", err)
	case outcomeBadLimit:
		// The zone logged the values once: Caddy would log every one.
		if h.writeRefusals {
			w.WriteHeader(http.StatusInternalServerError)
			return nil
		}
	case outcomeGone:
		// Nobody reads the answer: 499 for the access log, as
		// reverse_proxy records a client that left.
		w.WriteHeader(499)
		return nil
	}
	return err
}

// deny answers a request that a zone refused; sc.top is the most
// constrained of its zones. It returns the 429 error, or nil when it
// wrote the 429 itself.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, sc *scratch) error {
	top := sc.top
	z := h.Zones[top.zone]
	wait := top.wait
	if h.Jitter > 0 {
		// A client need never wait longer than a full refill beyond its
		// due: that also bounds a large jitter. A wait that would pass a
		// time.Duration (a ban and a refill of 100 years, and another
		// refill) is the longest one instead.
		extra := float64(wait) * h.Jitter * rand.Float64()
		wait = gcra.AddSat(wait, time.Duration(min(extra, float64(top.full))))
	}
	retryAfter := setRetryAfter(w.Header(), wait)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.rate_limit.exceeded.name", z.boxedName)
		repl.Set("http.rate_limit.exceeded.retry_after", retryAfter)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit exceeded"); c != nil {
		c.Write(h.logFields(r, z, top.wait, top.key)...)
	}
	if h.events != nil && h.events.ShouldEmit(exceededEvent) {
		ban := false
		for i := range sc.d.Buckets {
			ban = ban || sc.d.Buckets[i].Ban
		}
		h.emitExceeded(r, z, wait, ban)
	}
	return h.answer(w, r, http.StatusTooManyRequests, wait, z, "rate limit exceeded", z.denial)
}

// answer ends a refusal with status, by zone z (nil: the store failed),
// where a retry may succeed after wait. A gRPC request is answered in
// gRPC's form (grpc.go), with msg, and written here whatever the error
// routes: a handle_errors route would answer in HTTP's, which gRPC
// clients cannot read. Otherwise the refusal is written bare on a server
// without error routes, or returned to them as err.
func (h *Handler) answer(w http.ResponseWriter, r *http.Request, status int, wait time.Duration, z *Zone, msg string, err error) error {
	if h.grpcCode != 0 && isGRPC(r) {
		h.writeGRPC(w, status, wait, z, msg)
		return nil
	}
	if h.writeRefusals {
		w.WriteHeader(status)
		return nil
	}
	return err
}

// denySlot answers a request that a zone with concurrency refused: no
// slot was free.
func (h *Handler) denySlot(w http.ResponseWriter, r *http.Request, q *store.SlotDemand) error {
	return h.refuseInFlight(w, r, h.Zones[q.Zone], q.Key, false)
}

// refuseInFlight answers a request that found no place in flight in zone
// z: no slot free in a zone with concurrency (429), or shed by its
// adaptive limit (503). Retry-After is 1: a place may be free at any
// moment. It returns the error, or nil when it wrote the status itself.
func (h *Handler) refuseInFlight(w http.ResponseWriter, r *http.Request, z *Zone, key store.Key, shed bool) error {
	retryAfter := setRetryAfter(w.Header(), time.Second)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.rate_limit.exceeded.name", z.boxedName)
		repl.Set("http.rate_limit.exceeded.retry_after", retryAfter)
	}
	msg, status, err := "rate limit exceeded: no slot free", http.StatusTooManyRequests, z.denial
	if shed {
		msg, status, err = "rate limit: load shed", http.StatusServiceUnavailable, z.adaptive.shed
	}
	if c := h.logger.Check(zapcore.DebugLevel, msg); c != nil {
		fields := []zap.Field{zap.String("zone", z.Name), zap.String("remote_ip", clientIP(r))}
		if !shed {
			fields = append(fields, zap.Int64("concurrency", z.Concurrency))
		}
		if h.LogKey {
			fields = append(fields, zap.String("key", key.String()))
		}
		c.Write(fields...)
	}
	if h.events != nil && h.events.ShouldEmit(exceededEvent) {
		h.emitExceeded(r, z, time.Second, false)
	}
	return h.answer(w, r, status, time.Second, z, msg, err)
}

// exceededEvent is the Caddy event emitted when a request is denied, as
// github.com/mholt/caddy-ratelimit emits it.
const exceededEvent = "rate_limit_exceeded"

func (h *Handler) emitExceeded(r *http.Request, z *Zone, wait time.Duration, ban bool) {
	h.events.Emit(h.ctx, exceededEvent, map[string]any{
		"zone":      z.Name,
		"wait":      wait,
		"remote_ip": clientIP(r),
		"ban":       ban,
	})
}

// logFields describe a refusal: zone, wait and client, and the key only
// with log_key (keys can be personal data).
func (h *Handler) logFields(r *http.Request, z *Zone, wait time.Duration, key store.Key) []zap.Field {
	fields := []zap.Field{
		zap.String("zone", z.Name),
		zap.Duration("wait", wait),
		zap.String("remote_ip", clientIP(r)),
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", key.String()))
	}
	return fields
}
