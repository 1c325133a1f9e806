// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// serve is the stage that passes an allowed request on, and settles what
// its zones charged once the response is known: a zone with count gives
// its tokens back after a response that count does not match. (The
// request took them before it went on, so that concurrent requests
// cannot outrun the burst.)
func (h *Handler) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, sc *scratch) error {
	if !h.anyCount || sc.by == nil || !h.counted(sc) {
		return next.ServeHTTP(w, r)
	}
	rec := &sc.rec
	rec.ResponseWriter, rec.status = w, 0
	err := next.ServeHTTP(rec, r)
	status := rec.status
	if err != nil {
		status = http.StatusInternalServerError
		if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
			status = he.StatusCode
		}
	} else if status == 0 {
		status = http.StatusOK
	}
	h.settle(r, sc, status, rec.Header())
	return err
}

// counted reports whether a zone with count applies to the request.
func (h *Handler) counted(sc *scratch) bool {
	for i := range sc.matches {
		if h.Zones[sc.matches[i].zone].Count != nil {
			return true
		}
	}
	return false
}

// settle gives back what the zones with count charged the request, when
// its response, of status and headers hdr, does not match.
func (h *Handler) settle(r *http.Request, sc *scratch, status int, hdr http.Header) {
	back := false
	for i := range sc.matches {
		m := &sc.matches[i]
		if c := h.Zones[m.zone].Count; c != nil && m.ok(&sc.d) && !c.Match(status, hdr) {
			m.back, back = true, true
		}
	}
	if !back {
		return
	}
	if !h.giveBack(r.Context(), time.Now(), sc, "rate limit: tokens not given back after a response that count does not match") {
		return
	}
	for i := range sc.matches {
		if m := &sc.matches[i]; m.back {
			h.Zones[m.zone].state.refunds.Add(1)
		}
	}
}

// giveBack gives the zones marked back in sc.matches what the store
// charged them for the request (the demands that were ok): an adjustment
// by each demand's cost, negated. It reports whether the store made it.
// ctx is the request's: the store gives back when the client has gone
// too.
func (h *Handler) giveBack(ctx context.Context, now time.Time, sc *scratch, msg string) bool {
	back := &sc.back
	back.clear()
	for i := range sc.matches {
		m := &sc.matches[i]
		if !m.back {
			continue
		}
		if m.bucket >= 0 && sc.d.buckets[m.bucket].ok {
			b := sc.d.buckets[m.bucket]
			b.cost = -b.cost
			back.buckets = append(back.buckets, b)
		}
		if m.counter >= 0 && sc.d.counters[m.counter].ok {
			c := sc.d.counters[m.counter]
			c.cost = -c.cost
			back.counters = append(back.counters, c)
		}
	}
	if back.empty() || sc.by == nil {
		return false
	}
	if err := sc.by.adjust(ctx, now, back); err != nil {
		h.refundErrors.Warn(h.logger, msg, err)
		return false
	}
	return true
}

// statusWriter passes a response through and notes its status, for
// count. It lives in the request's pooled scratch, so that counting
// allocates nothing: like any ResponseWriter, it must not be used after
// the handler that got it has returned. Flushing and hijacking reach the
// writer it wraps, whether a handler asks http.ResponseController (which
// unwraps) or checks for http.Flusher or http.Hijacker itself.
type statusWriter struct {
	caddyhttp.ResponseWriterWrapper
	status int // the final status written; 0 until then
}

// WriteHeader notes the first final status: other 1xx are informational,
// 101 Switching Protocols ends the exchange.
func (w *statusWriter) WriteHeader(status int) {
	if w.status == 0 && (status < 100 || status > 199 || status == http.StatusSwitchingProtocols) {
		w.status = status
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *statusWriter) FlushError() error {
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *statusWriter) Flush() { _ = w.FlushError() }

func (w *statusWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (w *statusWriter) ReadFrom(src io.Reader) (int64, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriterWrapper.ReadFrom(src)
}
