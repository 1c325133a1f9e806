// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/adaptive"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Zones with `concurrency adaptive` (internal/adaptive has the controller): a
// request takes a place among its key's requests in flight before the
// store is asked for anything, so that a shed request spends no tokens
// in any zone and costs no store call; the place is given back, with the
// request's latency, when the handlers after this one return. A request
// that another zone refuses gives its place back without a latency. The
// places are this instance's own, whatever the store.

// adaptiveConfig is a zone's adaptive limit on requests in flight.
type adaptiveConfig struct {
	// Limit the requests of a key in flight to a number learnt from
	// their latency, within [min, max] (defaults 4 and 1000): as many as
	// the upstream serves without a queue building up. Beyond it, a
	// request is shed with 503 Service Unavailable and `Retry-After: 1`,
	// before any zone charges it. `{}` takes the defaults. The limit is
	// each instance's own, whatever the store (latency is an instance's
	// view). Not with a fixed concurrency or a lease. Default: none.
	ConcurrencyAdaptive *AdaptiveConcurrency `json:"concurrency_adaptive,omitempty"`
}

// adaptiveInfo is a zone's adaptive limit in the admin API, and
// adaptiveKeyView a key's.
type (
	adaptiveInfo struct {
		// The adaptive limit on requests in flight, its keys summed.
		Adaptive *adaptiveZoneInfo `json:"concurrency_adaptive,omitempty"`
	}
	adaptiveKeyView struct {
		Adaptive *adaptiveKeyInfo `json:"concurrency_adaptive,omitempty"`
	}
)

// adaptiveKind's subdirective is concurrency's (concurrency.go), which
// reads `concurrency adaptive` with unmarshalAdaptive.
var adaptiveKind = kind{
	in:    func(z *Zone) bool { return z.ConcurrencyAdaptive != nil },
	check: (*Zone).checkAdaptive,
	describe: func(z *Zone) string {
		if z.ConcurrencyAdaptive == nil {
			return ""
		}
		return z.ConcurrencyAdaptive.describe()
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if z.adaptive == nil {
			return
		}
		st := z.state
		info.Adaptive = z.adaptive.info(z.ConcurrencyAdaptive)
		info.Requests["shed"] = st.shed.Load()
		info.Requests["dry_run_shed"] = st.dryRunShed.Load()
	},
	view: func(_ context.Context, _ *Handler, z *Zone, k store.Key, _ *store.Demands, v *keyView) error {
		if z.adaptive != nil {
			v.Adaptive = z.adaptive.keyInfo(k)
		}
		return nil
	},
	forget: func(z *Zone, k store.Key) bool { return z.adaptive != nil && z.adaptive.forget(k) },
	join: func(h *Handler, z *Zone, st *zoneState) {
		if z.ConcurrencyAdaptive != nil {
			z.provisionAdaptive(st)
		}
	},
	descs:      []*prometheus.Desc{adaptiveDescs.limit, adaptiveDescs.inFlight, adaptiveDescs.noLoad, adaptiveDescs.classShed},
	collectors: []prometheus.Collector{adaptiveLatency},
	collect:    collectAdaptive,
	meter: func(z *Zone) {
		if z.adaptive != nil {
			z.adaptive.latency = adaptiveLatency.WithLabelValues(z.Name, z.id.limit)
		}
	},
	unmeter: func(z *Zone) {
		if z.adaptive != nil {
			adaptiveLatency.DeleteLabelValues(z.Name, z.id.limit)
		}
	},
}

// adaptiveCounts are what a zone's adaptive limit counts, in its state.
type adaptiveCounts struct {
	shed       atomic.Uint64                             // refused by this zone's adaptive limit: 503
	dryRunShed atomic.Uint64                             // would have been shed (dry run)
	adaptive   atomic.Pointer[adaptive.Table[store.Key]] // the keys of an adaptive limit; nil without
	classes    atomic.Pointer[classCounts]               // with priority: its sheds by class; nil without
}

