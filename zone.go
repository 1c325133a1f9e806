// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
)

// Zone is one token-bucket limit. Every distinct value of Key gets its
// own bucket.
//
// Zone names are global: zones with the same name, rate and burst share
// their buckets, also across sites and config reloads (as zones sharing a
// Redis store do). Give zones that must be separate different names.
type Zone struct {
	// The zone's name, used in headers, logs, metrics, the admin API and
	// store keys: any non-empty UTF-8 string. In the RateLimit headers,
	// bytes outside printable ASCII, and '%', are percent-encoded.
	// Required (in `rate_limits`, the map's key is the name).
	Name string `json:"name,omitempty"`

	// What separates clients: a string with placeholders, e.g.
	// `{http.request.header.X-API-Key}`. A request whose key expands to
	// the empty string is not limited by this zone. Default:
	// `{http.vars.client_ip}`.
	//
	// In a zone written with `window` and `max_events`, the key means
	// what it means in github.com/mholt/caddy-ratelimit: a zone without
	// a key is one bucket for all clients, and so is a key that expands
	// to the empty string.
	Key string `json:"key,omitempty"`

	// How fast the bucket refills: `<n>r/s`, `<n>r/m`, `<n>r/h`, `<n>r/d`
	// or `<n>/<duration>` (e.g. `100/10s`). n may be fractional. Required,
	// unless the zone has `window` and `max_events`, `concurrency` or a
	// `quota`.
	//
	// Rate, burst and cost may hold placeholders, e.g. `{plan_rate}` set
	// by a `map` of the client's plan: each request is then limited by
	// the values it brings, and a key keeps its bucket when its plan
	// changes, owing the same fraction of the new plan's bucket as it owed
	// of the old one's. A zone keeps at most 1000 distinct limits; a
	// request whose values make no valid limit, or one more, is answered
	// 500 (and the values logged once). A value the client sets itself
	// must not decide its limit.
	Rate string `json:"rate,omitempty"`

	// The bucket's capacity: how many tokens a client that has been idle
	// can spend at once. A whole number, or a string with placeholders
	// that give one per request (see `rate`). Default: the n of the rate,
	// rounded up.
	Burst int64 `json:"burst,omitempty"`

	// How many tokens one request takes. It cannot exceed the burst. A
	// whole number, or a string with placeholders that give one per
	// request, e.g. `{http.request.header.X-Cost}` set by a trusted
	// upstream: never a value the client sets, or the client decides its
	// own limit. Default: 1.
	Cost int64 `json:"cost,omitempty"`

	// The limit as github.com/mholt/caddy-ratelimit writes it, instead of
	// rate and burst: at most `max_events` requests per `window`, all at
	// once after an idle spell. It is read as rate
	// `<max_events>/<window>` with burst `<max_events>`, and gives the
	// zone caddy-ratelimit's meaning of `key`, `ipv4_prefix` and
	// `ipv6_prefix` (see `key` and `ipv6_prefix`). A positive duration,
	// such as `1m`. Not with rate or burst. Default: none (the zone's
	// limit is its rate); required with max_events.
	Window caddy.Duration `json:"window,omitempty"`

	// Requests allowed per `window`: a whole number, at least 1. Default:
	// none; required with window.
	MaxEvents int64 `json:"max_events,omitempty"`

	// Which requests the zone applies to. Default: all requests.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// When the key is an IPv4 address, clients in the same network of
	// this prefix length, in bits (1 to 32), share a bucket. Default: 32.
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// When the key is an IPv6 address, clients in the same network of
	// this prefix length, in bits (1 to 128), share a bucket. Default: 64
	// (the usual allocation to one subscriber); 128 (each address its own
	// bucket) in a zone written with `window` and `max_events`, as in
	// caddy-ratelimit.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// The kinds of limit the zone may add to its bucket, each in its own
	// file (see kinds.go): their fields are the zone's own in JSON.
	banConfig
	delayConfig
	countConfig
	usageConfig
	estimateConfig
	concurrencyConfig
	adaptiveConfig
	quotaConfig
	overridesConfig
	dryRunConfig
	spillConfig
	syncConfig
	shareConfig
	reservesConfig

	index    int    // in Handler.Zones
	id       zoneID // its name and its limit: what its counters are shared by
	limit    gcra.Limit
	costTime time.Duration // what Cost tokens are worth: limit.costTime(Cost)
	// Burst and Cost when they hold placeholders, and Rate's.
	burstVar, costVar, rateVar valueVar
	// plan is the zone's limit when it is fixed; plans, the limits met
	// so far when it depends on the request (see plans.go).
	plan        *plan
	plans       *plans
	badLimit    error // the caddyhttp.HandlerError of a request without a valid limit
	keyKind     keyKind
	keyName     string // keyHeader's canonical header field; keyPlaceholder's placeholder
	matcherSets caddyhttp.MatcherSets
	state       *zoneState
	// inDryRun: this zone's DryRun, or the handler's.
	inDryRun bool
	// emptyShared: a key that expands to the empty string is one bucket
	// (caddy-ratelimit's meaning), rather than an exemption.
	emptyShared bool

	// Built once, for every response the zone speaks in.
	denial       error  // the caddyhttp.HandlerError returned when this zone denies
	boxedName    any    // Name, boxed once for the replacer
	wouldDenyVar string // http.rate_limit.<name>.would_deny
	spilledVar   string // http.rate_limit.<name>.spilled
	quotedName   string // the name as a structured-field string
	policy       string // this zone's RateLimit-Policy item
	// rateless: the zone limits only requests in flight (concurrency)
	// or per calendar window (quota); it has no bucket, and the store
	// never sees one.
	rateless bool
	// decided count what the store's answer to a request says of the
	// zone's kinds (kind.decided), for the kinds it has.
	decided    []func(st *zoneState, d *store.Demands, m *match)
	slotPolicy string // the RateLimit-Policy item of the concurrency limit
	quota      *quota // nil: no calendar quota
	// delays observes the waits of a zone with delay; nil without
	// metrics.
	delays prometheus.Observer
	// adaptive is the adaptive limit on requests in flight; nil without.
	adaptive *adaptiveZone
	// reserves are the classes of the zone's reserves; nil without.
	reserves *reserveZone
}

