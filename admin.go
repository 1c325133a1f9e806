// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves the zones of the running config on Caddy's admin
// endpoint:
//
//	GET    /rate_limit/               the zones, their limits and counters
//	GET    /rate_limit/<zone>         one zone
//	GET    /rate_limit/<zone>/top     the keys the zone denies most
//	GET    /rate_limit/<zone>/limits  the keys of the zone with a limit of their own (overrides)
//	GET    /rate_limit/<zone>/<key>   a key's bucket (and quota) now, its own limit, its slots in use (concurrency), its adaptive limit
//	DELETE /rate_limit/<zone>/<key>   reset a key's bucket to full, lifting its ban, its quota's count to 0, and its adaptive limit to min
//	PUT    /rate_limit/<zone>/<key>/limit  give the key its own limit: {"rate": "100r/s", "burst": 200, "expires_in": "24h"}
//	GET    /rate_limit/<zone>/<key>/limit  the key's own limit
//	DELETE /rate_limit/<zone>/<key>/limit  give the key the zone's limit back
//
// Keys are path-escaped (an IPv6 network's "/" as %2F), and a zone or key
// named . or .. as %2E or %2E%2E, which a path would read as a step to
// this folder or the one up. A key is taken as a request's key would be:
// an IP address finds its network's bucket, and so does the network
// itself in CIDR notation. A DELETE of a bucket that
// is full already answers 404, and so does one of a limit the key does
// not have. Keys named top or limits are written with a letter escaped
// (%74op, %6Cimits).
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return adminAPI{} },
	}
}

// Routes returns the admin routes.
func (a adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/rate_limit/", Handler: caddy.AdminHandlerFunc(a.serve)}}
}

// registry holds the provisioned handlers' zones by name, newest last:
// during a reload the new config's zones are found before the old one
// is cleaned up.
var registry = struct {
	sync.Mutex
	zones map[string][]zoneRef
}{zones: make(map[string][]zoneRef)}

type zoneRef struct {
	h *Handler
	z *Zone
}

func registerHandler(h *Handler) {
	registry.Lock()
	defer registry.Unlock()
	for _, z := range h.Zones {
		registry.zones[z.Name] = append(registry.zones[z.Name], zoneRef{h, z})
	}
}

func unregisterHandler(h *Handler) {
	registry.Lock()
	defer registry.Unlock()
	for name, refs := range registry.zones {
		refs = slices.DeleteFunc(refs, func(r zoneRef) bool { return r.h == h })
		if len(refs) == 0 {
			delete(registry.zones, name)
		} else {
			registry.zones[name] = refs
		}
	}
}

// lookupZone finds the newest zone of that name.
func lookupZone(name string) (zoneRef, bool) {
	refs := lookupZones(name)
	if len(refs) == 0 {
		return zoneRef{}, false
	}
	return refs[len(refs)-1], true
}

// lookupZones finds the zones of that name: of each distinct limit and
// store, the newest (zones of one name and limit in one store share their
// buckets and counters, whichever handler has them).
func lookupZones(name string) []zoneRef {
	registry.Lock()
	defer registry.Unlock()
	type distinct struct {
		id    zoneID
		store string
	}
	var out []zoneRef
	at := make(map[distinct]int)
	for _, ref := range registry.zones[name] {
		k := distinct{ref.z.id, ref.h.storeName}
		if i, ok := at[k]; ok {
			out[i] = ref
			continue
		}
		at[k] = len(out)
		out = append(out, ref)
	}
	return out
}

// zoneInfo describes a zone in the admin API.
type zoneInfo struct {
	Name string `json:"name"`
	// Its limit in words, which tells zones of one name apart.
	Limit string `json:"limit"`
	Key   string `json:"key"`
	Rate  string `json:"rate,omitempty"`  // none for a zone with concurrency or a quota only
	Burst int64  `json:"burst,omitempty"` // none for a zone with concurrency or a quota only
	Cost  int64  `json:"cost"`
	// The kinds' fields (see kind.info).
	banInfo
	delayInfo
	concurrencyInfo
	adaptiveInfo
	quotaZoneInfo
	Store    string            `json:"store"`
	DryRun   bool              `json:"dry_run"`
	Requests map[string]uint64 `json:"requests"`
	Bans     uint64            `json:"bans"`
	Refunds  uint64            `json:"refunds"`

	OverLimitCacheHits *uint64 `json:"over_limit_cache_hits,omitempty"` // Redis store
	TrackedKeys        *int    `json:"tracked_keys,omitempty"`          // local store
	Evictions          *uint64 `json:"evictions,omitempty"`             // local store
}