// classCounts are the requests of each class of a zone with priority
// that its adaptive limit shed, or would have shed in dry run, from the
// highest class to the lowest. A zone's reserves are part of its limit
// (see describe), so the classes of a zone state never change.
type classCounts struct {
	names            []string // the reserves' classes, and lowestClass
	shed, dryRunShed []atomic.Uint64
}

func newClassCounts(a *AdaptiveConcurrency) *classCounts {
	c := &classCounts{shed: make([]atomic.Uint64, len(a.Reserve)+1), dryRunShed: make([]atomic.Uint64, len(a.Reserve)+1)}
	for _, r := range a.Reserve {
		c.names = append(c.names, r.Class)
	}
	c.names = append(c.names, lowestClass)
	return c
}

// AdaptiveConcurrency limits the requests of a key in flight to a number
// learnt from their latency: as many as the upstream serves without a
// queue building up, within [min, max]. Beyond it, requests are shed
// with 503 Service Unavailable and `Retry-After: 1`.
type AdaptiveConcurrency struct {
	// Never limit a key below this many requests in flight: a whole
	// number from 1 to 1000000. A new key starts here. Default: 4.
	Min int64 `json:"min,omitempty"`

	// Never let more than this many requests of a key be in flight: a
	// whole number from 1 to 1000000, at least min. Default: 1000, or
	// min when min is larger.
	Max int64 `json:"max,omitempty"`

	// The class of a request: placeholders, such as
	// `{http.request.header.X-Priority}`, whose expansion is a class that
	// reserve names, or any other value (or none) for the lowest class.
	// Required with reserve. Default: none, every request of one class.
	Priority string `json:"priority,omitempty"`

	// The classes above the lowest, from the highest down, each with the
	// share of the learnt limit held back for it and the classes above
	// it: a request is admitted while the requests in flight, whatever
	// their class, are below the limit less the reserves of the classes
	// above its own. So the highest class may use the whole limit, and
	// the lowest (`other`, every request that no reserve names) the
	// limit less every reserve. Each share is above 0% and below 100%,
	// and together below 100%; each class once. Required with priority.
	// Default: none.
	Reserve []AdaptiveReserve `json:"reserve,omitempty"`
}

// AdaptiveReserve is the share of an adaptive limit held back for a
// class and the classes above it.
type AdaptiveReserve struct {
	// The class, as the priority placeholders expand to it: not empty,
	// and not `other`, the name of the lowest class. Required.
	Class string `json:"class,omitempty"`

	// The share of the limit held back, in percent: above 0 and below
	// 100, fractions allowed. Required.
	Percent float64 `json:"percent,omitempty"`
}

// lowestClass names the lowest class of a zone with priority (the
// requests that no reserve names) in its metrics and admin views.
const lowestClass = "other"

const (
	defaultAdaptiveMin = 4
	defaultAdaptiveMax = 1000
	maxAdaptive        = 1_000_000
	// adaptiveLogEvery bounds the INFO lines of large changes of a zone's
	// limit: one per zone at most this often.
	adaptiveLogEvery = 10 * time.Second
)

// bounds are min and max, with their defaults.
func (a *AdaptiveConcurrency) bounds() (lo, hi int64) {
	lo, hi = a.Min, a.Max
	if lo == 0 {
		lo = defaultAdaptiveMin
	}
	if hi == 0 {
		hi = max(defaultAdaptiveMax, lo)
	}
	return lo, hi
}

func (a *AdaptiveConcurrency) check() error {
	lo, hi := a.bounds()
	if err := checkRange("concurrency adaptive min", lo, 1, maxAdaptive); err != nil {
		return err
	}
	if err := checkRange("concurrency adaptive max", hi, 1, maxAdaptive); err != nil {
		return err
	}
	if hi < lo {
		return fmt.Errorf("invalid concurrency adaptive max %d: must be at least min %d", hi, lo)
	}
	return checkClasses(a.Priority, a.Reserve)
}

// checkClasses checks a priority and its reserves: each alone, and
// together.
func checkClasses(priority string, reserves []AdaptiveReserve) error {
	if err := checkReserves(reserves); err != nil {
		return err
	}
	switch {
	case priority == "" && len(reserves) > 0:
		return errors.New("reserve needs priority: the placeholders that give a request its class")
	case priority != "" && len(reserves) == 0:
		return errors.New("priority needs a reserve: without one, every request is of one class")
	case priority != "" && !hasPlaceholders(priority):
		return fmt.Errorf("invalid priority '%s': must hold placeholders, such as {http.request.header.X-Priority}", priority)
	}
	return nil
}