// A keyKind is what a zone's key template needs to be expanded.
type keyKind uint8

const (
	keyTemplate    keyKind = iota // any placeholders: use the replacer
	keyClientIP                   // exactly {http.vars.client_ip}
	keyRemoteHost                 // exactly {http.request.remote.host}
	keyStatic                     // no placeholders: one bucket for everyone
	keyHeader                     // exactly {http.request.header.<field>} (an API key)
	keyPlaceholder                // exactly one other placeholder, such as {http.rate_limit.json.model}
)

const defaultKey = "{http.vars.client_ip}"

// validate checks a zone's configuration without changing it.
func (z *Zone) validate() error {
	if err := checkZoneName(z.Name); err != nil {
		return err
	}
	_, err := z.parseLimit()
	return err
}

// checkZoneName accepts any name that metrics labels can carry: a
// non-empty UTF-8 string. Every other place that shows a name escapes it.
// A zone's placeholders are {http.rate_limit.<name>.…}, so json, and a
// name that starts with json., are refused: {http.rate_limit.json.spilled}
// would be both a zone's and the value at a path of the request's JSON
// body (see json_placeholder.go).
func checkZoneName(name string) error {
	if name == "" {
		return errors.New("name is required")
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("invalid name %q: must be UTF-8", name)
	}
	if name == "json" || strings.HasPrefix(name, "json.") {
		return fmt.Errorf("invalid name %q: {http.rate_limit.json.<path>} is the value at a path of the request's JSON body; give the zone another name", name)
	}
	return nil
}

// hasRate reports whether the zone has a bucket: a rate, or window and
// max_events.
func (z *Zone) hasRate() bool { return z.Rate != "" || z.windowForm() }

// charges reports whether the zone has something to charge a request's
// cost to, or give tokens back to: a bucket (a rate) or a calendar
// quota's counter.
func (z *Zone) charges() bool { return z.hasRate() || z.Quota != 0 }

