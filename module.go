// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package ratelimit is a Caddy HTTP handler that limits request rates with
// token buckets, kept in memory or shared through Redis.
package ratelimit

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler limits the rate of requests with token buckets.
//
// Each zone gives every distinct value of its key (by default the client
// IP) a bucket that holds up to `burst` tokens and refills at `rate`. A
// request takes `cost` tokens from the bucket of every zone whose matchers
// match it, and is allowed only if all of those buckets have the tokens; a
// request denied by one zone takes nothing from the others.
//
// A denied request ends the handler chain with a 429 Too Many Requests
// error, so `handle_errors` routes can shape the response, and a
// `Retry-After` header giving the whole seconds until it could succeed.
// (On a server without `handle_errors`, the handler writes the bare 429
// itself, the response Caddy would write for the error, but cheaper.)
// Allowed and denied responses carry rate-limit headers for the matched
// zones (see `headers`). A zone with `delay` may hold an allowed request
// until its tokens are there, at most that long, before it goes on.
//
// Placeholders set by this handler:
//
// Placeholder | Description
// ------------|-------------
// `{http.rate_limit.exceeded.name}` | The name of the zone that denied the request.
// `{http.rate_limit.exceeded.retry_after}` | The Retry-After value sent: seconds until the request could succeed.
type Handler struct {
	// The rate limit zones. A request is checked against every zone
	// whose matchers match it.
	Zones []*Zone `json:"zones,omitempty"`

	// Zones keyed by name, as github.com/mholt/caddy-ratelimit writes
	// them (`window`, `max_events`, `key`, `match`), so that its configs
	// load unchanged. They join Zones in the order of their names; a name
	// may not be in both.
	RateLimits map[string]*Zone `json:"rate_limits,omitempty"`

	// Where the buckets are kept. Default: `local` (in this process's
	// memory).
	StoreRaw json.RawMessage `json:"store,omitempty" caddy:"namespace=http.handlers.rate_limit.stores inline_key=backend"`

	// Which rate-limit response headers to send: `both` (default),
	// `legacy` (`X-RateLimit-Limit`, `X-RateLimit-Remaining`,
	// `X-RateLimit-Reset`), `ietf` (`RateLimit` and `RateLimit-Policy` from
	// draft-ietf-httpapi-ratelimit-headers-10) or `off`. `Retry-After` is
	// sent with every 429 regardless.
	Headers string `json:"headers,omitempty"`

	// Stretch each Retry-After by a random fraction of itself, up to this
	// much (e.g. 0.1 for up to 10% later), so that denied clients do not
	// all come back at once. Any fraction of at least 0; the added wait
	// is at most the time the zone's bucket takes to refill from empty.
	// Default: 0.
	Jitter float64 `json:"jitter,omitempty"`

	// Log the bucket key with denials. Keys often hold personal data
	// (IP addresses, API keys), so this is off by default.
	LogKey bool `json:"log_key,omitempty"`

	// Put every zone in dry run (see Zone.DryRun).
	DryRun bool `json:"dry_run,omitempty"`

	// The most requests that wait at once in this handler for the tokens
	// of zones with delay. Beyond it, a request that would have to wait
	// is decided as if its zones had no delay (refused with 429 when its
	// tokens are short), so that a flood cannot pile up waiting requests.
	// Needs a zone with delay. Default: 10000.
	MaxDelayed int64 `json:"max_delayed,omitempty"`

	// Do not export this handler's zones as Prometheus metrics.
	DisableMetrics bool `json:"disable_metrics,omitempty"`

	// Accepted for caddy-ratelimit's configs and ignored: buckets that
	// have refilled carry nothing and the store drops them by itself.
	SweepInterval caddy.Duration `json:"sweep_interval,omitempty"`

	// caddy-ratelimit's `distributed` and `storage` are refused with a
	// pointer to the Redis store, which shares limits exactly.
	Distributed json.RawMessage `json:"distributed,omitempty"`
	Storage     json.RawMessage `json:"storage,omitempty"`

	store      store
	failMode   failMode
	fallback   *LocalStore // decides when store fails, for fail_mode local
	keeper     slotKeeper  // the store, when it keeps the slots of zones with concurrency
	headerMode headerMode
	anyDryRun  bool // some zone is in dry run
	anyCount   bool // some zone counts only some responses
	anySlots   bool // some zone limits requests in flight
	anyDelay   bool // some zone, not in dry run, lets requests wait
	// waiting counts the requests that wait out a delay, or may (see
	// enterWaiting): at most maxDelayed.
	waiting    *atomic.Int64
	maxDelayed int64
	scratch    *sync.Pool
	logger     *zap.Logger
	// refundErrors throttles the warnings of refunds that failed.
	refundErrors *throttle.Throttle

	latency     prometheus.Observer // nil without metrics
	storeErrors prometheus.Counter  // nil without metrics
	storeName   string              // the store module's name
	ctx         caddy.Context       // for events
	events      *caddyevents.App
	states      []string     // names of the zone states acquired
	metered     []*zoneState // zone states this handler exports
	registered  bool         // in the admin API's registry
	// writeRefusals: the server has no error routes (handle_errors), so
	// 429s and fail_mode closed's 503s are written as Caddy would write
	// them, not returned: Caddy would log each 503 at ERROR, with the
	// request's headers.
	writeRefusals bool
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets up the handler.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger()
	if err := h.mergeRateLimits(); err != nil {
		return err
	}
	if err := h.Validate(); err != nil {
		return err
	}
	h.headerMode = headerModes[h.Headers]
	for i, z := range h.Zones {
		z.index = i
		if err := z.provision(ctx); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
		if z.keyKind == keyStatic {
			h.logger.Warn("zone key has no placeholders: all clients share one bucket",
				zap.String("zone", z.Name), zap.String("key", z.Key))
		}
		st, err := acquireZoneState(z.Name)
		if err != nil {
			return err
		}
		h.states = append(h.states, z.Name)
		z.state = st
		z.inDryRun = z.DryRun || h.DryRun
		h.anyDryRun = h.anyDryRun || z.inDryRun
		h.anyCount = h.anyCount || z.Count != nil
		h.anyDelay = h.anyDelay || z.limit.delay > 0 && !z.inDryRun
		if z.limit.delay > 0 {
			st.delayZone.Store(true)
		}
	}
	h.waiting = new(atomic.Int64)
	h.maxDelayed = cmp.Or(h.MaxDelayed, defaultMaxDelayed)

	if h.StoreRaw == nil {
		h.StoreRaw = json.RawMessage(`{"backend":"local"}`)
	}
	mod, err := ctx.LoadModule(h, "StoreRaw")
	if err != nil {
		return fmt.Errorf("loading store: %w", err)
	}
	st, ok := mod.(store)
	if !ok {
		return fmt.Errorf("module %T is not a rate_limit store", mod)
	}
	if err := st.bind(h.Zones); err != nil {
		return err
	}
	h.store = st
	if err := h.bindSlots(); err != nil {
		return err
	}
	if f, ok := st.(fallible); ok {
		h.failMode = f.failMode()
		if h.failMode == failLocal {
			h.fallback = &LocalStore{MaxKeys: defaultMaxKeys}
			if err := h.fallback.bind(h.Zones); err != nil {
				return err
			}
		}
	}

	h.storeName = mod.(caddy.Module).CaddyModule().ID.Name()
	if !h.DisableMetrics {
		if reg := ctx.GetMetricsRegistry(); reg != nil {
			if err := registerMetrics(reg); err != nil {
				return fmt.Errorf("registering metrics: %w", err)
			}
		}
		h.latency = storeLatency.WithLabelValues(h.storeName)
		h.storeErrors = storeErrors.WithLabelValues(h.storeName)
		for _, z := range h.Zones {
			z.state.metered.Add(1)
			h.metered = append(h.metered, z.state)
			if z.limit.delay > 0 {
				z.delays = delaySeconds.WithLabelValues(z.Name)
			}
		}
	}
	// Without error routes on the server, Caddy would answer the 429
	// error with the bare status: writing it here is the same response,
	// without the cost of Caddy's error handling on every denial.
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		h.writeRefusals = srv.Errors == nil || len(srv.Errors.Routes) == 0
	}
	// Events go to subscribers of a configured events app.
	if app, err := ctx.AppIfConfigured("events"); err == nil {
		h.events, _ = app.(*caddyevents.App)
	}

	n := len(h.Zones)
	h.refundErrors = new(throttle.Throttle)
	h.scratch = &sync.Pool{New: func() any { return &scratch{reqs: make([]request, 0, n)} }}
	registerHandler(h)
	h.registered = true
	return nil
}