func (ref zoneRef) info() zoneInfo {
	z, st := ref.z, ref.z.state
	info := zoneInfo{
		Name:  z.Name,
		Limit: z.id.limit,
		Key:   z.Key,
		Rate:  z.rateString(),
		Burst: z.limit.burst,
		Cost:  z.Cost,
		Store: ref.h.storeName,
		Requests: map[string]uint64{
			"allowed":        st.allowed.Load(),
			"denied":         st.denied.Load(),
			"dry_run_denied": st.dryRunDenied.Load(),
			"store_error":    st.storeErrors.Load(),
		},
		Bans:    st.bans.Load(),
		Refunds: st.refunds.Load(),
	}
	if z.rateless {
		info.Rate, info.Burst = "", 0
	}
	stats := ref.h.store.stats(z.index)
	for _, k := range kinds {
		if k.info != nil {
			k.info(z, stats, &info)
		}
	}
	info.TrackedKeys, info.Evictions = stats.keys, stats.evictions
	if stats.overLimitCache {
		n := st.cacheHits.Load()
		info.OverLimitCacheHits = &n
	}
	return info
}

// bucketInfo describes one bucket in the admin API.
type bucketInfo struct {
	Zone   string `json:"zone"`
	Limit  string `json:"limit"`  // the zone's, in words
	Key    string `json:"key"`    // as asked
	Bucket string `json:"bucket"` // the bucket it falls in, e.g. an IPv6 /64
	// The tokens in the bucket and its burst; left out for a zone whose
	// limit comes with each request, which no request says here.
	Tokens *float64 `json:"tokens,omitempty"`
	Burst  *int64   `json:"burst,omitempty"`
	// Seconds until the bucket is full again.
	FullIn float64 `json:"full_in"`
	// The key is banned (the zone's ban), for BannedFor seconds more.
	Banned    bool    `json:"banned,omitempty"`
	BannedFor float64 `json:"banned_for,omitempty"`
	// The key's calendar quota, in a zone with one.
	Quota *quotaInfo `json:"quota,omitempty"`
	// The key's own limit, which tokens and burst are of, when it has one.
	Override *ownLimit `json:"override,omitempty"`
	slotsInfo
}

// slotsInfo describes the slots of one key of a zone with concurrency:
// alone for a zone without a rate, with the bucket for a zone with both.
type slotsInfo struct {
	Concurrency int64  `json:"concurrency,omitempty"`
	InFlight    *int64 `json:"in_flight,omitempty"` // slots held (leases not ended, in Redis)
	Free        *int64 `json:"free,omitempty"`
	// The key's adaptive limit on requests in flight.
	Adaptive *adaptiveKeyInfo `json:"concurrency_adaptive,omitempty"`
}

// ratelessInfo is a key of a zone with concurrency only.
type ratelessInfo struct {
	Zone   string `json:"zone"`
	Limit  string `json:"limit"`
	Key    string `json:"key"`
	Bucket string `json:"bucket"`
	slotsInfo
}

// quotaInfo describes a key's calendar quota in the admin API.
type quotaInfo struct {
	Limit int64 `json:"limit"`
	Used  int64 `json:"used"`
	Left  int64 `json:"left"`
	// Seconds until the window ends and the count starts again from 0;
	// 0 when nothing is counted.
	ResetIn float64 `json:"reset_in"`
}

// keyInfo describes a key of a zone with a quota alone.
type keyInfo struct {
	Zone     string           `json:"zone"`
	Limit    string           `json:"limit"`
	Key      string           `json:"key"`
	Bucket   string           `json:"bucket"`
	Quota    *quotaInfo       `json:"quota"`
	Adaptive *adaptiveKeyInfo `json:"concurrency_adaptive,omitempty"`
}

type topInfo struct {
	Zone  string    `json:"zone"`
	Limit string    `json:"limit"`
	Top   []topItem `json:"top"`
}

type topItem struct {
	Key     string `json:"key"`
	Denials uint64 `json:"denials"` // at most this many
	Error   uint64 `json:"error"`   // and at least denials - error
}

