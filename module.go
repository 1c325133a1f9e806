// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package ratelimit is a Caddy HTTP handler that limits request rates with
// token buckets, kept in memory or shared through Redis.
package ratelimit

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
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
// A gRPC request is refused in gRPC's form instead (see `grpc_status`).
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
// `{http.rate_limit.json.<path>}` | The value at a path of object keys, separated by dots, in the request's JSON body: a string unescaped, a number as written, `true` or `false`; `-` when there is none (see NoJSONValue). Set before the decision, for the paths the zones' config names.
type Handler struct {
	// The rate limit zones. A request is checked against every zone
	// whose matchers match it. Required: at least one zone, here or in
	// `rate_limits`.
	Zones []*Zone `json:"zones,omitempty"`

	// Zones keyed by name, as github.com/mholt/caddy-ratelimit writes
	// them (`window`, `max_events`, `key`, `match`), so that its configs
	// load unchanged. They join `zones` in the order of their names; a
	// name may not be in both. Default: none.
	RateLimits map[string]*Zone `json:"rate_limits,omitempty"`

	// Where the buckets are kept: a store module, named by `backend`,
	// such as `{"backend": "redis", "addresses": ["10.0.0.5:6379"]}`.
	// Default: `local` (in this process's memory).
	StoreRaw json.RawMessage `json:"store,omitempty" caddy:"namespace=http.handlers.rate_limit.stores inline_key=backend"`

	// Which rate-limit response headers to send: `both`, `legacy`
	// (`X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`),
	// `ietf` (`RateLimit` and `RateLimit-Policy` from
	// draft-ietf-httpapi-ratelimit-headers-10) or `off`. `Retry-After` is
	// sent with every 429 regardless. Default: `both`.
	Headers string `json:"headers,omitempty"`

	// Stretch each Retry-After by a random fraction of itself, up to this
	// much (e.g. 0.1 for up to 10% later), so that denied clients do not
	// all come back at once. Any fraction of at least 0; the added wait
	// is at most the time the zone's bucket takes to refill from empty.
	// Default: 0.
	Jitter float64 `json:"jitter,omitempty"`

	// How a refused gRPC request (Content-Type `application/grpc` or
	// `application/grpc+...`) is answered: in gRPC's form, a
	// Trailers-Only response with `grpc-status`, `grpc-message`,
	// `grpc-retry-pushback-ms` and `google.rpc.RetryInfo`, whose code for
	// a 429 is `resource_exhausted` (8) or `unavailable` (14, for retry
	// policies that retry only that); a 503 is always `unavailable`. `off`
	// answers gRPC requests as any other. gRPC refusals are written by
	// the handler, never passed to `handle_errors`. gRPC-Web requests get
	// the plain HTTP refusal. Default: `resource_exhausted`.
	GRPCStatus string `json:"grpc_status,omitempty"`

	// Log the bucket key with denials. Keys often hold personal data
	// (IP addresses, API keys). Default: false.
	LogKey bool `json:"log_key,omitempty"`

	// Put every zone in dry run, as a zone's `dry_run` does: decisions
	// are computed, counted, logged and sent as headers, but no request
	// is refused. Default: false.
	DryRun bool `json:"dry_run,omitempty"`

	// What the kinds add to the handler (see kinds.go).
	delayHandler

	// Do not export this handler's zones as Prometheus metrics. The admin
	// API still shows them. Default: false.
	DisableMetrics bool `json:"disable_metrics,omitempty"`

	// Accepted for caddy-ratelimit's configs and ignored: buckets that
	// have refilled carry nothing and the store drops them by itself. A
	// duration, at least 0. Default: none (there is no sweep to time).
	SweepInterval caddy.Duration `json:"sweep_interval,omitempty"`

	// The option of github.com/mholt/caddy-ratelimit that shares limits
	// through Caddy's storage. Refused, with a pointer to the Redis
	// store, which shares limits exactly.
	Distributed json.RawMessage `json:"distributed,omitempty"`

	// The storage of caddy-ratelimit's `distributed`. Refused, with a
	// pointer to the Redis store.
	Storage json.RawMessage `json:"storage,omitempty"`

	store      store.Store  // the store module's engine, which decides the zones' demands
	holds      store.Holder // store, when its requests hold it; nil otherwise
	failMode   store.FailMode
	fallback   store.Store // decides when store fails, for fail_mode local
	fallbackOf *LocalStore // fallback's module, for its Cleanup
	headerMode headerMode
	anyDryRun  bool // some zone is in dry run
	anySettle  bool // some zone settles after the response: count, usage
	scratch    *sync.Pool
	logger     *zap.Logger
	// refundErrors throttles the warnings of refunds that failed.
	refundErrors *throttle.Throttle
	// jsonVars are the placeholders of the request's JSON body that the
	// zones name: set before each request's decision.
	jsonVars []jsonVar

	latency     prometheus.Observer // nil without metrics
	storeErrors prometheus.Counter  // nil without metrics
	storeName   string              // the store module's name
	ctx         caddy.Context       // for events
	events      *caddyevents.App
	states      []zoneID     // the zone states acquired
	metered     []*zoneState // zone states this handler exports
	registered  bool         // in the admin API's registry
	// writeRefusals: the server has no error routes (handle_errors), so
	// 429s and fail_mode closed's 503s are written as Caddy would write
	// them, not returned: Caddy would log each 503 at ERROR, with the
	// request's headers.
	writeRefusals bool
	// grpcCode is the gRPC code of a 429 for a gRPC request, 0 for
	// none: grpc_status off.
	grpcCode int
}

