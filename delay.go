// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
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

// delayConfig is the delay of a zone.
type delayConfig struct {
	// Let a request that finds too few tokens, but would have them within
	// this long, wait for them instead of being refused: it reserves its
	// tokens at once and goes on when they are there, so that a short
	// excess over the rate is smoothed rather than refused (nginx's
	// `limit_req ... delay`). A request that would wait longer is refused
	// as without a delay, and charged nothing; one whose client leaves
	// while it waits gets its tokens back. A request that several zones
	// delay waits the longest of their waits. A zone in dry run never
	// makes a request wait. A duration such as `2s`, at most 1h. Needs a
	// rate; not with ban. Default: no delay (refuse at once).
	Delay caddy.Duration `json:"delay,omitempty"`
}

// delayInfo is a zone's delay in the admin API.
type delayInfo struct {
	Delay string `json:"delay,omitempty"`
}

var delayKind = kind{
	in: func(z *Zone) bool { return z.Delay != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"delay": durationSub("2s", func(z *Zone) *caddy.Duration { return &z.Delay }, checkDelay),
	},
	check: func(z *Zone) error {
		switch {
		case z.Delay == 0:
			return nil
		case !z.hasRate():
			return errors.New("delay needs a rate: requests wait for the zone's tokens")
		}
		return checkDelay(time.Duration(z.Delay))
	},
	shape: func(z *Zone, l *gcra.Limit) error {
		l.Delay = time.Duration(z.Delay)
		return nil
	},
	join: func(h *Handler, z *Zone, st *zoneState) {
		if z.Delay != 0 {
			st.delayZone.Store(true)
		}
		// z.Delay rather than z.limit's: a zone whose limit comes with
		// each request (plans) has no limit of its own.
		h.anyDelay = h.anyDelay || z.Delay != 0 && !z.inDryRun
	},
	handlerSubdirectives: map[string]func(*caddyfile.Dispenser, *Handler) error{
		"max_delayed": func(d *caddyfile.Dispenser, h *Handler) error {
			var err error
			if h.MaxDelayed, err = intArg[int64](d); err != nil {
				return err
			}
			return wrapErr(d, checkMaxDelayed(h.MaxDelayed))
		},
	},
	checkHandler: (*Handler).checkMaxDelayedUse,
	provisionHandler: func(h *Handler) {
		h.waiting = new(atomic.Int64)
		h.maxDelayed = cmp.Or(h.MaxDelayed, defaultMaxDelayed)
	},
	descs:      []*prometheus.Desc{delayedDesc},
	collectors: []prometheus.Collector{delaySeconds},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, _ *prometheus.Desc, _ zoneID, s *zoneState) {
		if s.delayZone.Load() {
			counter(delayedDesc, &s.delayed, "served")
			counter(delayedDesc, &s.delayAbandoned, "abandoned")
			counter(delayedDesc, &s.delayRefused, "refused")
		}
	},
	meter: func(z *Zone) {
		if z.Delay != 0 {
			z.delays = delaySeconds.WithLabelValues(z.Name, z.id.limit)
		}
	},
	unmeter: func(z *Zone) {
		if z.delays != nil {
			delaySeconds.DeleteLabelValues(z.Name, z.id.limit)
		}
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if z.Delay == 0 {
			return
		}
		st := z.state
		info.Delay = time.Duration(z.Delay).String()
		info.Requests["delayed"] = st.delayed.Load()
		info.Requests["delay_abandoned"] = st.delayAbandoned.Load()
		info.Requests["delay_refused"] = st.delayRefused.Load()
	},
}

// delayHandler is what delay adds to the handler: its config field, and
// the requests that wait.
type delayHandler struct {
	// The most requests that wait at once in this handler for the tokens
	// of zones with delay. Beyond it, a request that would have to wait
	// is decided as if its zones had no delay (refused with 429 when its
	// tokens are short), so that a flood cannot pile up waiting requests.
	// Needs a zone with delay. Default: 10000.
	MaxDelayed int64 `json:"max_delayed,omitempty"`

	anyDelay bool // some zone, not in dry run, lets requests wait
	// waiting counts the requests that wait out a delay, or may (see
	// enterWaiting): at most maxDelayed.
	waiting    *atomic.Int64
	maxDelayed int64
}

// defaultMaxDelayed is max_delayed's default: enough for a busy server's
// short excesses, few enough goroutines and connections to hold.
const defaultMaxDelayed = 10_000

func checkMaxDelayed(n int64) error { return checkMin("max_delayed", n, 1) }

// checkMaxDelayedUse checks a max_delayed that is set, and that a zone has
// a delay for it to bound.
func (h *Handler) checkMaxDelayedUse() error {
	if h.MaxDelayed == 0 {
		return nil
	}
	if err := checkMaxDelayed(h.MaxDelayed); err != nil {
		return err
	}
	if !slices.ContainsFunc(h.Zones, func(z *Zone) bool { return z != nil && z.Delay != 0 }) {
		return errors.New("max_delayed needs a zone with delay: it bounds the requests waiting for one")
	}
	return nil
}

// delayCounts are what a zone with delay counts, in its state.
type delayCounts struct {
	delayed        atomic.Uint64 // waited for this zone's tokens (delay), then went on
	delayAbandoned atomic.Uint64 // waited, but the client left: tokens given back
	delayRefused   atomic.Uint64 // would have waited, but max_delayed requests waited already
	delayZone      atomic.Bool   // a zone of this name has a delay: export the three above
}

