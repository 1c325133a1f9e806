// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// A zone is a token bucket per key (zone.go), whose limit may come with
// each request (plans.go), and may add kinds of limit to it: ban, delay,
// count, usage, quota, concurrency, concurrency adaptive, overrides, dry
// run and sync. Each kind is a unit of its own file, which holds its
// config fields (a struct embedded in Zone, so that the zone's JSON names
// them as its own), its Caddyfile subdirectives, its checks, and what it
// adds to the zone's description, the admin views of the zone and of a
// key, and the metrics. The parser, the zone, the admin API and the
// metrics go through kinds rather than naming each.
//
// What a kind asks of a store (a ban's or a delay's shape, a quota's
// counter, a slot) is in the store contract (store.go), and its part of
// a request in the request's stages (decide.go, delay.go, settle.go,
// concurrency.go).

// A kind is one kind of limit a zone may have. Every hook is optional.
type kind struct {
	// subdirectives read the kind's subdirectives of a zone block, by
	// name: each its arguments into z, checked as far as they go alone.
	subdirectives map[string]func(d *caddyfile.Dispenser, z *Zone) error

	// check checks the kind's fields of z, and what they cannot go with.
	check func(z *Zone) error

	// shape sets the kind's part of a bucket's shape, l.
	shape func(z *Zone, l *limit) error

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
	// store keeps, read through ref: once for each exported zone with a
	// rate, zones of one name and limit counted once.
	collectStore func(ch chan<- prometheus.Metric, id zoneID, ref zoneRef)

	// meter starts the kind's metrics of z that it observes itself, and
	// unmeter removes them once no config has the zone.
	meter, unmeter func(z *Zone)

	// describe is the kind's part of the zone's limit in words (see
	// Zone.describe), or "".
	describe func(z *Zone) string

	// info sets the kind's fields of the zone's admin view.
	info func(z *Zone, stats zoneStats, info *zoneInfo)

	// demand adds the kind's demand of the key k of z to d, as a
	// request's would be, for the admin API to read or reset it.
	demand func(z *Zone, k bucketKey, d *demands)

	// view sets the kind's fields of the admin view of the key k of z, v,
	// from what the store read of it into d; an error is the API's
	// answer. forget forgets what the kind keeps of the key itself,
	// outside the store (the admin API's DELETE), and reports whether it
	// held anything.
	view   func(ctx context.Context, h *Handler, z *Zone, k bucketKey, d *demands, v *keyView) error
	forget func(z *Zone, k bucketKey) bool
}

// kindsCounts are what the kinds count in a zone's state (see
// kind.collect).
type kindsCounts struct {
	banCounts
	countCounts
	delayCounts
	usageCounts
	adaptiveCounts
	dryRunCounts
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
		dryRunInfo
	}
	kindsKeyView struct {
		banKeyView
		quotaKeyView
		overridesKeyView
		concurrencyKeyView
		adaptiveKeyView
	}
)

// kinds are every kind, in the order their checks run (a zone with
// several faults is told of the first) and their parts of a zone's
// description.
var kinds = []*kind{
	&adaptiveKind, &concurrencyKind, &quotaKind, &usageKind, &overridesKind, &syncKind,
	&banKind, &delayKind, &countKind, &dryRunKind,
}

// zoneSubdirectives and handlerSubdirectives are the subdirectives that
// kinds read, of a zone block and of the directive.
var (
	zoneSubdirectives    = byName(func(k *kind) map[string]func(*caddyfile.Dispenser, *Zone) error { return k.subdirectives })
	handlerSubdirectives = byName(func(k *kind) map[string]func(*caddyfile.Dispenser, *Handler) error { return k.handlerSubdirectives })
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

// checkKinds runs every kind's check of z.
func (z *Zone) checkKinds() error {
	return eachKind(z, func(k *kind) func(*Zone) error { return k.check })
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