// checkReserves checks each reserve, and the last against those before
// it: a class once, and the shares together below 100%.
func checkReserves(reserves []AdaptiveReserve) error {
	sum := 0.0
	for i, r := range reserves {
		switch {
		case r.Class == "":
			return errors.New("reserve needs a class")
		case r.Class == lowestClass:
			return fmt.Errorf("invalid reserve class '%s': it names the lowest class, which has no reserve", r.Class)
		case !(r.Percent > 0 && r.Percent < 100):
			return fmt.Errorf("invalid reserve %s %g%%: must be above 0%% and below 100%%", r.Class, r.Percent)
		}
		for _, before := range reserves[:i] {
			if before.Class == r.Class {
				return fmt.Errorf("class %s reserved twice", r.Class)
			}
		}
		if sum += r.Percent; sum >= 100 {
			return fmt.Errorf("reserves sum to %g%%: they must leave the lowest class part of the limit (below 100%%)", sum)
		}
	}
	return nil
}

// checkAdaptive checks what goes with concurrency adaptive in a zone.
func (z *Zone) checkAdaptive() error {
	if z.ConcurrencyAdaptive == nil {
		return nil
	}
	if z.Lease != 0 && z.Concurrency == 0 {
		return errors.New("lease needs a fixed concurrency: an adaptive limit is this instance's own, and holds no leases")
	}
	return z.ConcurrencyAdaptive.check()
}

// adaptiveOnly reports whether the zone limits nothing but requests in
// flight adaptively: it has no demand for the store.
func (z *Zone) adaptiveOnly() bool {
	return z.ConcurrencyAdaptive != nil && !z.charges() && z.Concurrency == 0
}

// unmarshalAdaptive reads `concurrency adaptive [{ min <n>; max <n> }]`.
// It reads nothing, and reports false, when the concurrency is a number.
func (z *Zone) unmarshalAdaptive(d *caddyfile.Dispenser) (bool, error) {
	if !d.NextArg() {
		return false, d.ArgErr()
	}
	if d.Val() != "adaptive" {
		d.Prev()
		return false, nil
	}
	if d.NextArg() {
		return true, d.ArgErr()
	}
	a := new(AdaptiveConcurrency)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := a.unmarshalSub(d); err != nil {
			return true, err
		}
	}
	z.ConcurrencyAdaptive = a
	if err := a.check(); err != nil {
		return true, d.WrapErr(err)
	}
	return true, nil
}

// unmarshalSub reads one subdirective of a `concurrency adaptive` block:
// `min <n>`, `max <n>`, `priority <placeholders>` or `reserve <class>
// <n>%`.
func (a *AdaptiveConcurrency) unmarshalSub(d *caddyfile.Dispenser) error {
	var n *int64
	sub := d.Val()
	switch sub {
	case "min":
		n = &a.Min
	case "max":
		n = &a.Max
	case "priority":
		return priorityArg(d, &a.Priority)
	case "reserve":
		return reserveArg(d, &a.Reserve)
	default:
		return d.Errf("unrecognized concurrency adaptive subdirective '%s': expected min, max, priority or reserve", sub)
	}
	var err error
	if *n, err = intArg[int64](d); err != nil {
		return err
	}
	return wrapErr(d, checkRange("concurrency adaptive "+sub, *n, 1, maxAdaptive))
}

// priorityArg reads `priority <placeholders>` into priority, once.
func priorityArg(d *caddyfile.Dispenser, priority *string) error {
	if *priority != "" {
		return d.Err("priority already specified")
	}
	if !d.AllArgs(priority) {
		return d.ArgErr()
	}
	return nil
}

