// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package ratelimit is a Caddy HTTP handler that limits request rates with
// token buckets, kept in memory or shared through Redis.
package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

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
// zones (see `headers`).
//
// Placeholders set by this handler:
//
// Placeholder | Description
// ------------|-------------
// `{http.rate_limit.exceeded.name}` | The name of the zone that denied the request.
// `{http.rate_limit.exceeded.retry_after}` | The Retry-After value sent: seconds until the request could succeed (empty if it never can).
type Handler struct {
	// The rate limit zones. A request is checked against every zone
	// whose matchers match it.
	Zones []*Zone `json:"zones,omitempty"`

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
	// all come back at once. Default: 0.
	Jitter float64 `json:"jitter,omitempty"`

	// Log the bucket key with denials. Keys often hold personal data
	// (IP addresses, API keys), so this is off by default.
	LogKey bool `json:"log_key,omitempty"`

	// Put every zone in dry run (see Zone.DryRun).
	DryRun bool `json:"dry_run,omitempty"`

	// Do not export this handler's zones as Prometheus metrics.
	DisableMetrics bool `json:"disable_metrics,omitempty"`

	store    store
	failMode failMode
	fallback *LocalStore // decides when store fails, for fail_mode local
	headers  headerMode
	dryRun   bool // some zone is in dry run
	scratch  *sync.Pool
	logger   *zap.Logger

	latency     prometheus.Observer // nil without metrics
	storeErrors prometheus.Counter  // nil without metrics
	storeName   string              // the store module's name
	ctx         caddy.Context       // for events
	events      *caddyevents.App
	states      []string     // names of the zone states acquired
	metered     []*zoneState // zone states this handler exports
	registered  bool         // in the admin API's registry
	// writeDenials: the server has no error routes (handle_errors), so
	// denials are written as Caddy would write them, not returned.
	writeDenials bool
}