func (adminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	rest := strings.TrimPrefix(r.URL.EscapedPath(), "/rate_limit/")
	zoneEsc, keyEsc, hasKey := strings.Cut(rest, "/")
	keyEsc, ownLimit := strings.CutSuffix(keyEsc, "/limit")
	list := !ownLimit && (keyEsc == "top" || keyEsc == "limits")
	if err := checkMethod(r.Method, !hasKey || list, ownLimit); err != nil {
		return err
	}
	if zoneEsc == "" {
		return writeJSON(w, map[string]any{"zones": allZones()})
	}
	name, err := url.PathUnescape(zoneEsc)
	if err != nil {
		return apiError(http.StatusBadRequest, "bad zone name in path: %v", err)
	}
	refs := lookupZones(name)
	if len(refs) == 0 {
		return apiError(http.StatusNotFound, "unknown zone %q", name)
	}
	switch {
	case !hasKey || keyEsc == "" && !ownLimit: // not /rate_limit/<zone>//limit: a key's, with no key
		return writeEach(w, refs, zoneRef.info)
	case list && keyEsc == "top":
		return writeEach(w, refs, zoneRef.top)
	case list:
		return serveLimits(w, r, refs)
	}
	key, err := url.PathUnescape(keyEsc)
	if err != nil || key == "" {
		return apiError(http.StatusBadRequest, "bad key in path: %q", keyEsc)
	}
	if ownLimit {
		return serveLimit(w, r, refs, key)
	}
	return serveKey(w, r, refs, key)
}

// checkMethod refuses a method that the path does not take: a zone, a
// list (zoneOnly) or a key's own limit (ownLimit), or a key.
func checkMethod(method string, zoneOnly, ownLimit bool) error {
	switch {
	case zoneOnly && method != http.MethodGet:
		return apiError(http.StatusMethodNotAllowed, "method %s not allowed: use GET", method)
	case ownLimit && method != http.MethodGet && method != http.MethodPut && method != http.MethodDelete:
		return apiError(http.StatusMethodNotAllowed, "method %s not allowed: use GET, PUT or DELETE", method)
	case !zoneOnly && !ownLimit && method != http.MethodGet && method != http.MethodDelete:
		return apiError(http.StatusMethodNotAllowed, "method %s not allowed: use GET or DELETE", method)
	}
	return nil
}

// writeEach writes what f says of the zone, or of each zone of the name
// as {"zones": [...]} when several zones have it.
func writeEach[T any](w http.ResponseWriter, refs []zoneRef, f func(zoneRef) T) error {
	if len(refs) == 1 {
		return writeJSON(w, f(refs[0]))
	}
	out := make([]T, len(refs))
	for i, ref := range refs {
		out[i] = f(ref)
	}
	return writeJSON(w, map[string]any{"zones": out})
}

// top lists the keys the zone refuses most.
func (ref zoneRef) top() topInfo {
	out := topInfo{Zone: ref.z.Name, Limit: ref.z.id.limit, Top: []topItem{}}
	for _, k := range ref.z.state.top.list() {
		out.Top = append(out.Top, topItem{Key: k.key.String(), Denials: k.count, Error: k.err})
	}
	return out
}

// allZones describes the zones of every handler, the newest of each name.
func allZones() []zoneInfo {
	registry.Lock()
	names := make([]string, 0, len(registry.zones))
	for name := range registry.zones {
		names = append(names, name)
	}
	registry.Unlock()
	slices.Sort(names)
	zones := []zoneInfo{}
	for _, name := range names {
		for _, ref := range lookupZones(name) {
			zones = append(zones, ref.info())
		}
	}
	return zones
}

// serveKey answers a GET or a DELETE of a key in each zone of refs. A
// DELETE that finds nothing to reset in any of them answers 404.
func serveKey(w http.ResponseWriter, r *http.Request, refs []zoneRef, key string) error {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	out := make([]any, len(refs))
	found := false
	for i, ref := range refs {
		d := ref.demands(ref.z.adminKey(key))
		if r.Method == http.MethodDelete {
			f, err := ref.h.reset(ctx, &d)
			if err != nil {
				return apiError(http.StatusBadGateway, "resetting the bucket: %v", err)
			}
			if a := ref.z.adaptive; a != nil {
				f = a.forget(ref.z.adminKey(key)) || f
			}
			found = found || f
		}
		if !d.empty() { // an adaptive limit alone has nothing in the store
			if err := ref.h.store.peek(ctx, time.Now(), &d); err != nil {
				return apiError(http.StatusBadGateway, "reading the bucket: %v", err)
			}
		}
		info := ref.keyInfo(key, &d)
		if b, ok := info.(bucketInfo); ok {
			o, has, err := ref.h.store.override(ctx, ref.z.index, ref.z.adminKey(key))
			if err != nil {
				return apiError(http.StatusBadGateway, "reading the key's limit: %v", err)
			}
			if has {
				b.Override = ref.ownLimit("", o)
			}
			info = b
		}
		out[i] = info
	}
	if r.Method == http.MethodDelete && !found {
		return apiError(http.StatusNotFound, "nothing to reset: key %q has a full bucket in zone %q", key, refs[0].z.Name)
	}
	if len(out) == 1 {
		return writeJSON(w, out[0])
	}
	return writeJSON(w, map[string]any{"zones": out})
}

