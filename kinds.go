// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// A zone is a token bucket per key (zone.go), whose limit may come with
// each request (plans.go), and may add kinds of limit to it: ban, delay,
// count, usage, estimate, quota, concurrency, concurrency adaptive,
// overrides, dry run, spill and sync. Each kind is a unit of its own
// file, which holds its config fields (a struct embedded in Zone, so that
// the zone's JSON names them as its own), its Caddyfile subdirectives,
// its checks, and what it adds to the zone's description, the admin views
// of the zone and of a key, and the metrics. The parser, the zone, the
// admin API and the metrics go through kinds rather than naming each.
//
// What a kind asks of a store (a ban's or a delay's shape, a quota's
// counter, a slot, a soft demand) is in the store contract (internal/store),
// and its part of a request in the request's stages (decide.go,
// delay.go, settle.go, concurrency.go).

// A kind is one kind of limit a zone may have. Every hook is optional.
type kind struct {
	// in reports whether z has the kind, for the rules between kinds
	// (exclusions).
	in func(z *Zone) bool

	// subdirectives read the kind's subdirectives of a zone block, by
	// name: each its arguments into z, checked as far as they go alone.
	subdirectives map[string]func(d *caddyfile.Dispenser, z *Zone) error
	// repeatable are those of its subdirectives that a zone block may
	// give more than once (estimate json, estimate prompt): the kind
	// refuses a line that sets again what another set.
	repeatable []string

	// check checks the kind's fields of z, and what they need of the
	// zone; what kinds cannot go together is in exclusions.
	check func(z *Zone) error

	// shape sets the kind's part of a bucket's shape, l. fixedShape sets
	// the part that a zone whose limit comes with each request (plans)
	// has whatever the request's limit: its buckets are named by it in
	// the stores (a ban).
	shape      func(z *Zone, l *gcra.Limit) error
	fixedShape func(z *Zone, l *gcra.Limit)

	// provision computes the kind's runtime state of z, after z's limit.
	provision func(z *Zone) error

	// join sets up the kind's part of the zone's state, st, once z has
	// acquired it, and of its handler, h.
	join func(h *Handler, z *Zone, st *zoneState)

	// handlerSubdirectives read the kind's subdirectives of the
	// directive itself, by name, into h; checkHandler checks what the
	// kind asks of the handler and its zones, and provisionHandler sets
	// up the kind's part of the handler.
	handlerSubdirectives map[string]func(d *caddyfile.Dispenser, h *Handler) error
	checkHandler         func(h *Handler) error
	provisionHandler     func(h *Handler)

	// descs are the kind's metrics that collect exports, and collectors
	// those it observes itself.
	descs      []*prometheus.Desc
	collectors []prometheus.Collector

	// collect exports the kind's metrics of the zone id, from its state s:
	// counter exports one of s's counters, and requests is the metric of
	// decisions by result.
	collect func(ch chan<- prometheus.Metric, counter counterFunc, requests *prometheus.Desc, id zoneID, s *zoneState)

	// collectStore exports the kind's metrics of the zone id that its
	// store keeps, read through ref or summed in sum (over the stores of
	// the zones of that id, what they share counted once): once for each
	// exported zone with a rate.
	collectStore func(ch chan<- prometheus.Metric, id zoneID, ref zoneRef, sum store.ZoneStats)

	// decided counts in st what the store's answer d to a request says of
	// the kind in the zone's match m (a refusal that started a ban). Only
	// the zones that have the kind (in) run it.
	decided func(st *zoneState, d *store.Demands, m *match)

	// meter starts the kind's metrics of z that it observes itself, and
	// unmeter removes them once no config has the zone.
	meter, unmeter func(z *Zone)

	// describe is the kind's part of the zone's limit in words (see
	// Zone.describe), or "".
	describe func(z *Zone) string

	// info sets the kind's fields of the zone's admin view.
	info func(z *Zone, stats store.ZoneStats, info *zoneInfo)

	// demand adds the kind's demand of the key k of z to d, as a
	// request's would be, for the admin API to read or reset it.
	demand func(z *Zone, k store.Key, d *store.Demands)

	// view sets the kind's fields of the admin view of the key k of z, v,
	// from what the store read of it into d; an error is the API's
	// answer. forget forgets what the kind keeps of the key itself,
	// outside the store (the admin API's DELETE), and reports whether it
	// held anything.
	view   func(ctx context.Context, h *Handler, z *Zone, k store.Key, d *store.Demands, v *keyView) error
	forget func(z *Zone, k store.Key) bool
}