// bindSlots gives the zones with concurrency their tables of requests in
// flight, which hold at most the local store's max_keys keys. A store
// that keeps slots itself (Redis) decides them; the tables then serve
// fail_mode local.
func (h *Handler) bindSlots() error {
	maxKeys := int64(defaultMaxKeys)
	if ls, ok := h.store.(*LocalStore); ok {
		maxKeys = ls.MaxKeys
	}
	for _, z := range h.Zones {
		if z.Concurrency == 0 {
			continue
		}
		z.slots = z.state.slotTable(maxKeys)
		h.anySlots = true
	}
	if k, ok := h.store.(slotKeeper); ok && h.anySlots {
		h.keeper = k
	}
	return nil
}

// Cleanup releases what Provision acquired; it copes with a partial
// Provision and runs once. Caddy calls it while the config's last
// requests may still run: it changes nothing that a request reads.
func (h *Handler) Cleanup() error {
	if h.registered {
		unregisterHandler(h)
		h.registered = false
	}
	for i, st := range h.metered {
		if st.metered.Add(-1) == 0 && i < len(h.Zones) && h.Zones[i].delays != nil {
			delaySeconds.DeleteLabelValues(h.Zones[i].Name) // the zone is gone
		}
	}
	h.metered = nil
	var errs []error
	for _, name := range h.states {
		if _, err := zoneStates.Delete(name); err != nil {
			errs = append(errs, err)
		}
	}
	h.states = nil
	if h.fallback != nil {
		// Requests of this config may still be running: they keep the
		// fallback, whose tables work on when they leave the pool.
		errs = append(errs, h.fallback.Cleanup())
	}
	return errors.Join(errs...)
}