// demands are the zone's demands of key, as a request's would be, to
// read or reset: its bucket, its counter and its slots.
func (ref zoneRef) demands(key bucketKey) demands {
	z := ref.z
	var d demands
	if !z.rateless {
		l := z.limit
		if z.plans != nil {
			l = unknownPlan.limit
		}
		d.buckets = []bucketDemand{{zone: z.index, key: key, limit: l, cost: z.costTime}}
	}
	if z.quota != nil {
		d.counters = []counterDemand{{zone: z.index, key: key, limit: z.quota.limit, cost: z.Cost, window: z.quota.window(time.Now())}}
	}
	if z.Concurrency != 0 {
		d.slots = []slotDemand{{zone: z.index, key: key, limit: z.Concurrency, lease: time.Duration(z.Lease)}}
	}
	return d
}

// keyInfo describes what d read of the key.
func (ref zoneRef) keyInfo(key string, d *demands) any {
	z := ref.z
	bucket := z.adminKey(key).String()
	var slots slotsInfo
	if z.adaptive != nil {
		slots.Adaptive = z.adaptive.keyInfo(z.adminKey(key))
		if z.adaptiveOnly() {
			return ratelessInfo{Zone: z.Name, Limit: z.id.limit, Key: key, Bucket: bucket, slotsInfo: slots}
		}
	}
	if len(d.slots) > 0 {
		q := &d.slots[0]
		inUse, free := q.limit-q.free, q.free
		slots = slotsInfo{Concurrency: q.limit, InFlight: &inUse, Free: &free}
		if z.rateless {
			return ratelessInfo{Zone: z.Name, Limit: z.id.limit, Key: key, Bucket: bucket, slotsInfo: slots}
		}
	}
	var quota *quotaInfo
	if len(d.counters) > 0 {
		c := &d.counters[0]
		quota = &quotaInfo{Limit: c.limit, Used: c.used, Left: c.remaining(), ResetIn: c.left.Seconds()}
		if z.rateless {
			return keyInfo{Zone: z.Name, Limit: z.id.limit, Key: key, Bucket: bucket, Quota: quota, Adaptive: slots.Adaptive}
		}
	}
	b := &d.buckets[0]
	info := bucketInfo{Zone: z.Name, Limit: z.id.limit, Key: key, Bucket: bucket, FullIn: b.debt.Seconds(), Quota: quota, slotsInfo: slots}
	if z.plans == nil || b.overridden {
		// A zone whose limit depends on the request has no tokens or
		// ban to tell apart without a request (but for a key with its
		// own limit): only when it is full.
		l := b.limit
		// A bucket in debt after a response's usage holds fewer than
		// none; a ban or a delay's reservations are shown as empty.
		tokens, burst := l.tokens(b.debt), l.burst
		if l.owe == 0 {
			tokens = max(tokens, 0)
		}
		info.Tokens, info.Burst = &tokens, &burst
		info.Banned, info.BannedFor = l.banned(b.debt), l.banLeft(b.debt).Seconds()
	}
	return info
}

// reset forgets d's state, in the store and in the local buckets that
// decide while the store fails. It reports whether either held any.
func (h *Handler) reset(ctx context.Context, d *demands) (bool, error) {
	var inFallback bool
	if h.fallback != nil {
		inFallback, _ = h.fallback.reset(ctx, d)
	}
	found, err := h.store.reset(ctx, d)
	return found || inFallback, err
}

// adminKey is the bucket that a key in an admin path names: what a
// request's key would name, and for a network in CIDR notation, as the
// API prints them (2001:db8::/64), the bucket of its first address.
func (z *Zone) adminKey(s string) bucketKey {
	if p, err := netip.ParsePrefix(s); err == nil {
		return z.keyFor(p.Addr().String())
	}
	return z.keyFor(s)
}

func apiError(status int, format string, args ...any) error {
	return caddy.APIError{HTTPStatus: status, Err: fmt.Errorf(format, args...)}
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// Interface guards
var _ caddy.AdminRouter = adminAPI{}
