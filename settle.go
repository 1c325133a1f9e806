// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// serve is the stage that passes an allowed request on, and settles what
// its zones charged once the response is known (see settle). A request
// takes its tokens before it goes on, so that concurrent requests cannot
// outrun the burst; what the response says adjusts them afterwards.
func (h *Handler) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, sc *scratch) error {
	if !h.anySettle || sc.by == nil || !h.settles(sc) {
		return next.ServeHTTP(w, r)
	}
	rec := &sc.rec
	rec.reset(w, sc.scans)
	settled := false
	defer func() {
		// A handler after this one panicked, as reverse_proxy does to
		// abort a response that its upstream cut off.
		if !settled {
			h.settle(r, sc, cmp.Or(rec.status, http.StatusInternalServerError), rec.Header(), false)
		}
	}()
	err := next.ServeHTTP(rec, r)
	settled = true
	status := rec.status
	if err != nil {
		status = http.StatusInternalServerError
		if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
			status = he.StatusCode
		}
	} else if status == 0 {
		status = http.StatusOK
	}
	h.settle(r, sc, status, rec.Header(), err == nil && !rec.failed)
	return err
}

// settles reports whether a zone that settles after the response (count,
// usage) charged the request, and readies a usage scan for each such zone
// with usage: zones that read the same usage share one.
func (h *Handler) settles(sc *scratch) bool {
	sc.scans = sc.scans[:0]
	any := false
	for i := range sc.matches {
		m := &sc.matches[i]
		z := h.Zones[m.zone]
		if z.Count == nil && z.Usage == nil || !m.ok(&sc.d) {
			continue
		}
		any = true
		if z.Usage != nil {
			m.scan = sc.scanFor(&z.Usage.spec)
		}
	}
	return any
}

// scanFor is the place in sc.scans of the scan that reads u.
func (sc *scratch) scanFor(u *usagescan.Spec) int {
	for i := range sc.scans {
		if sc.scans[i].Reads(u) {
			return i
		}
	}
	n := len(sc.scans)
	if n < cap(sc.scans) {
		sc.scans = sc.scans[:n+1] // keeps the scan's event buffer
	} else {
		sc.scans = append(sc.scans, usagescan.Scanner{})
	}
	sc.scans[n].Reset(u)
	return n
}

// settle adjusts what the zones charged the request once its response,
// of status and headers hdr, is known: a zone with count gives its tokens
// back after a response that count does not match; a zone with usage is
// charged the usage less the cost it took, or given back the difference.
// whole says whether the response ended as it should.
func (h *Handler) settle(r *http.Request, sc *scratch, status int, hdr http.Header, whole bool) {
	sc.back.Clear()
	for i := range sc.matches {
		m := &sc.matches[i]
		z := h.Zones[m.zone]
		switch {
		case z.Count == nil && z.Usage == nil || !m.ok(&sc.d):
		case z.Count != nil && !z.Count.Match(status, hdr):
			m.back = true
			sc.refund(m)
		case z.Usage != nil:
			h.settleUsage(sc, m, z, hdr, whole)
		}
	}
	if !h.adjust(r.Context(), time.Now(), sc, "rate limit: a response's count or usage not settled") {
		return
	}
	for i := range sc.matches {
		if m := &sc.matches[i]; m.back {
			h.Zones[m.zone].state.refunds.Add(1)
		}
	}
}

// settleUsage charges m's zone the usage its response reports, less the
// cost the request took. Without a usage, the request keeps what it
// took: that is counted, and logged at most once a minute per zone,
// without the key. The throttle is the zone's state, which every handler
// with the zone shares, across reloads too.
func (h *Handler) settleUsage(sc *scratch, m *match, z *Zone, hdr http.Header, whole bool) {
	n, why := sc.scans[m.scan].End(hdr, whole)
	if why != usagescan.Found {
		z.state.usageMissing.Add(1)
		if held, ok := z.state.noUsage.Allow(time.Minute); ok {
			h.logger.Warn("rate limit: no usage in a response; the request keeps the cost it took",
				zap.String("zone", z.Name), zap.String("reason", why.String()), zap.Int64("more_since_last", held))
		}
		return
	}
	z.state.usage.Add(uint64(n))
	var spent time.Duration
	var units int64
	if m.bucket >= 0 {
		b := &sc.d.Buckets[m.bucket]
		spent = b.Limit.Spend(n) - b.Cost
	}
	if m.counter >= 0 {
		units = n - sc.d.Counters[m.counter].Cost
	}
	sc.adjustBy(m, spent, units)
}