// Zone is one token-bucket limit. Every distinct value of Key gets its
// own bucket.
//
// Zone names are global: zones with the same name, rate and burst share
// their buckets, also across sites and config reloads (as zones sharing a
// Redis store do). Give zones that must be separate different names.
type Zone struct {
	// The zone's name, used in headers, logs and store keys. It may hold
	// letters, digits, `_`, `-` and `.`. Required.
	Name string `json:"name,omitempty"`

	// What separates clients: a string with placeholders, e.g.
	// `{http.request.header.X-API-Key}`. A request whose key expands to
	// the empty string is not limited by this zone. Default:
	// `{http.vars.client_ip}`.
	Key string `json:"key,omitempty"`

	// How fast the bucket refills: `<n>r/s`, `<n>r/m`, `<n>r/h`, `<n>r/d`
	// or `<n>/<duration>` (e.g. `100/10s`). n may be fractional.
	// Required.
	Rate string `json:"rate,omitempty"`

	// The bucket's capacity: how many tokens a client that has been idle
	// can spend at once. Default: the n of the rate, rounded up.
	Burst int64 `json:"burst,omitempty"`

	// How many tokens one request takes. It cannot exceed the burst.
	// Default: 1.
	Cost int64 `json:"cost,omitempty"`

	// Which requests the zone applies to. Default: all requests.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// When the key is an IPv4 address, clients in the same network of
	// this prefix length share a bucket. Default: 32.
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// When the key is an IPv6 address, clients in the same network of
	// this prefix length share a bucket. Default: 64 (the usual
	// allocation to one subscriber).
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// Compute, count and log decisions, and send the headers, but let
	// requests that this zone would refuse go on (uncharged by it). The
	// placeholder `{http.rate_limit.<name>.would_deny}` is then true (false
	// when the zone would let the request through), so
	// that the upstream can be told. Lets a new limit be tried safely.
	DryRun bool `json:"dry_run,omitempty"`

	index        int // in Handler.Zones
	limit        limit
	cost         int64 // limit.cost(Cost)
	keyKind      keyKind
	matcherSets  caddyhttp.MatcherSets
	denial       error // the caddyhttp.HandlerError returned when this zone denies
	name         any   // Name, boxed once for the replacer
	dryRun       bool
	wouldDenyVar string // http.rate_limit.<name>.would_deny
	state        *zoneState
	quoted       string // the name as a structured-field string
	policy       string // this zone's RateLimit-Policy item
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// A store keeps token buckets and takes tokens from them.
type store interface {
	// bind prepares the store for the handler's zones. It is called once,
	// from the handler's Provision, after the store's own.
	bind(zones []*Zone) error

	// take decides reqs together: it charges every bucket or none. It sets
	// each request's ok and debt, and reports whether all were allowed.
	// now is the request's arrival; a store may keep its own clock.
	take(ctx context.Context, now time.Time, reqs []request) (bool, error)

	// peek sets q.debt from the bucket's state, changing nothing.
	peek(ctx context.Context, now time.Time, q *request) error

	// reset fills the bucket.
	reset(ctx context.Context, q *request) error
}

// A request asks a store for Zone.Cost tokens from one bucket.
type request struct {
	zone *Zone
	key  bucketKey

	ok        bool          // the bucket had the tokens
	debt      time.Duration // how long until the bucket is full, after the decision
	wouldDeny bool          // a dry-run zone that refused the request
}

// fallible is a store that can fail, and says what to do then.
type fallible interface {
	failMode() failMode
}

type failMode uint8

const (
	failLocal  failMode = iota // decide with in-memory buckets
	failOpen                   // allow
	failClosed                 // answer 503
)

var failModes = map[string]failMode{"local": failLocal, "open": failOpen, "closed": failClosed}

type headerMode uint8

const (
	headersBoth headerMode = iota
	headersLegacy
	headersIETF
	headersOff
)

var headerModes = map[string]headerMode{
	"":       headersBoth,
	"both":   headersBoth,
	"legacy": headersLegacy,
	"ietf":   headersIETF,
	"off":    headersOff,
}

type keyKind uint8

const (
	keyTemplate   keyKind = iota // any placeholders: use the replacer
	keyClientIP                  // exactly {http.vars.client_ip}
	keyRemoteHost                // exactly {http.request.remote.host}
	keyStatic                    // no placeholders: one bucket for everyone
)

const defaultKey = "{http.vars.client_ip}"

// Provision sets up the handler.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger()
	if err := h.Validate(); err != nil {
		return err
	}
	h.headers = headerModes[h.Headers]
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
		z.dryRun = z.DryRun || h.DryRun
		h.dryRun = h.dryRun || z.dryRun
	}

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
		}
	}
	// Without error routes on the server, Caddy would answer the 429
	// error with the bare status: writing it here is the same response,
	// without the cost of Caddy's error handling on every denial.
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		h.writeDenials = srv.Errors == nil || len(srv.Errors.Routes) == 0
	}
	// Events go to subscribers of a configured events app.
	if app, err := ctx.AppIfConfigured("events"); err == nil {
		h.events, _ = app.(*caddyevents.App)
	}

	n := len(h.Zones)
	h.scratch = &sync.Pool{New: func() any { return &scratch{reqs: make([]request, 0, n)} }}
	registerHandler(h)
	h.registered = true
	return nil
}

// Cleanup releases what Provision acquired; it copes with a partial
// Provision and runs once.
func (h *Handler) Cleanup() error {
	if h.registered {
		unregisterHandler(h)
		h.registered = false
	}
	for _, st := range h.metered {
		st.metered.Add(-1)
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
		errs = append(errs, h.fallback.Cleanup())
		h.fallback = nil
	}
	return errors.Join(errs...)
}

// Validate checks the handler's configuration.
func (h *Handler) Validate() error {
	if len(h.Zones) == 0 {
		return errors.New("no zones: at least one zone is required")
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
	if _, ok := headerModes[h.Headers]; !ok {
		return fmt.Errorf("invalid headers '%s': expected both, legacy, ietf or off", h.Headers)
	}
	if h.Jitter < 0 || h.Jitter > 1 || math.IsNaN(h.Jitter) {
		return fmt.Errorf("invalid jitter %v: must be between 0 and 1", h.Jitter)
	}
	return nil
}

// validate checks a zone's configuration without changing it.
func (z *Zone) validate() error {
	if z.Name == "" {
		return errors.New("name is required")
	}
	if strings.IndexFunc(z.Name, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '.')
	}) >= 0 {
		return fmt.Errorf("invalid name '%s': may hold only letters, digits, '_', '-' and '.'", z.Name)
	}
	_, err := z.parseLimit()
	return err
}