// Validate checks the handler's configuration.
func (h *Handler) Validate() error {
	if err := h.mergeRateLimits(); err != nil {
		return err
	}
	if h.Distributed != nil {
		return errors.New(`'distributed' is a github.com/mholt/caddy-ratelimit option: use "store": {"backend": "redis", ...} to share limits between instances`)
	}
	if h.Storage != nil {
		return errors.New(`'storage' is a github.com/mholt/caddy-ratelimit option: use "store": {"backend": "redis", ...} to share limits between instances`)
	}
	if h.SweepInterval < 0 {
		return fmt.Errorf("invalid sweep_interval %s: must not be negative", time.Duration(h.SweepInterval))
	}
	if len(h.Zones) == 0 {
		return errors.New("no zones: at least one zone is required")
	}
	if err := h.checkMaxDelayedUse(); err != nil {
		return err
	}
	names := make(map[string]bool, len(h.Zones))
	for _, z := range h.Zones {
		if z == nil {
			return errors.New("zone is null")
		}
		if err := z.validate(); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
		if names[z.Name] {
			return fmt.Errorf("duplicate zone name '%s'", z.Name)
		}
		names[z.Name] = true
	}
	if h.Headers != "" {
		if err := checkHeaderMode(h.Headers); err != nil {
			return err
		}
	}
	return checkJitter(h.Jitter)
}

// The rules on configured values are each worded once, below and beside
// the fields they check. Validate applies them to the whole config (JSON
// users get them there), and the Caddyfile parsers to each subdirective
// as they read it, so that an error names its line.