// reserveArg reads `reserve <class> <n>%` into reserves, and checks it
// against those before it.
func reserveArg(d *caddyfile.Dispenser, reserves *[]AdaptiveReserve) error {
	var class, percent string
	if !d.AllArgs(&class, &percent) {
		return d.ArgErr()
	}
	p, err := parsePercent(percent)
	if err != nil {
		return d.Errf("invalid reserve '%s': %v", percent, err)
	}
	*reserves = append(*reserves, AdaptiveReserve{Class: class, Percent: p})
	return wrapErr(d, checkReserves(*reserves))
}

// parsePercent reads a percentage such as `20%` or `12.5%`.
func parsePercent(s string) (float64, error) {
	num, ok := strings.CutSuffix(s, "%")
	if !ok {
		return 0, errors.New("a percentage, such as 20%")
	}
	p, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(p) || math.IsInf(p, 0) {
		return 0, errors.New("a percentage, such as 20%")
	}
	return p, nil
}

// adaptiveZone is a zone's adaptive limit at run time.
type adaptiveZone struct {
	table   *adaptive.Table[store.Key] // the keys, shared by the zones of its name and limit
	shed    error                      // the caddyhttp.HandlerError of a shed request
	latency prometheus.Observer

	// With priority: its classes, and the counts of the zone state.
	priorityClasses
	classes *classCounts
}

// priorityClasses are the classes of a zone's requests: those that
// reserves name, from the highest (a request of none is of the lowest,
// len(reserved)), the priority template, and its header when it is
// exactly one request header. reserved is nil without priority.
type priorityClasses struct {
	reserved []string
	priority string
	header   string
}

// newPriorityClasses are the classes of priority, of which names are
// the reserves' and the lowest's.
func newPriorityClasses(priority string, names []string) priorityClasses {
	c := priorityClasses{reserved: names[:len(names)-1], priority: priority}
	if kind, field := keyKindOf(priority); kind == keyHeader {
		c.header = field
	}
	return c
}

// provisionAdaptive gives an adaptive zone its keys: those of the zone
// state, which zones of one name and limit share across reloads.
func (z *Zone) provisionAdaptive(st *zoneState) {
	a := z.ConcurrencyAdaptive
	lo, hi := a.bounds()
	reserves := make([]float64, len(a.Reserve))
	for i, r := range a.Reserve {
		reserves[i] = r.Percent / 100
	}
	st.adaptive.CompareAndSwap(nil, adaptive.NewTable[store.Key](lo, hi, reserves...))
	z.adaptive = &adaptiveZone{
		table: st.adaptive.Load(),
		shed: caddyhttp.HandlerError{
			StatusCode: http.StatusServiceUnavailable,
			Err:        fmt.Errorf("rate limit: load shed in zone %s", z.Name),
		},
	}
	if a.Priority == "" {
		return
	}
	st.classes.CompareAndSwap(nil, newClassCounts(a))
	za := z.adaptive
	za.classes = st.classes.Load()
	za.priorityClasses = newPriorityClasses(a.Priority, za.classes.names)
}

// classOf is r's class in the zone: the place of the reserve that names
// what the priority expands to, from the highest; the lowest class when
// none does. 0 without priority.
func (a *priorityClasses) classOf(r *http.Request) int {
	if a.reserved == nil {
		return 0
	}
	var s string
	if a.header != "" {
		s = strings.Join(r.Header[a.header], ",") // as the replacer expands it
	} else if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		s = repl.ReplaceAll(a.priority, "")
	}
	for i, c := range a.reserved {
		if c == s {
			return i
		}
	}
	return len(a.reserved)
}

// countShed counts a request of class that the zone shed, or, in dry
// run, would have shed.
func (a *adaptiveZone) countShed(st *zoneState, class int, dryRun bool) {
	c := a.classes
	switch {
	case dryRun:
		st.dryRunShed.Add(1)
		if c != nil {
			c.dryRunShed[class].Add(1)
		}
	default:
		st.shed.Add(1)
		if c != nil {
			c.shed[class].Add(1)
		}
	}
}