// parseLimit checks the zone's numbers and returns its bucket's shape.
func (z *Zone) parseLimit() (limit, error) {
	if z.Rate == "" {
		return limit{}, errors.New("rate is required")
	}
	perSec, n, err := parseRate(z.Rate)
	if err != nil {
		return limit{}, fmt.Errorf("invalid rate '%s': %w", z.Rate, err)
	}
	if perSec > maxRate {
		return limit{}, fmt.Errorf("invalid rate '%s': at most %.0fr/s", z.Rate, maxRate)
	}
	burst := z.Burst
	switch {
	case burst < 0:
		return limit{}, fmt.Errorf("invalid burst %d: must be at least 1", burst)
	case burst == 0 && n > float64(maxFull):
		return limit{}, fmt.Errorf("invalid rate '%s': %g is too large a default burst", z.Rate, n)
	case burst == 0:
		burst = int64(math.Ceil(n))
	}
	cost := z.Cost
	switch {
	case cost < 0:
		return limit{}, fmt.Errorf("invalid cost %d: must be at least 1", cost)
	case cost == 0:
		cost = 1
	}
	if cost > burst {
		return limit{}, fmt.Errorf("cost %d exceeds burst %d: no request could ever pass", cost, burst)
	}
	if z.IPv4Prefix < 0 || z.IPv4Prefix > 32 {
		return limit{}, fmt.Errorf("invalid ipv4_prefix %d: must be 1 to 32", z.IPv4Prefix)
	}
	if z.IPv6Prefix < 0 || z.IPv6Prefix > 128 {
		return limit{}, fmt.Errorf("invalid ipv6_prefix %d: must be 1 to 128", z.IPv6Prefix)
	}
	if float64(burst)/perSec > maxFull.Seconds() {
		return limit{}, fmt.Errorf("burst %d at rate %s takes more than 100 years to refill", burst, z.Rate)
	}
	return newLimit(perSec, burst), nil
}

// parseRate reads `<n>r/<unit>` or `<n>[r]/<duration>` and returns the
// rate in tokens per second and n.
func parseRate(s string) (perSec, n float64, err error) {
	num, per, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, errors.New("expected <n>r/s, <n>r/m, <n>r/h or <n>/<duration> such as 100/10s")
	}
	num = strings.TrimSuffix(num, "r")
	n, err = strconv.ParseFloat(num, 64)
	if err != nil || math.IsInf(n, 0) || math.IsNaN(n) {
		return 0, 0, fmt.Errorf("'%s' is not a number", num)
	}
	if n <= 0 {
		return 0, 0, errors.New("must be positive")
	}
	switch per {
	case "s", "m", "h", "d":
		per = "1" + per
	}
	d, err := caddy.ParseDuration(per)
	if err != nil {
		return 0, 0, fmt.Errorf("unknown unit '%s': expected s, m, h, d or a duration such as 10s", per)
	}
	if d <= 0 {
		return 0, 0, fmt.Errorf("interval '%s' must be positive", per)
	}
	return n / d.Seconds(), n, nil
}

// provision computes the zone's runtime state. The zone must be valid.
func (z *Zone) provision(ctx caddy.Context) error {
	if z.Key == "" {
		z.Key = defaultKey
	}
	if z.Cost == 0 {
		z.Cost = 1
	}
	if z.IPv4Prefix == 0 {
		z.IPv4Prefix = 32
	}
	if z.IPv6Prefix == 0 {
		z.IPv6Prefix = 64
	}
	var err error
	if z.limit, err = z.parseLimit(); err != nil {
		return err
	}
	if z.Burst == 0 {
		z.Burst = z.limit.burst
	}
	z.cost = z.limit.cost(z.Cost)

	switch {
	case z.Key == defaultKey:
		z.keyKind = keyClientIP
	case z.Key == "{http.request.remote.host}":
		z.keyKind = keyRemoteHost
	case !strings.Contains(z.Key, "{"):
		z.keyKind = keyStatic
	}

	if z.MatcherSetsRaw != nil {
		v, err := ctx.LoadModule(z, "MatcherSetsRaw")
		if err != nil {
			return fmt.Errorf("loading matchers: %w", err)
		}
		if err := z.matcherSets.FromInterface(v); err != nil {
			return fmt.Errorf("loading matchers: %w", err)
		}
	}

	// Built once, directly rather than with caddyhttp.Error, which records
	// a stack trace and a random ID: work a flood of denials need not do.
	z.denial = caddyhttp.HandlerError{
		StatusCode: http.StatusTooManyRequests,
		Err:        fmt.Errorf("rate limit exceeded in zone %s", z.Name),
	}
	z.name = z.Name
	z.wouldDenyVar = "http.rate_limit." + z.Name + ".would_deny"
	z.quoted = strconv.Quote(z.Name) // names are plain ASCII: a valid sf-string
	z.policy = fmt.Sprintf("%s;q=%d;w=%d", z.quoted, z.limit.burst, ceilSeconds(z.limit.full))
	return nil
}