func checkHeaderMode(s string) error {
	if _, ok := headerModes[s]; !ok {
		return fmt.Errorf("invalid headers '%s': expected both, legacy, ietf or off", s)
	}
	return nil
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

func checkJitter(f float64) error {
	if !(f >= 0) || math.IsInf(f, 0) {
		return fmt.Errorf("invalid jitter %v: must be a number of at least 0, such as 0.1 for up to 10%% longer", f)
	}
	return nil
}

// mergeRateLimits moves the zones of rate_limits into Zones, sorted by
// name. It is idempotent: Provision and Validate both call it.
func (h *Handler) mergeRateLimits() error {
	names := slices.Sorted(maps.Keys(h.RateLimits))
	for _, name := range names {
		z := h.RateLimits[name]
		if z == nil {
			return fmt.Errorf("rate_limits: zone %s is null", name)
		}
		if z.Name != "" && z.Name != name {
			return fmt.Errorf("rate_limits: zone %s has the name '%s': leave the name out, the key names it", name, z.Name)
		}
		if slices.ContainsFunc(h.Zones, func(o *Zone) bool { return o != nil && o.Name == name }) {
			return fmt.Errorf("zone %s is both in zones and in rate_limits", name)
		}
		z.Name = name
		h.Zones = append(h.Zones, z)
	}
	h.RateLimits = nil
	return nil
}

// checkMin checks that the value of a whole-number field is at least lo.
func checkMin[T ~int | ~int64](field string, n, lo T) error {
	if n < lo {
		return fmt.Errorf("invalid %s %d: must be at least %d", field, n, lo)
	}
	return nil
}

// checkRange checks that the value of a whole-number field is within
// [lo, hi].
func checkRange[T ~int | ~int64](field string, n, lo, hi T) error {
	if n < lo || n > hi {
		return fmt.Errorf("invalid %s %d: must be %d to %d", field, n, lo, hi)
	}
	return nil
}

// scratch is the per-request working memory, pooled per handler.
type scratch struct {
	reqs  []request
	retry []request // for dry runs
	top   *request  // the most constrained of reqs
	buf   []byte
	by    store // the store that charged reqs

	slots    []slot // the zones with concurrency that apply
	fullSlot *slot  // the one that had no slot free

	rec statusWriter // the response writer of a request that count applies to

	waiter bool          // holds a place among the handler's waiting requests
	delay  time.Duration // how long the allowed request waits for its tokens
}

// An outcome is how the decision on a request ends.
type outcome uint8

const (
	outcomeAllow      outcome = iota // every zone had the tokens, or only dry-run zones refused
	outcomeDeny                      // a zone refused: 429
	outcomeFailOpen                  // the store failed; fail_mode open lets the request through
	outcomeFailClosed                // the store failed; fail_mode closed answers 503
	outcomeFailed                    // the request cannot be decided: 500
	outcomeBadLimit                  // a zone has no valid limit for the request: 500, logged by the zone
	outcomeGone                      // the client left while the request waited out a delay
)

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	sc := h.scratch.Get().(*scratch)
	out, err := h.decide(w, r, sc)
	if sc.waiter && !h.await(r, sc) {
		out = outcomeGone
	}
	switch out {
	case outcomeDeny:
		if sc.fullSlot != nil {
			err = h.denySlot(w, r, sc.fullSlot)
		} else {
			err = h.deny(w, r, sc)
		}
	case outcomeFailClosed:
		w.Header()["Retry-After"] = []string{"1"}
		if h.writeRefusals {
			w.WriteHeader(http.StatusServiceUnavailable)
			err = nil
		}
	case outcomeBadLimit:
		// The zone logged the values once: Caddy would log every one.
		if h.writeRefusals {
			w.WriteHeader(http.StatusInternalServerError)
			err = nil
		}
	case outcomeGone:
		// Nobody reads the answer: 499 for the access log, as
		// reverse_proxy records a client that left.
		w.WriteHeader(499)
		err = nil
	}
	if len(sc.slots) > 0 {
		// The slots come back when the handlers return, however they
		// return: with an error, a panic, or a client gone.
		defer h.releaseSlots(r, sc)
		if out == outcomeAllow || out == outcomeFailOpen {
			if h.anyCount && sc.by != nil && counted(sc.reqs) {
				return h.serveCounted(w, r, next, sc)
			}
			return next.ServeHTTP(w, r)
		}
		return err
	}
	if out == outcomeAllow && h.anyCount && sc.by != nil && counted(sc.reqs) {
		err = h.serveCounted(w, r, next, sc)
		h.release(sc)
		return err
	}
	h.release(sc)
	if out == outcomeAllow || out == outcomeFailOpen {
		return next.ServeHTTP(w, r)
	}
	return err
}