// describe is the adaptive limit in words, for Zone.describe: its
// reserves too, so that zones of other reserves share no keys (whose
// requests in flight are counted by class) nor counts of classes.
func (a *AdaptiveConcurrency) describe() string {
	lo, hi := a.bounds()
	s := fmt.Sprintf("concurrency adaptive %d-%d", lo, hi)
	if len(a.Reserve) > 0 {
		s += " reserve"
	}
	for _, r := range a.Reserve {
		s += " " + r.Class + " " + strconv.FormatFloat(r.Percent, 'g', -1, 64) + "%"
	}
	return s
}

// adaptiveScratch is a request's places in zones with an adaptive limit.
type adaptiveScratch struct {
	p    []adaptivePlace
	shed *adaptivePlace  // the place refused, in a zone not in dry run
	held bool            // the request holds a place
	kind adaptive.Sample // what its response says
	lat  time.Duration
	rec  statusWriter
}

// An adaptivePlace is a request's place in one zone.
type adaptivePlace struct {
	zone int
	key  store.Key
	k    *adaptive.Key
	tk   adaptive.Ticket
	held bool
	// wouldShed: the zone is in dry run and had no place: the request
	// goes on without one.
	wouldShed bool
}

func (a *adaptiveScratch) add(zone int, key store.Key) {
	a.p = append(a.p, adaptivePlace{zone: zone, key: key})
}

// admitAdaptive takes the request's places, before any store is asked:
// all of them, or, when a zone not in dry run has none free, none
// (outcomeShed). A dry-run zone without a place counts it and lets the
// request go on.
func (h *Handler) admitAdaptive(r *http.Request, now time.Time, sc *scratch) outcome {
	if now.IsZero() {
		now = time.Now()
	}
	a := &sc.adaptive
	for i := range a.p {
		p := &a.p[i]
		z := h.Zones[p.zone]
		class := z.adaptive.classOf(r)
		if p.k = z.adaptive.table.Key(p.key, now); p.k != nil {
			p.tk, p.held = p.k.Admit(now, class)
		}
		a.held = a.held || p.held
		switch {
		case p.held:
		case z.inDryRun:
			p.wouldShed = true
			z.adaptive.countShed(z.state, class, true)
			h.noteDryRunSlot(r, z)
		default:
			z.adaptive.countShed(z.state, class, false)
			a.shed = p
			return outcomeShed
		}
	}
	if h.anyDryRun {
		h.noteAdaptivePassed(r, a)
	}
	return outcomeAllow
}

// noteAdaptivePassed sets the would_deny placeholder of the adaptive
// zones in dry run alone that had a place for r.
func (h *Handler) noteAdaptivePassed(r *http.Request, a *adaptiveScratch) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	for _, p := range a.p {
		if z := h.Zones[p.zone]; z.inDryRun && z.adaptiveOnly() && !p.wouldShed {
			repl.Set(z.wouldDenyVar, false)
		}
	}
}

// wouldShed reports whether the request would have been shed by zone,
// in dry run.
func (a *adaptiveScratch) wouldShed(zone int) bool {
	for _, p := range a.p {
		if p.zone == zone && p.wouldShed {
			return true
		}
	}
	return false
}

// serveAdaptive serves a request that holds places, and notes what its
// response tells the controllers: its latency from here to the end of
// the response, and whether it failed (a 5xx, or an error without a
// status), its client left, or it switched protocols (no latency).
func (h *Handler) serveAdaptive(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, sc *scratch) error {
	a := &sc.adaptive
	for _, p := range a.p {
		if z := h.Zones[p.zone]; p.held && z.adaptiveOnly() {
			z.state.allowed.Add(1)
		}
	}
	rec := &a.rec
	rec.ResponseWriter, rec.status = w, 0
	start := time.Now()
	err := h.serve(rec, r, next, sc)
	a.lat = time.Since(start)
	status := rec.status
	if err != nil {
		status = http.StatusInternalServerError
		if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
			status = he.StatusCode
		}
	}
	switch {
	case r.Context().Err() != nil:
		a.kind = adaptive.SampleGone
	case status >= 500:
		a.kind = adaptive.SampleError
	case status == http.StatusSwitchingProtocols:
		a.kind = adaptive.SampleNone
	default:
		a.kind = adaptive.SampleOK
	}
	return err
}