// bucketKey expands the zone's key for r. It reports false when the key
// is empty, which exempts the request from the zone.
func (z *Zone) bucketKey(r *http.Request) (bucketKey, bool) {
	var s string
	switch z.keyKind {
	case keyClientIP:
		s, _ = caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string)
	case keyRemoteHost:
		s = remoteHost(r)
	case keyStatic:
		s = z.Key
	default:
		repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if repl == nil {
			return bucketKey{}, false
		}
		s = repl.ReplaceAll(z.Key, "")
	}
	if s == "" {
		return bucketKey{}, false
	}
	return z.keyFor(s), true
}

// keyFor is the bucket of an expanded key: its network, if it is an IP
// address.
func (z *Zone) keyFor(s string) bucketKey {
	if looksLikeIP(s) {
		if ip, err := netip.ParseAddr(s); err == nil {
			ip = ip.WithZone("").Unmap()
			bits := z.IPv6Prefix
			if ip.Is4() {
				bits = z.IPv4Prefix
			}
			p, _ := ip.Prefix(bits)
			return bucketKey{ip: p}
		}
	}
	return bucketKey{s: s}
}

// looksLikeIP is a cheap filter that spares netip.ParseAddr (which
// allocates its error) the keys that cannot be addresses.
func looksLikeIP(s string) bool {
	if len(s) < 2 || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '%':
			return true // an IPv6 zone follows: let the parser decide
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f', c >= 'A' && c <= 'F', c == '.', c == ':':
		default:
			return false
		}
	}
	return true
}

// scratch is the per-request working memory, pooled per handler.
type scratch struct {
	reqs  []request
	retry []request // for dry runs
	buf   []byte
}

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	sc := h.scratch.Get().(*scratch)
	err := h.decide(w, r, sc)
	sc.reqs, sc.retry = sc.reqs[:0], sc.retry[:0]
	h.scratch.Put(sc)
	switch {
	case err == errResponded:
		return nil
	case err != nil:
		return err
	}
	return next.ServeHTTP(w, r)
}

// errResponded tells ServeHTTP that the response is written.
var errResponded = errors.New("response written")

// decide takes tokens for r from the buckets of every matching zone, sets
// the response headers, and returns the error that ends the request when
// it must not go on.
func (h *Handler) decide(w http.ResponseWriter, r *http.Request, sc *scratch) error {
	for _, z := range h.Zones {
		if len(z.matcherSets) > 0 {
			match, err := z.matcherSets.AnyMatchWithError(r)
			if err != nil {
				return err
			}
			if !match {
				continue
			}
		}
		if k, ok := z.bucketKey(r); ok {
			sc.reqs = append(sc.reqs, request{zone: z, key: k})
		}
	}
	if len(sc.reqs) == 0 {
		return nil
	}

	now := time.Now()
	allowed, err := h.take(r.Context(), now, sc.reqs)
	switch {
	case err == errFailOpen:
		h.count(sc.reqs, true)
		return nil
	case err != nil:
		h.count(sc.reqs, false)
		return h.failed(w, err)
	case !allowed && h.dryRun:
		allowed, err = h.shadow(r, now, sc)
		if err == errFailOpen {
			return nil
		} else if err != nil {
			return h.failed(w, err)
		}
	}
	h.count(sc.reqs, allowed)
	if h.dryRun {
		h.noteDryRunPassed(r, sc.reqs)
	}
	top := mostConstrained(sc.reqs)
	h.writeHeaders(w.Header(), now, sc, top)
	if allowed {
		return nil
	}
	return h.deny(w, r, top)
}

// failed answers a request whose store failed, with fail_mode closed (503)
// or without a fail_mode (500).
func (h *Handler) failed(w http.ResponseWriter, err error) error {
	if he, ok := err.(caddyhttp.HandlerError); ok && he.StatusCode == http.StatusServiceUnavailable {
		w.Header()["Retry-After"] = []string{"1"}
	}
	return err
}

// errFailOpen tells decide that the store failed and fail_mode open lets
// the request through.
var errFailOpen = errors.New("store failed: fail_mode open")