// kindsCounts are what the kinds count in a zone's state (see
// kind.collect).
type kindsCounts struct {
	banCounts
	countCounts
	delayCounts
	usageCounts
	estimateCounts
	adaptiveCounts
	dryRunCounts
	spillCounts
	reservesCounts
}

// kindsInfo are the kinds' fields of a zone's admin view (see kind.info),
// and kindsKeyView those of a key's (see kind.view), in the order of the
// JSON.
type (
	kindsInfo struct {
		banInfo
		delayInfo
		concurrencyInfo
		adaptiveInfo
		quotaZoneInfo
		estimateInfo
		dryRunInfo
		spillInfo
		reservesInfo
	}
	kindsKeyView struct {
		banKeyView
		quotaKeyView
		overridesKeyView
		concurrencyKeyView
		adaptiveKeyView
		shareKeyViewField
		reservesKeyView
	}
)

// kinds are every kind, in the order their checks run (a zone with
// several faults is told of the first) and their parts of a zone's
// description.
var kinds = []*kind{
	&adaptiveKind, &concurrencyKind, &quotaKind, &usageKind, &estimateKind, &overridesKind, &syncKind, &shareKind,
	&banKind, &delayKind, &countKind, &dryRunKind, &spillKind, &reservesKind,
}

// zoneSubdirectives and handlerSubdirectives are the subdirectives that
// kinds read, of a zone block and of the directive.
var (
	zoneSubdirectives    = byName(func(k *kind) map[string]func(*caddyfile.Dispenser, *Zone) error { return k.subdirectives })
	handlerSubdirectives = byName(func(k *kind) map[string]func(*caddyfile.Dispenser, *Handler) error { return k.handlerSubdirectives })
	// zoneRepeatable are the zone subdirectives that may be given more
	// than once (see kind.repeatable).
	zoneRepeatable = func() map[string]bool {
		m := make(map[string]bool)
		for _, k := range kinds {
			for _, name := range k.repeatable {
				m[name] = true
			}
		}
		return m
	}()
)

// byName merges what every kind registers by name.
func byName[T any](of func(*kind) map[string]T) map[string]T {
	m := make(map[string]T)
	for _, k := range kinds {
		for name, f := range of(k) {
			if _, dup := m[name]; dup {
				panic("subdirective " + name + " registered twice")
			}
			m[name] = f
		}
	}
	return m
}

// checkKinds runs every kind's check of the handler.
func (h *Handler) checkKinds() error {
	return eachKind(h, func(k *kind) func(*Handler) error { return k.checkHandler })
}

// checkKinds runs every kind's own check of z, then checks the rules
// between the kinds it has.
func (z *Zone) checkKinds() error {
	if err := eachKind(z, func(k *kind) func(*Zone) error { return k.check }); err != nil {
		return err
	}
	for _, x := range exclusions {
		if x.a.in(z) && x.b.in(z) {
			return errors.New(x.why)
		}
	}
	return nil
}