// A storeModule is a store's Caddy module: it binds the handler's zones,
// and gives the engine that decides their demands.
type storeModule interface {
	caddy.Module
	// bind makes the store's engine for zones (a demand's zone is its
	// place in zones). It is called once, from the handler's Provision,
	// after the store's own.
	bind(zones []store.ZoneSpec) (store.Store, error)
}

// storeBackend is the name of the handler's store module: the one it
// loaded, or the one its config names ("local" when it names none).
func (h *Handler) storeBackend() string {
	if h.storeName != "" {
		return h.storeName
	}
	var raw struct {
		Backend string `json:"backend"`
	}
	if h.StoreRaw != nil {
		_ = json.Unmarshal(h.StoreRaw, &raw) // a bad store fails when it loads
	}
	return cmp.Or(raw.Backend, "local")
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
	var err error
	if h.jsonVars, err = jsonVarsOf(h.Zones); err != nil {
		return err
	}
	h.headerMode = headerModes[h.Headers]
	h.grpcCode = grpcStatuses[cmp.Or(h.GRPCStatus, "resource_exhausted")]
	if err := h.provisionZones(ctx); err != nil {
		return err
	}
	if err := h.provisionStore(ctx); err != nil {
		return err
	}
	if err := h.provisionMetrics(ctx); err != nil {
		return err
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
	for _, k := range kinds {
		if k.provisionHandler != nil {
			k.provisionHandler(h)
		}
	}
	h.refundErrors = new(throttle.Throttle)
	n := len(h.Zones)
	h.scratch = &sync.Pool{New: func() any { return newScratch(n) }}
	registerHandler(h)
	h.registered = true
	return nil
}

// provisionZones provisions each zone and acquires its counters.
func (h *Handler) provisionZones(ctx caddy.Context) error {
	for i, z := range h.Zones {
		z.index = i
		if err := z.provision(ctx); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
		if z.keyKind == keyStatic && !z.adaptiveOnly() { // one limit for all is what adaptive is for
			h.logger.Warn("zone key has no placeholders: all clients share one bucket",
				zap.String("zone", z.Name), zap.String("key", z.Key))
		}
		z.id = zoneID{z.Name, z.describe()}
		st, err := acquireZoneState(z.id)
		if err != nil {
			return err
		}
		h.states = append(h.states, z.id)
		z.state = st
		z.inDryRun = z.DryRun || h.DryRun
		h.anyDryRun = h.anyDryRun || z.inDryRun
		h.anySettle = h.anySettle || z.Count != nil || z.Usage != nil
		for _, k := range kinds {
			if k.join != nil {
				k.join(h, z, st)
			}
		}
	}
	return nil
}

// provisionStore loads the store, binds it to the zones, and makes the
// local buckets that decide when it fails, for fail_mode local.
func (h *Handler) provisionStore(ctx caddy.Context) error {
	if h.StoreRaw == nil {
		h.StoreRaw = json.RawMessage(`{"backend":"local"}`)
	}
	mod, err := ctx.LoadModule(h, "StoreRaw")
	if err != nil {
		return fmt.Errorf("loading store: %w", err)
	}
	sm, ok := mod.(storeModule)
	if !ok {
		return fmt.Errorf("module %T is not a rate_limit store", mod)
	}
	h.storeName = sm.CaddyModule().ID.Name()
	specs := make([]store.ZoneSpec, len(h.Zones))
	for i, z := range h.Zones {
		specs[i] = z.spec()
	}
	st, err := sm.bind(specs)
	if err != nil {
		return err
	}
	h.store = st
	h.holds, _ = st.(store.Holder)
	if f, ok := st.(store.Fallible); ok {
		h.failMode = f.FailureMode()
		if h.failMode == store.FailLocal {
			h.fallbackOf = &LocalStore{MaxKeys: defaultMaxKeys}
			fb, err := h.fallbackOf.engine(specs)
			if err != nil {
				return err
			}
			h.fallback = fb
		}
	}
	return nil
}

// provisionMetrics registers the collectors in the config's registry.
func (h *Handler) provisionMetrics(ctx caddy.Context) error {
	if h.DisableMetrics {
		return nil
	}
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
		for _, k := range kinds {
			if k.meter != nil {
				k.meter(z)
			}
		}
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
		if st.metered.Add(-1) != 0 || i >= len(h.Zones) {
			continue
		}
		for _, k := range kinds { // the zone is gone
			if k.unmeter != nil {
				k.unmeter(h.Zones[i])
			}
		}
	}
	h.metered = nil
	var errs []error
	for _, id := range h.states {
		if _, err := zoneStates.Delete(id); err != nil {
			errs = append(errs, err)
		}
	}
	h.states = nil
	if h.fallbackOf != nil {
		// Requests of this config may still be running: they keep the
		// fallback, whose tables work on when they leave the pool.
		errs = append(errs, h.fallbackOf.Cleanup())
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
	if err := h.checkKinds(); err != nil {
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
	if _, err := jsonVarsOf(h.Zones); err != nil {
		return err
	}
	if h.Headers != "" {
		if err := checkHeaderMode(h.Headers); err != nil {
			return err
		}
	}
	if h.GRPCStatus != "" {
		if err := checkGRPCStatus(h.GRPCStatus); err != nil {
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

func checkJitter(f float64) error {
	if !(f >= 0) || math.IsInf(f, 0) {
		return fmt.Errorf("invalid jitter %v: must be a number of at least 0, such as 0.1 for up to 10%% longer", f)
	}
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
	d       store.Demands // what the request asks of the store
	matches []match       // the zones that apply to it, in the handler's order
	by      store.Store   // the store that took d: h.store, h.fallback, or nil (fail_mode open)
	held    bool          // the request holds h.holds until it ends
	top     *standing
	std     standing
	buf     []byte
	back    store.Demands       // what goes back to the store (see giveBack)
	slotOut int                 // the slot demand that refused the request; -1 for none
	rec     statusWriter        // the response writer of a request that settles after the response
	scans   []usagescan.Scanner // the usages read in its response (see settles)

	waiter bool          // holds a place among the handler's waiting requests
	delay  time.Duration // how long the allowed request waits for its tokens

	adaptive adaptiveScratch // its places in zones with an adaptive limit
}

func newScratch(zones int) *scratch {
	return &scratch{matches: make([]match, 0, zones), slotOut: -1}
}

// A match is a zone that applies to the request, with the places of its
// demands in the request's demands.
type match struct {
	zone                  int
	bucket, counter, slot int  // -1: none
	wouldDeny             bool // a zone whose demands are soft (dry run, spill) lacked: it refused nothing
	back                  bool // its tokens go back to the store (see giveBack)
	scan                  int  // a zone with usage: its scan in scratch.scans
	class                 int  // a zone with reserves: the request's class, from the highest
}

// An outcome is how the decision on a request ends.
type outcome uint8

const (
	outcomeAllow      outcome = iota // every zone had the tokens, or only dry-run zones refused
	outcomeDeny                      // a zone refused: 429
	outcomeFailOpen                  // the store failed; fail_mode open (or closed, when only zones that never refuse apply) lets the request through
	outcomeFailClosed                // the store failed; fail_mode closed answers 503
	outcomeFailed                    // the request cannot be decided: 500
	outcomeBadLimit                  // a zone has no valid limit for the request: 500, logged by the zone
	outcomeGone                      // the client left while the request waited out a delay
	outcomeShed                      // a zone's adaptive limit had no place: 503
)

// ServeHTTP implements caddyhttp.MiddlewareHandler. A request goes
// through the stages in order: it is decided (decide.go), waits out a
// delay (delay.go), and is served, with what runs after the response
// (settle.go); its slots are given back however the handlers after this
// one return (concurrency.go).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	sc := h.scratch.Get().(*scratch)
	defer h.finish(r, sc)
	out, err := h.decide(w, r, sc)
	if h.anyDelay {
		out = h.wait(r, sc, out)
	}
	if out != outcomeAllow && out != outcomeFailOpen {
		return h.refuse(w, r, sc, out, err)
	}
	if sc.adaptive.held {
		return h.serveAdaptive(w, r, next, sc)
	}
	return h.serve(w, r, next, sc)
}

// finish gives back the request's slots and places, its hold on the
// store, and its scratch.
func (h *Handler) finish(r *http.Request, sc *scratch) {
	if len(sc.d.Slots) > 0 {
		h.releaseSlots(r, sc)
	}
	if len(sc.adaptive.p) > 0 {
		h.releaseAdaptive(sc)
	}
	if sc.held {
		h.holds.Done()
		sc.held = false
	}
	sc.d.Clear()
	sc.matches, sc.by, sc.top, sc.slotOut = sc.matches[:0], nil, nil, -1
	sc.rec = statusWriter{}
	sc.waiter, sc.delay = false, 0
	h.scratch.Put(sc)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