// take asks the store, and applies fail_mode when the store fails. Its
// error ends the request, but for errFailOpen.
func (h *Handler) take(ctx context.Context, now time.Time, reqs []request) (bool, error) {
	allowed, err := h.store.take(ctx, now, reqs)
	if h.latency != nil {
		h.latency.Observe(time.Since(now).Seconds())
	}
	if err == nil {
		return allowed, nil
	}
	for i := range reqs {
		reqs[i].zone.state.storeErrors.Add(1)
	}
	if h.storeErrors != nil {
		h.storeErrors.Inc()
	}
	if _, ok := h.store.(fallible); !ok {
		for i := range reqs {
			reqs[i].ok = false
		}
		return false, caddyhttp.HandlerError{StatusCode: http.StatusInternalServerError, Err: err}
	}
	if h.failMode == failLocal {
		return h.fallback.take(ctx, now, reqs)
	}
	open := h.failMode == failOpen
	for i := range reqs {
		reqs[i].ok, reqs[i].debt = open, 0
	}
	if open {
		return true, errFailOpen
	}
	return false, caddyhttp.HandlerError{StatusCode: http.StatusServiceUnavailable, Err: err}
}

// shadow handles a request that dry-run zones may have refused. If only
// dry-run zones refused it, they are noted as such, and the request is
// charged to the other zones and goes on; if an enforced zone refused it,
// it stays refused.
func (h *Handler) shadow(r *http.Request, now time.Time, sc *scratch) (bool, error) {
	enforced := true
	for i := range sc.reqs {
		if q := &sc.reqs[i]; !q.ok {
			if !q.zone.dryRun {
				enforced = false
				continue
			}
			q.wouldDeny = true
			h.noteDryRun(r, q)
		}
	}
	if !enforced {
		return false, nil
	}
	charge := sc.retry[:0]
	for _, q := range sc.reqs {
		if q.ok {
			charge = append(charge, q)
		}
	}
	sc.retry = charge
	if len(charge) == 0 {
		return true, nil
	}
	allowed, err := h.take(r.Context(), now, charge)
	if err != nil {
		return allowed, err
	}
	for _, c := range charge {
		for i := range sc.reqs {
			if sc.reqs[i].zone == c.zone {
				sc.reqs[i].ok, sc.reqs[i].debt = c.ok, c.debt
			}
		}
	}
	if allowed {
		return true, nil
	}
	// The buckets changed in between. Refused by an enforced zone, the
	// request is refused; by dry-run zones only, it goes on uncharged.
	for i := range sc.reqs {
		if q := &sc.reqs[i]; !q.ok && !q.wouldDeny {
			if !q.zone.dryRun {
				return false, nil
			}
			q.wouldDeny = true
			h.noteDryRun(r, q)
		}
	}
	return true, nil
}

// noteDryRun records that a dry-run zone would have refused r.
func (h *Handler) noteDryRun(r *http.Request, q *request) {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set(q.zone.wouldDenyVar, true)
		repl.Set("http.rate_limit.would_deny", q.zone.name)
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
		if q := &reqs[i]; q.zone.dryRun && !q.wouldDeny {
			repl.Set(q.zone.wouldDenyVar, false)
		}
	}
}

// count adds a request's outcome to its zones' counters.
func (h *Handler) count(reqs []request, allowed bool) {
	for i := range reqs {
		q := &reqs[i]
		st := q.zone.state
		switch {
		case q.wouldDeny:
			st.dryRunDenied.Add(1)
			st.top.add(q.key)
		case !q.ok:
			st.denied.Add(1)
			st.top.add(q.key)
		case allowed:
			st.allowed.Add(1)
		}
	}
}

// deny answers a request that a zone refused; q is the most constrained
// of its zones.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, q *request) error {
	z := q.zone
	wait := q.wait()
	var retryAfter any = ""
	if wait >= 0 {
		if h.Jitter > 0 {
			wait += int64(float64(wait) * h.Jitter * rand.Float64())
		}
		secs := max(ceilSeconds(wait), 1)
		s := strconv.FormatInt(secs, 10)
		w.Header()["Retry-After"] = []string{s}
		if secs < int64(len(smallSeconds)) {
			retryAfter = smallSeconds[secs]
		} else {
			retryAfter = s
		}
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.rate_limit.exceeded.name", z.name)
		repl.Set("http.rate_limit.exceeded.retry_after", retryAfter)
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit exceeded"); c != nil {
		c.Write(h.logFields(r, q)...)
	}
	if h.events != nil && h.events.ShouldEmit(exceededEvent) {
		h.events.Emit(h.ctx, exceededEvent, map[string]any{
			"zone":      z.Name,
			"wait":      time.Duration(wait),
			"remote_ip": clientIP(r),
		})
	}
	if h.writeDenials {
		w.WriteHeader(http.StatusTooManyRequests)
		return errResponded
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
		zap.Duration("wait", time.Duration(max(q.wait(), 0))),
		zap.String("remote_ip", clientIP(r)),
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", q.key.String()))
	}
	return fields
}