// counted reports whether a zone with count applies to the request.
func counted(reqs []request) bool {
	for i := range reqs {
		if reqs[i].zone.Count != nil {
			return true
		}
	}
	return false
}

func (h *Handler) release(sc *scratch) {
	sc.reqs, sc.retry, sc.top, sc.by = sc.reqs[:0], sc.retry[:0], nil, nil
	sc.slots, sc.fullSlot = sc.slots[:0], nil
	sc.rec = statusWriter{}
	sc.waiter, sc.delay = false, 0
	h.scratch.Put(sc)
}

// releaseSlots gives back the slots the request took, and sc. The store's
// leases go back in one call before the response is done, so that the
// client's next request finds its slot free; the client may have gone,
// and a release that fails is covered by the lease.
func (h *Handler) releaseSlots(r *http.Request, sc *scratch) {
	leased := false
	for i := range sc.slots {
		q := &sc.slots[i]
		if q.table != nil {
			q.table.release(q.key)
			q.table = nil
		}
		leased = leased || q.lease != ""
	}
	if leased {
		if err := h.keeper.releaseSlots(context.WithoutCancel(r.Context()), sc.slots); err != nil {
			h.refundErrors.Warn(h.logger, "rate limit: slots not given back: they come back when their lease ends", err)
		}
		for i := range sc.slots {
			sc.slots[i].lease = ""
		}
	}
	h.release(sc)
}