// releaseAdaptive gives the request's places back, with what its
// response said if it was served, and clears them.
func (h *Handler) releaseAdaptive(sc *scratch) {
	a := &sc.adaptive
	if a.held {
		now := time.Now()
		for i := range a.p {
			if p := &a.p[i]; p.held {
				h.releasePlace(p, a.kind, a.lat, now)
			}
		}
	}
	a.p, a.shed, a.held, a.kind, a.lat = a.p[:0], nil, false, adaptive.SampleNone, 0
	a.rec = statusWriter{}
}

func (h *Handler) releasePlace(p *adaptivePlace, kind adaptive.Sample, lat time.Duration, now time.Time) {
	z := h.Zones[p.zone]
	if obs := z.adaptive.latency; obs != nil && (kind == adaptive.SampleOK || kind == adaptive.SampleError) {
		obs.Observe(lat.Seconds())
	}
	ch, changed := p.k.Release(now, p.tk, kind, lat)
	if !changed {
		return
	}
	if _, ok := z.adaptive.table.Logged.Allow(adaptiveLogEvery); !ok {
		return
	}
	fields := []zap.Field{
		zap.String("zone", z.Name), zap.Int64("limit", ch.To), zap.Int64("previous", ch.From),
		zap.Duration("latency", ch.Latency), zap.Duration("no_load_latency", ch.NoLoad),
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", p.key.String()))
	}
	h.logger.Info("adaptive concurrency limit changed", fields...)
}

// shedAdaptive answers a request that an adaptive zone shed: 503 with
// Retry-After: 1, as an error for handle_errors. The upstream is busy,
// which is not the client's doing.
func (h *Handler) shedAdaptive(w http.ResponseWriter, r *http.Request, sc *scratch) error {
	p := sc.adaptive.shed
	return h.refuseInFlight(w, r, h.Zones[p.zone], p.key, true)
}

// adaptiveLatency observes the latencies the adaptive limits learn from.
var adaptiveLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
	Namespace: metricsNamespace,
	Subsystem: metricsSubsystem,
	Name:      "adaptive_latency_seconds",
	Help:      "Latency of the requests an adaptive concurrency limit admitted, from when they go on to the next handler to the end of the response, by zone.",
	Buckets:   []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
}, []string{"zone", "limit"})

// adaptiveDescs are the gauges of the adaptive limits, and the sheds by
// class of those with priority, read at scrape.
var adaptiveDescs = struct{ limit, inFlight, noLoad, classShed *prometheus.Desc }{
	limit: prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "adaptive_limit"),
		"The adaptive concurrency limits of a zone, summed over its keys.", []string{"zone", "limit"}, nil),
	inFlight: prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "adaptive_in_flight"),
		"Requests in flight under a zone's adaptive concurrency limits, summed over its keys.", []string{"zone", "limit"}, nil),
	noLoad: prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "adaptive_no_load_latency_seconds"),
		"The latency without a queue that a zone's adaptive limits measured, averaged over its keys.", []string{"zone", "limit"}, nil),
	classShed: prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "adaptive_shed_total"),
		"Requests that a zone's adaptive concurrency limit with priority shed (shed), or would have shed in dry run (dry_run_shed), by class: a class of a reserve, or other.",
		[]string{"zone", "limit", "class", "result"}, nil),
}

