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

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
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
//	GET    /rate_limit/<zone>/limits  the keys of the zone with a limit of their own
//	GET    /rate_limit/<zone>/<key>   a key now: its bucket, and each kind of limit's part (docs/operating.md)
//	DELETE /rate_limit/<zone>/<key>   reset a key: its bucket to full, and each kind's state of it as it starts
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
	Rate  string `json:"rate,omitempty"`  // none for a zone without a rate
	Burst int64  `json:"burst,omitempty"` // none for a zone without a rate
	Cost  int64  `json:"cost"`
	kindsInfo
	Store    string            `json:"store"`
	Requests map[string]uint64 `json:"requests"`
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
		Burst: z.limit.Burst,
		Cost:  z.Cost,
		Store: ref.h.storeName,
		Requests: map[string]uint64{
			"allowed":     st.allowed.Load(),
			"denied":      st.denied.Load(),
			"store_error": st.storeErrors.Load(),
		},
		Refunds: st.refunds.Load(),
	}
	if z.rateless {
		info.Rate, info.Burst = "", 0
	}
	stats := ref.h.store.Stats(z.index)
	for _, k := range kinds {
		if k.info != nil {
			k.info(z, stats, &info)
		}
	}
	info.TrackedKeys, info.Evictions = stats.Keys, stats.Evictions
	if stats.OverLimitCache {
		n := st.cacheHits.Load()
		info.OverLimitCacheHits = &n
	}
	return info
}

// keyView describes one key of a zone in the admin API: its bucket, and
// the kinds' parts (see kind.view).
type keyView struct {
	Zone   string `json:"zone"`
	Limit  string `json:"limit"`  // the zone's, in words
	Key    string `json:"key"`    // as asked
	Bucket string `json:"bucket"` // the bucket it falls in, e.g. an IPv6 /64
	// The tokens in the bucket and its burst; left out for a zone whose
	// limit comes with each request, which no request says here.
	Tokens *float64 `json:"tokens,omitempty"`
	Burst  *int64   `json:"burst,omitempty"`
	// Seconds until the bucket is full again; left out for a zone
	// without a rate.
	FullIn *float64 `json:"full_in,omitempty"`
	kindsKeyView
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
	for _, k := range ref.z.state.top.List() {
		out.Top = append(out.Top, topItem{Key: k.Key.String(), Denials: k.Count, Error: k.Err})
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
		z, k := ref.z, ref.z.adminKey(key)
		d := z.demands(k)
		if r.Method == http.MethodDelete {
			f, err := ref.h.reset(ctx, &d)
			if err != nil {
				return apiError(http.StatusBadGateway, "resetting the bucket: %v", err)
			}
			for _, kd := range kinds {
				if kd.forget != nil {
					f = kd.forget(z, k) || f
				}
			}
			found = found || f
		}
		if !d.Empty() { // a kind may keep all it knows of a key itself
			if err := ref.h.store.Peek(ctx, time.Now(), &d); err != nil {
				return apiError(http.StatusBadGateway, "reading the bucket: %v", err)
			}
		}
		v, err := ref.view(ctx, key, k, &d)
		if err != nil {
			return err
		}
		out[i] = v
	}
	if r.Method == http.MethodDelete && !found {
		return apiError(http.StatusNotFound, "nothing to reset: key %q has a full bucket in zone %q", key, refs[0].z.Name)
	}
	if len(out) == 1 {
		return writeJSON(w, out[0])
	}
	return writeJSON(w, map[string]any{"zones": out})
}

// demands are the zone's demands of the key k, as a request's would be,
// to read or reset: its bucket and the kinds' demands.
func (z *Zone) demands(k store.Key) store.Demands {
	var d store.Demands
	if !z.rateless {
		d.Buckets = []store.BucketDemand{{Zone: z.index, Key: k, Limit: z.adminLimit(), Cost: z.costTime}}
	}
	for _, kd := range kinds {
		if kd.demand != nil {
			kd.demand(z, k, &d)
		}
	}
	return d
}

// view describes what d read of the key k, asked for as key.
func (ref zoneRef) view(ctx context.Context, key string, k store.Key, d *store.Demands) (*keyView, error) {
	z := ref.z
	v := &keyView{Zone: z.Name, Limit: z.id.limit, Key: key, Bucket: k.String()}
	if len(d.Buckets) > 0 {
		b := &d.Buckets[0]
		fullIn := b.Debt.Seconds()
		v.FullIn = &fullIn
		if z.knownLimit(b) {
			// A bucket in debt after a response's usage holds fewer than
			// none; a bucket that owes more than its burst is shown as
			// empty.
			l := b.Limit
			tokens, burst := l.Tokens(b.Debt), l.Burst
			if l.Owe == 0 {
				tokens = max(tokens, 0)
			}
			v.Tokens, v.Burst = &tokens, &burst
		}
	}
	for _, kd := range kinds {
		if kd.view != nil {
			if err := kd.view(ctx, ref.h, z, k, d, v); err != nil {
				return nil, err
			}
		}
	}
	return v, nil
}

// reset forgets d's state, in the store and in the local buckets that
// decide while the store fails. It reports whether either held any.
func (h *Handler) reset(ctx context.Context, d *store.Demands) (bool, error) {
	var inFallback bool
	if h.fallback != nil {
		inFallback, _ = h.fallback.Reset(ctx, d)
	}
	found, err := h.store.Reset(ctx, d)
	return found || inFallback, err
}

// adminKey is the bucket that a key in an admin path names: what a
// request's key would name, and for a network in CIDR notation, as the
// API prints them (2001:db8::/64), the bucket of its first address.
func (z *Zone) adminKey(s string) store.Key {
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