// checkPrefixes checks the IP prefix lengths that are set.
func (z *Zone) checkPrefixes() error {
	if z.IPv4Prefix != 0 {
		if err := checkIPv4Prefix(z.IPv4Prefix); err != nil {
			return err
		}
	}
	if z.IPv6Prefix != 0 {
		return checkIPv6Prefix(z.IPv6Prefix)
	}
	return nil
}

func checkIPv4Prefix(bits int) error { return checkRange("ipv4_prefix", bits, 1, 32) }
func checkIPv6Prefix(bits int) error { return checkRange("ipv6_prefix", bits, 1, 128) }

// provision computes the zone's runtime state. The zone must be valid.
func (z *Zone) provision(ctx caddy.Context) error {
	z.setDefaults()
	var err error
	if z.limit, err = z.parseLimit(); err != nil {
		return err
	}
	z.rateless = !z.hasRate()
	if z.Burst == 0 && !z.windowForm() && !z.rateless {
		z.Burst = z.limit.Burst
	}
	z.costTime = z.limit.CostTime(z.Cost)
	z.keyKind, z.keyName = keyKindOf(z.Key)
	if z.MatcherSetsRaw != nil {
		v, err := ctx.LoadModule(z, "MatcherSetsRaw")
		if err != nil {
			return fmt.Errorf("loading matchers: %w", err)
		}
		if err := z.matcherSets.FromInterface(v); err != nil {
			return fmt.Errorf("loading matchers: %w", err)
		}
	}
	z.buildResponses()
	if err := eachKind(z, func(k *kind) func(*Zone) error { return k.provision }); err != nil {
		return err
	}
	z.decided = nil
	for _, k := range kinds {
		if k.decided != nil && k.in(z) {
			z.decided = append(z.decided, k.decided)
		}
	}
	if z.perRequest() {
		if hasPlaceholders(z.Rate) {
			z.rateVar = newValueVar(z.Rate)
		}
		z.plans = newPlans(ctx.Logger())
	} else {
		z.plan = newPlan(z.limit, z.Cost)
	}
	return nil
}

// setDefaults fills in the fields that are not set.
func (z *Zone) setDefaults() {
	// caddy-ratelimit's zones: no key is one bucket for all, an empty
	// key is a shared bucket, and addresses are not grouped unless said.
	z.emptyShared = z.windowForm()
	if z.Key == "" && !z.emptyShared {
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
		if z.emptyShared {
			z.IPv6Prefix = 128
		}
	}
}