// serveCounted serves an allowed request that zones with count were
// charged for, and gives those zones their tokens back when the response
// does not match. The status is the one written, or, when a later handler
// returns an error, the error's (as Caddy would answer it).
func (h *Handler) serveCounted(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, sc *scratch) error {
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
	back := sc.retry[:0]
	for _, q := range sc.reqs {
		if q.zone.Count != nil && q.ok && !q.wouldDeny && !q.zone.Count.Match(status, rec.Header()) {
			back = append(back, q)
		}
	}
	sc.retry = back
	if len(back) == 0 {
		return err
	}
	if rerr := sc.by.refund(r.Context(), time.Now(), back); rerr != nil {
		h.refundErrors.Warn(h.logger, "rate limit: tokens not given back after a response that count does not match", rerr)
	} else {
		for _, q := range back {
			q.zone.state.refunds.Add(1)
		}
	}
	return err
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

// decide takes tokens for r from the buckets of every matching zone, and
// sets the response headers. The error says why a request that failed
// cannot go on.
func (h *Handler) decide(w http.ResponseWriter, r *http.Request, sc *scratch) (outcome, error) {
	var now time.Time // read once, when needed
	for _, z := range h.Zones {
		if len(z.matcherSets) > 0 {
			match, err := z.matcherSets.AnyMatchWithError(r)
			if err != nil {
				return outcomeFailed, err
			}
			if !match {
				continue
			}
		}
		if k, ok := z.bucketKey(r); ok {
			if !z.rateless {
				q := request{zone: z, key: k}
				if z.plans != nil {
					if q.pl = z.planFor(r); q.pl == nil {
						return outcomeBadLimit, z.badLimit
					}
				}
				sc.reqs = append(sc.reqs, q)
			}
			if z.quota != nil {
				if now.IsZero() {
					now = time.Now()
				}
				// Right after the zone's bucket, if it has one.
				sc.reqs = append(sc.reqs, request{zone: z, key: k, win: z.quota.window(now)})
			}
			if z.slots != nil {
				sc.slots = append(sc.slots, slot{zone: z, key: k})
			}
		}
	}
	if len(sc.reqs) == 0 && len(sc.slots) == 0 {
		return outcomeAllow, nil
	}

	if now.IsZero() {
		now = time.Now()
	}
	out := outcomeAllow
	// shared: the store decides the slots with the buckets, in one call.
	var shared []slot
	if h.keeper != nil {
		shared = sc.slots
	}
	if len(sc.reqs) > 0 || len(shared) > 0 {
		if h.anyDelay {
			sc.waiter = h.enterWaiting(sc.reqs)
		}
		var by store
		var err error
		out, by, err = h.take(r.Context(), now, sc.reqs, shared)
		sc.by = by
		if out == outcomeDeny && h.anyDryRun && !(by == h.store && slotRefused(shared)) {
			out, err = h.shadow(r, now, sc, shared)
		}
		switch {
		case len(shared) > 0 && sc.by == h.store:
			if !h.noteSlots(r, sc) {
				out = outcomeDeny
			}
		case out == outcomeAllow && len(sc.slots) > 0 && !h.takeSlots(r, now, sc):
			// The local tables: the local store's, or fail_mode local's.
			out = outcomeDeny
		}
		if h.anyDelay {
			h.noteDelay(sc, out)
		}
		h.count(sc.reqs, out)
		if out != outcomeAllow && out != outcomeDeny {
			return out, err
		}
		if h.anyDryRun {
			h.noteDryRunPassed(r, sc.reqs)
		}
		if len(sc.reqs) > 0 {
			sc.top = mostConstrained(sc.reqs)
		}
	} else if !h.takeSlots(r, now, sc) {
		out = outcomeDeny
	}
	h.writeHeaders(w.Header(), now, sc, sc.top)
	return out, nil
}

// takeSlots takes a slot of every zone with concurrency that applies to
// the request, after the rate zones allowed it: all of them, or none.
// When a zone has no slot free, it gives back the slots taken and the
// tokens of sc.reqs, sets sc.fullSlot, and reports false. A zone in dry
// run lets the request go on without a slot.
func (h *Handler) takeSlots(r *http.Request, now time.Time, sc *scratch) bool {
	for i := range sc.slots {
		q := &sc.slots[i]
		free, ok := q.zone.slots.acquire(q.key, q.zone.Concurrency)
		q.free = free
		if ok {
			q.table = q.zone.slots
			continue
		}
		st := q.zone.state
		st.top.add(q.key)
		if q.zone.inDryRun {
			st.dryRunDenied.Add(1)
			if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
				repl.Set(q.zone.wouldDenyVar, true)
			}
			continue
		}
		st.denied.Add(1)
		sc.fullSlot = q
		for j := range i {
			if p := &sc.slots[j]; p.table != nil {
				p.table.release(p.key)
				p.table = nil
				p.free++
			}
		}
		h.refundForSlot(r, now, sc)
		return false
	}
	for i := range sc.slots {
		if q := &sc.slots[i]; q.table != nil {
			q.zone.state.allowed.Add(1)
		}
	}
	return true
}

// slotRefused reports whether a slotKeeper refused the request for want
// of a slot, in a zone not in dry run.
func slotRefused(slots []slot) bool {
	for i := range slots {
		if slots[i].full && !slots[i].zone.inDryRun {
			return true
		}
	}
	return false
}