// collectAdaptive exports what a zone with an adaptive limit counts.
func collectAdaptive(ch chan<- prometheus.Metric, _ counterFunc, requests *prometheus.Desc, id zoneID, s *zoneState) {
	t := s.adaptive.Load()
	if t == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(requests, prometheus.CounterValue, float64(s.shed.Load()), id.name, id.limit, "shed")
	ch <- prometheus.MustNewConstMetric(requests, prometheus.CounterValue, float64(s.dryRunShed.Load()), id.name, id.limit, "dry_run_shed")
	tot := t.Totals()
	ch <- prometheus.MustNewConstMetric(adaptiveDescs.limit, prometheus.GaugeValue, float64(tot.Limit), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(adaptiveDescs.inFlight, prometheus.GaugeValue, float64(tot.InFlight), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(adaptiveDescs.noLoad, prometheus.GaugeValue, tot.NoLoad.Seconds(), id.name, id.limit)
	if c := s.classes.Load(); c != nil {
		for i, name := range c.names {
			ch <- prometheus.MustNewConstMetric(adaptiveDescs.classShed, prometheus.CounterValue, float64(c.shed[i].Load()), id.name, id.limit, name, "shed")
			ch <- prometheus.MustNewConstMetric(adaptiveDescs.classShed, prometheus.CounterValue, float64(c.dryRunShed[i].Load()), id.name, id.limit, name, "dry_run_shed")
		}
	}
}

// adaptiveZoneInfo describes a zone's adaptive limit in the admin API.
type adaptiveZoneInfo struct {
	Min int64 `json:"min"`
	Max int64 `json:"max"`
	// The keys with a limit, and their limits and requests in flight,
	// summed.
	Keys     int   `json:"keys"`
	Limit    int64 `json:"limit"`
	InFlight int64 `json:"in_flight"`
	// With priority: the template, and the classes from the highest,
	// each with its reserve and the requests shed.
	Priority string          `json:"priority,omitempty"`
	Classes  []classZoneInfo `json:"classes,omitempty"`
}

// classZoneInfo describes a class of a zone with priority.
type classZoneInfo struct {
	Class      string  `json:"class"`
	Reserve    float64 `json:"reserve_percent"` // 0 for the lowest
	Shed       uint64  `json:"shed"`
	DryRunShed uint64  `json:"dry_run_shed"`
}

func (a *adaptiveZone) info(cfg *AdaptiveConcurrency) *adaptiveZoneInfo {
	tot := a.table.Totals()
	info := &adaptiveZoneInfo{Min: a.table.Min, Max: a.table.Max, Keys: tot.Keys, Limit: tot.Limit, InFlight: tot.InFlight}
	if c := a.classes; c != nil {
		info.Priority = a.priority
		for i, name := range c.names {
			ci := classZoneInfo{Class: name, Shed: c.shed[i].Load(), DryRunShed: c.dryRunShed[i].Load()}
			if i < len(cfg.Reserve) {
				ci.Reserve = cfg.Reserve[i].Percent
			}
			info.Classes = append(info.Classes, ci)
		}
	}
	return info
}

// adaptiveKeyInfo describes a key's adaptive limit in the admin API; a
// key without one is shown as it would start.
type adaptiveKeyInfo struct {
	Limit    int64 `json:"limit"`
	InFlight int64 `json:"in_flight"`
	// The median latency of the last interval, and the latency without a
	// queue, in seconds; 0 until measured.
	Latency       float64 `json:"latency"`
	NoLoadLatency float64 `json:"no_load_latency"`
	Probing       bool    `json:"probing,omitempty"`
	// With priority: the requests in flight of each class, from the
	// highest.
	Classes []classKeyInfo `json:"classes,omitempty"`
}

// classKeyInfo is a class's requests in flight under a key's limit.
type classKeyInfo struct {
	Class    string `json:"class"`
	InFlight int64  `json:"in_flight"`
}

func (a *adaptiveZone) keyInfo(key store.Key) *adaptiveKeyInfo {
	st := adaptive.State{Limit: a.table.Min}
	var byClass []int64
	if k := a.table.Lookup(key); k != nil {
		st, byClass = k.State(), k.InFlightByClass(nil)
	}
	info := &adaptiveKeyInfo{Limit: st.Limit, InFlight: st.InFlight, Latency: st.Latency.Seconds(),
		NoLoadLatency: st.NoLoad.Seconds(), Probing: st.Probing}
	if c := a.classes; c != nil {
		for i, name := range c.names {
			ci := classKeyInfo{Class: name}
			if i < len(byClass) {
				ci.InFlight = byClass[i]
			}
			info.Classes = append(info.Classes, ci)
		}
	}
	return info
}

// forget starts the key's learning again (the admin API's DELETE), and
// reports whether it had learnt anything.
func (a *adaptiveZone) forget(key store.Key) bool {
	k := a.table.Lookup(key)
	if k == nil {
		return false
	}
	k.Forget()
	return true
}