// keyKindOf is what a key template needs to be expanded, and for a
// request header alone, its canonical field; for another placeholder
// alone, its name, whose value the replacer gives without the search
// of a template (the same string: an unknown placeholder, or one of no
// value, is "" either way).
func keyKindOf(key string) (keyKind, string) {
	switch {
	case key == defaultKey:
		return keyClientIP, ""
	case key == "{http.request.remote.host}":
		return keyRemoteHost, ""
	case !strings.Contains(key, "{"):
		return keyStatic, ""
	}
	if f, ok := strings.CutPrefix(key, "{http.request.header."); ok && strings.IndexAny(f, `{}\`) == len(f)-1 && len(f) > 1 {
		return keyHeader, textproto.CanonicalMIMEHeaderKey(f[:len(f)-1])
	}
	if len(key) > 2 && key[0] == '{' && key[len(key)-1] == '}' && !strings.ContainsAny(key[1:len(key)-1], `{}\`) {
		return keyPlaceholder, key[1 : len(key)-1]
	}
	return keyTemplate, ""
}

// buildResponses builds, once, what the zone's responses say: the
// errors, the placeholders' names and the header items. The errors are
// made directly rather than with caddyhttp.Error, which records a stack
// trace and a random ID: work a flood of denials need not do.
func (z *Zone) buildResponses() {
	z.denial = caddyhttp.HandlerError{
		StatusCode: http.StatusTooManyRequests,
		Err:        fmt.Errorf("rate limit exceeded in zone %s", z.Name),
	}
	z.badLimit = caddyhttp.HandlerError{
		StatusCode: http.StatusInternalServerError,
		Err:        fmt.Errorf("rate limit: no valid limit for the request in zone %s", z.Name),
	}
	z.boxedName = z.Name
	z.wouldDenyVar = "http.rate_limit." + z.Name + ".would_deny"
	z.quotedName = sfString(z.Name)
	z.policy = fmt.Sprintf("%s;q=%d;w=%d", z.quotedName, z.limit.Burst, ceilSeconds(z.limit.BurstTime))
}

// sfString writes a zone name as an RFC 9651 sf-string, which holds only
// printable ASCII (0x20-0x7E): '"' and '\' are escaped with '\', and
// every other byte, and '%' itself, is percent-encoded as %XX (upper-case
// hex). Distinct names give distinct strings; plain names are unchanged.
func sfString(name string) string {
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(name)+2)
	b = append(b, '"')
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '%' || c < 0x20 || c > 0x7e:
			b = append(b, '%', hex[c>>4], hex[c&15])
		default:
			b = append(b, c)
		}
	}
	return string(append(b, '"'))
}

// bucketKey expands the zone's key for r. It reports false when the key
// is empty, which exempts the request from the zone (unless the zone
// shares one bucket among empty keys).
func (z *Zone) bucketKey(r *http.Request) (store.Key, bool) {
	var s string
	switch z.keyKind {
	case keyClientIP:
		s = clientIP(r)
	case keyRemoteHost:
		s = peer(r)
	case keyStatic:
		s = z.Key
	case keyHeader:
		// As the replacer expands it, without its lookup.
		s = strings.Join(r.Header[z.keyName], ",")
	default:
		repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if repl == nil {
			return store.Key{}, false
		}
		if z.keyKind == keyPlaceholder {
			s, _ = repl.GetString(z.keyName)
		} else {
			s = repl.ReplaceAll(z.Key, "")
		}
	}
	if s == "" && !z.emptyShared {
		return store.Key{}, false
	}
	return z.keyFor(s), true
}

// keyFor is the bucket of an expanded key: its network, if it is an IP
// address.
func (z *Zone) keyFor(s string) store.Key {
	if looksLikeIP(s) {
		if ip, err := netip.ParseAddr(s); err == nil {
			ip = ip.WithZone("").Unmap()
			bits := z.IPv6Prefix
			if ip.Is4() {
				bits = z.IPv4Prefix
			}
			p, _ := ip.Prefix(bits)
			return store.Key{Net: p}
		}
	}
	return store.Key{Text: s}
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

// clientIP is the client's address as Caddy determined it, or, where
// Caddy found none (a Unix socket's clients), the connection's peer. It
// is never empty: an address key must not exempt a request.
func clientIP(r *http.Request) string {
	if ip, _ := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ip != "" && looksLikeIP(ip) {
		return ip
	}
	return peer(r)
}

// peer is the connection's peer as {http.request.remote.host} gives it:
// its IP address, "@" on a Unix socket (whose clients then share one
// bucket), or the remote address as the server set it. It is never empty.
func peer(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	if host == "" {
		return "@"
	}
	return host
}

// describe is the zone's limit in words, as configured: what tells zones
// of one name apart in the metrics' limit label and the admin API, e.g.
// `1r/m burst 2`, `concurrency 4` or `10r/s burst 20, quota 1000 per day`.
func (z *Zone) describe() string {
	var parts []string
	if z.hasRate() {
		burst := strconv.FormatInt(z.Burst, 10)
		switch {
		case z.burstVar.template != "":
			burst = z.burstVar.template
		case z.windowForm():
			burst = strconv.FormatInt(z.MaxEvents, 10)
		}
		parts = append(parts, z.rateString()+" burst "+burst)
	}
	for _, k := range kinds {
		if k.describe == nil {
			continue
		}
		if p := k.describe(z); p != "" {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, ", ")
}

// spec is what a store knows of the zone.
func (z *Zone) spec() store.ZoneSpec {
	s := store.ZoneSpec{Name: z.Name, Bucket: !z.rateless, Slots: z.Concurrency != 0, Refunds: z.Count != nil || z.Usage != nil,
		MaxOverrides: cmp.Or(z.MaxOverrides, store.DefaultMaxOverrides), Sync: time.Duration(z.Sync), Share: time.Duration(z.Share)}
	if z.plan != nil {
		s.Shape = z.limit
	}
	if z.quota != nil {
		s.Quota = z.quotaID()
	}
	return s
}