// noteSlots counts what the store decided for the zones with concurrency,
// as takeSlots does for the local tables. When a zone had no slot free
// (and the buckets allowed the request), it sets sc.fullSlot and reports
// false.
func (h *Handler) noteSlots(r *http.Request, sc *scratch) bool {
	for i := range sc.slots {
		q := &sc.slots[i]
		st := q.zone.state
		switch {
		case q.lease != "":
			st.allowed.Add(1)
		case !q.full:
		case q.zone.inDryRun:
			st.top.add(q.key)
			st.dryRunDenied.Add(1)
			if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
				repl.Set(q.zone.wouldDenyVar, true)
			}
		case sc.fullSlot == nil:
			st.top.add(q.key)
			st.denied.Add(1)
			sc.fullSlot = q
		}
	}
	return sc.fullSlot == nil
}

// refundForSlot gives back the tokens the rate zones took for a request
// that a zone with concurrency then refused.
func (h *Handler) refundForSlot(r *http.Request, now time.Time, sc *scratch) {
	if sc.by == nil {
		return
	}
	back := sc.retry[:0]
	for _, q := range sc.reqs {
		if q.ok && !q.wouldDeny {
			back = append(back, q)
		}
	}
	sc.retry = back
	if len(back) == 0 {
		return
	}
	if err := sc.by.refund(r.Context(), now, back); err != nil {
		h.refundErrors.Warn(h.logger, "rate limit: tokens not given back after a zone with concurrency refused the request", err)
	}
	for i := range sc.reqs {
		if q := &sc.reqs[i]; q.ok && !q.wouldDeny {
			if q.win != nil {
				if q.used = max(q.used-q.zone.Cost, 0); q.used == 0 {
					q.debt = 0
				}
				continue
			}
			q.debt = max(q.debt-q.plan().costTime, 0)
		}
	}
}

// take asks the store, and applies fail_mode when the store fails. It
// returns the store that charged reqs, nil if none did. slots, for a
// store that keeps slots, are decided with reqs: when the store that
// charged reqs is h.store, it decided them too.
func (h *Handler) take(ctx context.Context, now time.Time, reqs []request, slots []slot) (outcome, store, error) {
	var allowed bool
	var err error
	if len(slots) > 0 {
		allowed, err = h.keeper.takeWithSlots(ctx, now, reqs, slots)
	} else {
		allowed, err = h.store.take(ctx, now, reqs)
	}
	if h.latency != nil {
		h.latency.Observe(time.Since(now).Seconds())
	}
	if err == nil {
		return verdict(allowed), h.store, nil
	}
	for i := range reqs {
		reqs[i].zone.state.storeErrors.Add(1)
	}
	if h.storeErrors != nil {
		h.storeErrors.Inc()
	}
	f, ok := h.store.(fallible)
	if !ok {
		for i := range reqs {
			reqs[i].ok = false
		}
		return outcomeFailed, nil, caddyhttp.HandlerError{StatusCode: http.StatusInternalServerError, Err: err}
	}
	switch h.failMode {
	case failLocal:
		for i := range reqs {
			h.fallback.owe(now, &reqs[i], f.known(now, &reqs[i], err))
		}
		if len(reqs) == 0 {
			return outcomeAllow, h.fallback, nil
		}
		allowed, err := h.fallback.take(ctx, now, reqs)
		return verdict(allowed), h.fallback, err
	case failOpen:
		for i := range reqs {
			reqs[i].ok, reqs[i].ban, reqs[i].debt = true, false, 0
		}
		return outcomeFailOpen, nil, nil
	default:
		for i := range reqs {
			reqs[i].ok, reqs[i].ban, reqs[i].debt = false, false, 0
		}
		return outcomeFailClosed, nil, caddyhttp.HandlerError{StatusCode: http.StatusServiceUnavailable, Err: err}
	}
}

// verdict is the outcome of a store's decision.
func verdict(allowed bool) outcome {
	if allowed {
		return outcomeAllow
	}
	return outcomeDeny
}