// refund adds to sc.back what m's zone charged the request, to give it
// back.
func (sc *scratch) refund(m *match) {
	var spent time.Duration
	var units int64
	if m.bucket >= 0 {
		spent = -sc.d.Buckets[m.bucket].Cost
	}
	if m.counter >= 0 {
		units = -sc.d.Counters[m.counter].Cost
	}
	sc.adjustBy(m, spent, units)
}

// adjustBy adds to sc.back an adjustment of m's bucket by spent and of
// its counter by units, for those the store charged (the demands that
// were ok). 0 adjusts nothing.
func (sc *scratch) adjustBy(m *match, spent time.Duration, units int64) {
	if m.bucket >= 0 && sc.d.Buckets[m.bucket].OK && spent != 0 {
		b := sc.d.Buckets[m.bucket]
		b.Cost = spent
		sc.back.Buckets = append(sc.back.Buckets, b)
	}
	if m.counter >= 0 && sc.d.Counters[m.counter].OK && units != 0 {
		c := sc.d.Counters[m.counter]
		c.Cost = units
		sc.back.Counters = append(sc.back.Counters, c)
	}
}

// giveBack gives the zones marked back in sc.matches what the store
// charged them for the request, and reports whether the store made it.
func (h *Handler) giveBack(ctx context.Context, now time.Time, sc *scratch, msg string) bool {
	sc.back.Clear()
	for i := range sc.matches {
		if m := &sc.matches[i]; m.back {
			sc.refund(m)
		}
	}
	return h.adjust(ctx, now, sc, msg)
}

// adjust makes the adjustments in sc.back in the store that took the
// request's demands, and reports whether it did. ctx is the request's:
// the store adjusts when the client has gone too.
func (h *Handler) adjust(ctx context.Context, now time.Time, sc *scratch, msg string) bool {
	if sc.back.Empty() || sc.by == nil {
		return false
	}
	if err := sc.by.Adjust(ctx, now, &sc.back); err != nil {
		h.refundErrors.Warn(h.logger, msg, err)
		return false
	}
	return true
}

// statusWriter passes a response through, and notes its status for count
// and its usage for the zones with usage, as it passes: nothing is held
// back or buffered. It lives in the request's pooled scratch, so that
// settling allocates nothing: like any ResponseWriter, it must not be
// used after the handler that got it has returned. Flushing and
// hijacking reach the writer it wraps, whether a handler asks
// http.ResponseController (which unwraps) or checks for http.Flusher or
// http.Hijacker itself.
type statusWriter struct {
	caddyhttp.ResponseWriterWrapper
	status int                 // the final status written; 0 until then
	failed bool                // a write failed: the client has gone
	scans  []usagescan.Scanner // the usages to read in the response
	tee    readScanning        // what ReadFrom reads through
}

func (w *statusWriter) reset(rw http.ResponseWriter, scans []usagescan.Scanner) {
	*w = statusWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: rw}, scans: scans}
}

// started notes status, the response's final status, and reads its
// header for the usages.
func (w *statusWriter) started(status int) {
	w.status = status
	for i := range w.scans {
		w.scans[i].Start(w.Header())
	}
}

// WriteHeader notes the first final status: other 1xx are informational,
// 101 Switching Protocols ends the exchange.
func (w *statusWriter) WriteHeader(status int) {
	if w.status == 0 && (status < 100 || status > 199 || status == http.StatusSwitchingProtocols) {
		w.started(status)
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
		w.started(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(p)
	w.scan(p[:n])
	w.failed = w.failed || err != nil
	return n, err
}

func (w *statusWriter) ReadFrom(src io.Reader) (int64, error) {
	if w.status == 0 {
		w.started(http.StatusOK)
	}
	if w.reading() {
		w.tee = readScanning{src, w}
		src = &w.tee
	}
	n, err := w.ResponseWriterWrapper.ReadFrom(src)
	w.failed = w.failed || err != nil
	return n, err
}

// reading reports whether a usage is read from the body.
func (w *statusWriter) reading() bool {
	for i := range w.scans {
		if w.scans[i].Reading() {
			return true
		}
	}
	return false
}

func (w *statusWriter) scan(p []byte) {
	for i := range w.scans {
		w.scans[i].Write(p)
	}
}

// readScanning reads from r, and has w's scans read what it read.
type readScanning struct {
	r io.Reader
	w *statusWriter
}

func (t *readScanning) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	t.w.scan(p[:n])
	return n, err
}