// exclusions are the kinds a zone cannot have together, and why, in the
// order they are checked (a zone with several is told of the first).
var exclusions = []struct {
	a, b *kind
	why  string
}{
	{&adaptiveKind, &concurrencyKind, "concurrency adaptive and a fixed concurrency exclude each other: a zone has one limit on requests in flight"},
	{&quotaKind, &banKind, "ban does not combine with quota: a quota refuses until its window ends already; put the rate with the ban in a zone of its own"},
	{&quotaKind, &concurrencyKind, "concurrency does not combine with quota: a zone with concurrency counts requests in flight; give the quota a zone of its own"},
	// A bucket that owes more than a whole bucket reads as banned, as
	// requests waiting for their tokens, or as a debt after usage: a
	// zone has one of the three.
	{&usageKind, &banKind, "usage cannot go with ban: a bucket in debt after a response's usage would read as banned"},
	{&usageKind, &delayKind, "usage cannot go with delay: requests would wait for tokens that a bucket in debt owes"},
	{&delayKind, &banKind, "ban and delay exclude each other: a zone either refuses an excess for a while (ban) or lets it wait (delay)"},
	{&spillKind, &delayKind, "spill cannot go with delay: a request over the limit either waits for its tokens (delay) or goes on to the fallback (spill)"},
	{&spillKind, &adaptiveKind, "spill cannot go with concurrency adaptive: a request it sheds is answered 503 before the zone could spill it"},
	// A zone with sync decides from this instance's copies; what only
	// Redis can hold for every instance stays exact.
	{&syncKind, &banKind, "sync cannot go with ban: a ban starts once, in Redis, for every instance"},
	{&syncKind, &delayKind, "sync cannot go with delay: a waiting request holds tokens that only Redis can reserve for every instance"},
	{&syncKind, &countKind, "sync cannot go with count: tokens given back after the response would not reach the other instances' copies"},
	{&syncKind, &usageKind, "sync cannot go with usage: a response's usage is charged to the shared bucket, not to this instance's copy"},
	{&syncKind, &quotaKind, "sync cannot go with quota: a calendar quota is counted exactly, in Redis"},
	{&syncKind, &concurrencyKind, "sync cannot go with concurrency: its slots are leases that Redis holds for every instance"},
	// A zone with share decides from shares of its buckets' tokens, given
	// out in advance: what would change a bucket beyond what its shares
	// account for stays with exact zones.
	{&shareKind, &syncKind, "share and sync exclude each other: a zone's requests are decided from shares that never over-admit (share) or from copies reconciled after (sync)"},
	{&shareKind, &banKind, "share cannot go with ban: a ban in Redis would not reach the shares already out"},
	{&shareKind, &delayKind, "share cannot go with delay: a waiting request holds tokens that only Redis can reserve for every instance"},
	{&shareKind, &countKind, "share cannot go with count: tokens given back after the response would bypass the shares out"},
	{&shareKind, &usageKind, "share cannot go with usage: a response's usage is charged after the decision, and could overdraw the bucket behind the shares out"},
	{&shareKind, &quotaKind, "share cannot go with quota: a calendar quota is counted exactly, in Redis; give it a zone of its own"},
	{&shareKind, &concurrencyKind, "share cannot go with concurrency: its slots are leases that Redis holds for every instance; give it a zone of its own"},
	{&shareKind, &adaptiveKind, "share cannot go with concurrency adaptive: give the adaptive limit a zone of its own"},
	// A reserve is kept exactly, in the one bucket every instance takes
	// from, for every class.
	{&reservesKind, &syncKind, "reserve cannot go with sync: copies reconciled after the decision cannot keep a reserve exact"},
	{&reservesKind, &shareKind, "reserve cannot go with share: shares given out in advance cannot keep a reserve exact"},
	{&reservesKind, &banKind, "reserve cannot go with ban: a refusal of a lower class would ban the key for every class"},
	{&reservesKind, &delayKind, "reserve cannot go with delay: a waiting request of a lower class would hold the tokens kept for the classes above"},
}

// eachKind runs the hook that of gives of every kind that has one on v,
// in the kinds' order, and returns the first error.
func eachKind[T any](v T, of func(*kind) func(T) error) error {
	for _, k := range kinds {
		if f := of(k); f != nil {
			if err := f(v); err != nil {
				return err
			}
		}
	}
	return nil
}

// durationSub reads a subdirective whose one argument is a duration (a
// duration such as example) into the field of z that field gives, and
// checks it.
func durationSub(example string, field func(z *Zone) *caddy.Duration, check func(time.Duration) error) func(*caddyfile.Dispenser, *Zone) error {
	return func(d *caddyfile.Dispenser, z *Zone) error {
		t, err := durationArg(d, example)
		if err != nil {
			return err
		}
		*field(z) = caddy.Duration(t)
		return wrapErr(d, check(t))
	}
}

// wrapErr is err, at d's token.
func wrapErr(d *caddyfile.Dispenser, err error) error {
	if err == nil {
		return nil
	}
	return d.WrapErr(err)
}