var (
	delayedDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "delayed_total"),
		"Requests a zone with delay let wait for its tokens, by how the wait ended: served (went on), abandoned (the client left; tokens given back) or refused (max_delayed requests waited already: 429).",
		[]string{"zone", "limit", "result"}, nil)

	delaySeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "delay_seconds",
		Help:      "Time requests waited for a zone's tokens (delay), by zone.",
		Buckets:   []float64{0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600},
	}, []string{"zone", "limit"})
)

// maxDelay bounds a zone's delay: a waiting request holds its connection
// and a goroutine, and a client rarely waits longer.
const maxDelay = time.Hour

func checkDelay(d time.Duration) error {
	if d <= 0 || d > maxDelay {
		return fmt.Errorf("invalid delay %v: must be positive and at most 1h", d)
	}
	return nil
}

// enterWaiting takes a place among the handler's waiting requests for a
// request that one of its zones may delay, before the store decides it,
// and reports whether it did. When max_delayed requests hold a place
// already, the request's zones decide it as if they had no delay.
func (h *Handler) enterWaiting(sc *scratch) bool {
	delays := false
	for i := range sc.d.Buckets {
		if h.delays(&sc.d.Buckets[i]) {
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
	for i := range sc.d.Buckets {
		if b := &sc.d.Buckets[i]; h.delays(b) {
			b.Limit.NoDelay = true
		}
	}
	return false
}

// delays reports whether b's zone may delay the request: it has a delay,
// and is not in dry run.
func (h *Handler) delays(b *store.BucketDemand) bool {
	return b.Limit.Delay > 0 && !h.Zones[b.Zone].inDryRun
}

// wait is a request's second stage, in a handler with a zone that may
// delay it, once the store decided it (out): it settles the request's
// place among the waiting requests, and an allowed request that must
// wait for its tokens waits. A request whose client left while it waited
// is gone.
func (h *Handler) wait(r *http.Request, sc *scratch, out outcome) outcome {
	h.noteDelay(sc, out)
	if sc.waiter && !h.await(r, sc) {
		return outcomeGone
	}
	return out
}

// noteDelay settles the request's place once it is decided: an allowed
// request that must wait keeps it, with sc.delay set; any other gives it
// back. It counts the requests refused only because max_delayed requests
// were waiting already.
func (h *Handler) noteDelay(sc *scratch, out outcome) {
	if sc.waiter && out == outcomeAllow {
		for i := range sc.d.Buckets {
			if b := &sc.d.Buckets[i]; !h.Zones[b.Zone].inDryRun {
				sc.delay = max(sc.delay, b.Delayed())
			}
		}
	}
	if sc.waiter && sc.delay == 0 {
		h.waiting.Add(-1)
		sc.waiter = false
	}
	// A request refused for its key's own burst (outcomeBadLimit) was
	// refused by the store first: it counts as refused here. One refused
	// before the store asked has no bucket that a full max_delayed
	// decided.
	if out != outcomeDeny && out != outcomeBadLimit {
		return
	}
	for i := range sc.d.Buckets {
		b := &sc.d.Buckets[i]
		l := b.Limit
		l.NoDelay = false
		if b.Limit.NoDelay && !b.OK && l.Wait(b.Debt, b.Cost) == 0 {
			h.Zones[b.Zone].state.delayRefused.Add(1)
		}
	}
}

// await is the stage that holds an allowed request until the tokens its
// zones reserved are there, and gives its place back. It reports false
// when the client left first: the tokens are then given back too.
func (h *Handler) await(r *http.Request, sc *scratch) bool {
	defer h.waiting.Add(-1)
	var top *store.BucketDemand
	for i := range sc.d.Buckets {
		b := &sc.d.Buckets[i]
		if d := b.Delayed(); d > 0 && h.delays(b) {
			if z := h.Zones[b.Zone]; z.delays != nil {
				z.delays.Observe(d.Seconds())
			}
			if top == nil || d > top.Delayed() {
				top = b
			}
		}
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit: request waits for its tokens"); c != nil && top != nil {
		fields := []zap.Field{zap.String("zone", h.Zones[top.Zone].Name), zap.Duration("delay", sc.delay), zap.String("remote_ip", clientIP(r))}
		if h.LogKey {
			fields = append(fields, zap.String("key", top.Key.String()))
		}
		c.Write(fields...)
	}

	// The tokens are there sc.delay after the store's answer, which
	// counts from sc.d.at: the time this request took to resume since
	// is not waited twice.
	timer := time.NewTimer(time.Until(sc.d.At.Add(sc.delay)))
	defer timer.Stop()
	select {
	case <-timer.C:
		h.countDelayed(sc, false)
		return true
	case <-r.Context().Done():
	}
	for i := range sc.matches {
		sc.matches[i].back = true
	}
	h.giveBack(context.WithoutCancel(r.Context()), time.Now(), sc, "rate limit: tokens not given back to a client that left while waiting")
	h.countDelayed(sc, true)
	return false
}

// countDelayed counts, in each zone that delayed the request, how its
// wait ended.
func (h *Handler) countDelayed(sc *scratch, abandoned bool) {
	for i := range sc.d.Buckets {
		if b := &sc.d.Buckets[i]; b.Delayed() > 0 && h.delays(b) {
			if st := h.Zones[b.Zone].state; abandoned {
				st.delayAbandoned.Add(1)
			} else {
				st.delayed.Add(1)
			}
		}
	}
}