// smallSeconds are the common Retry-After values, boxed once for the
// replacer.
var smallSeconds = func() (v [100]any) {
	for i := range v {
		v[i] = strconv.Itoa(i)
	}
	return v
}()

// mostConstrained picks the request whose zone speaks for the response:
// of the denied ones, the one that makes the client wait longest; if all
// were allowed (dry runs aside), the one with the fewest whole tokens left.
func mostConstrained(reqs []request) *request {
	top := &reqs[0]
	for i := 1; i < len(reqs); i++ {
		q := &reqs[i]
		switch qd, td := q.denied(), top.denied(); {
		case qd != td:
			if qd {
				top = q
			}
		case qd:
			if tw, qw := top.wait(), q.wait(); tw >= 0 && (qw < 0 || qw > tw) {
				top = q
			}
		default:
			if qr, tr := q.remaining(), top.remaining(); qr < tr || qr == tr && q.debt > top.debt {
				top = q
			}
		}
	}
	return top
}

// clientIP is the client's address as Caddy determined it.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok {
		return ip
	}
	return remoteHost(r)
}

// remoteHost is the address of the connection's peer, as
// {http.request.remote.host} gives it.
func remoteHost(r *http.Request) string {
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// writeHeaders sets the rate-limit headers for the decided requests:
// the legacy X-RateLimit-* trio for the most constrained zone, and one
// RateLimit and RateLimit-Policy item per zone. top is the most
// constrained zone's request.
func (h *Handler) writeHeaders(hdr http.Header, now time.Time, sc *scratch, top *request) {
	if h.headers == headersOff {
		return
	}
	reqs := sc.reqs

	// All values go into one buffer and become one string, sliced.
	b := sc.buf[:0]
	var ends [5]int
	if h.headers != headersIETF {
		b = strconv.AppendInt(b, top.zone.limit.burst, 10)
		ends[0] = len(b)
		b = strconv.AppendInt(b, top.remaining(), 10)
		ends[1] = len(b)
		b = strconv.AppendInt(b, now.Add(top.debt+time.Second-1).Unix(), 10)
		ends[2] = len(b)
	}
	if h.headers != headersLegacy {
		for i := range reqs {
			if i > 0 {
				b = append(b, ", "...)
			}
			b = append(b, reqs[i].zone.policy...)
		}
		ends[3] = len(b)
		for i := range reqs {
			q := &reqs[i]
			if i > 0 {
				b = append(b, ", "...)
			}
			b = append(b, q.zone.quoted...)
			b = append(b, ";r="...)
			b = strconv.AppendInt(b, q.remaining(), 10)
			b = append(b, ";t="...)
			b = strconv.AppendInt(b, ceilSeconds(int64(q.debt)), 10)
		}
		ends[4] = len(b)
	}
	sc.buf = b
	s := string(b)
	vals := make([]string, 5)
	start := 0
	set := func(i int, name string) {
		vals[i] = s[start:ends[i]]
		hdr[name] = vals[i : i+1 : i+1]
		start = ends[i]
	}
	if h.headers != headersIETF {
		set(0, "X-Ratelimit-Limit")
		set(1, "X-Ratelimit-Remaining")
		set(2, "X-Ratelimit-Reset")
	}
	if h.headers != headersLegacy {
		set(3, "Ratelimit-Policy")
		set(4, "Ratelimit")
	}
}

// denied reports whether the request's zone refused it, dry runs aside.
func (q *request) denied() bool { return !q.ok && !q.wouldDeny }

// wait is how long the request's bucket needs before it can give the
// tokens, or -1 if it never can.
func (q *request) wait() int64 {
	return q.zone.limit.wait(int64(q.debt), q.zone.cost)
}

// remaining is the number of whole tokens left in the request's bucket.
func (q *request) remaining() int64 {
	l := q.zone.limit
	return min(max((l.full-int64(q.debt))/l.tau, 0), l.burst)
}

// ceilSeconds rounds nanoseconds up to whole seconds.
func ceilSeconds(ns int64) int64 {
	return (ns + int64(time.Second) - 1) / int64(time.Second)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