// count adds a request's outcome to its zones' counters. A request that
// the store failed on is counted as a store error (by take), and as what
// fail_mode decided when that was a decision: allowed by open, allowed or
// denied by the local buckets; closed refuses without deciding.
func (h *Handler) count(reqs []request, out outcome) {
	if out == outcomeFailClosed || out == outcomeFailed {
		return
	}
	allowed := out == outcomeAllow || out == outcomeFailOpen
	for i := range reqs {
		q := &reqs[i]
		st := q.zone.state
		if q.ban {
			st.bans.Add(1)
		}
		wouldDeny, ok := q.wouldDeny, q.ok
		if i+1 < len(reqs) && reqs[i+1].zone == q.zone {
			// A zone's bucket and its quota are one decision of the
			// zone: counted once, with the quota's request next.
			continue
		}
		if i > 0 && reqs[i-1].zone == q.zone {
			p := &reqs[i-1]
			wouldDeny, ok = p.wouldDeny || q.wouldDeny, p.ok && q.ok
		}
		switch {
		case wouldDeny:
			st.dryRunDenied.Add(1)
			st.top.add(q.key)
		case !ok:
			st.denied.Add(1)
			st.top.add(q.key)
		case allowed:
			st.allowed.Add(1)
		}
	}
}

// deny answers a request that a zone refused; sc.top is the most
// constrained of its zones. It returns the 429 error, or nil when it
// wrote the 429 itself.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, sc *scratch) error {
	q := sc.top
	z := q.zone
	wait := q.wait()
	if h.Jitter > 0 {
		// A client need never wait longer than a full refill beyond its
		// due: that also bounds a large jitter far from overflow.
		extra := float64(wait) * h.Jitter * rand.Float64()
		wait += time.Duration(min(extra, float64(q.plan().limit.burstTime)))
	}
	retryAfter := setRetryAfter(w.Header(), wait)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.rate_limit.exceeded.name", z.boxedName)
		repl.Set("http.rate_limit.exceeded.retry_after", retryAfter)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit exceeded"); c != nil {
		c.Write(h.logFields(r, q)...)
	}
	if h.events != nil && h.events.ShouldEmit(exceededEvent) {
		ban := false
		for i := range sc.reqs {
			ban = ban || sc.reqs[i].ban
		}
		h.events.Emit(h.ctx, exceededEvent, map[string]any{
			"zone":      z.Name,
			"wait":      wait,
			"remote_ip": clientIP(r),
			"ban":       ban,
		})
	}
	if h.writeRefusals {
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	return z.denial
}

// denySlot answers a request that a zone with concurrency refused: no
// slot was free. Retry-After is 1: a slot may be free at any moment.
func (h *Handler) denySlot(w http.ResponseWriter, r *http.Request, q *slot) error {
	z := q.zone
	retryAfter := setRetryAfter(w.Header(), time.Second)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.rate_limit.exceeded.name", z.boxedName)
		repl.Set("http.rate_limit.exceeded.retry_after", retryAfter)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit exceeded: no slot free"); c != nil {
		fields := []zap.Field{zap.String("zone", z.Name), zap.Int64("concurrency", z.Concurrency), zap.String("remote_ip", clientIP(r))}
		if h.LogKey {
			fields = append(fields, zap.String("key", q.key.String()))
		}
		c.Write(fields...)
	}
	if h.events != nil && h.events.ShouldEmit(exceededEvent) {
		h.events.Emit(h.ctx, exceededEvent, map[string]any{
			"zone":      z.Name,
			"wait":      time.Second,
			"remote_ip": clientIP(r),
			"ban":       false,
		})
	}
	if h.writeRefusals {
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	return z.denial
}

// exceededEvent is the Caddy event emitted when a request is denied, as
// github.com/mholt/caddy-ratelimit emits it.
const exceededEvent = "rate_limit_exceeded"

// logFields describe a denial: zone, wait and client, and the key only
// with log_key (keys can be personal data).
func (h *Handler) logFields(r *http.Request, q *request) []zap.Field {
	fields := []zap.Field{
		zap.String("zone", q.zone.Name),
		zap.Duration("wait", q.wait()),
		zap.String("remote_ip", clientIP(r)),
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", q.key.String()))
	}
	return fields
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
