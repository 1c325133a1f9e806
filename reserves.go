// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// Zones with reserves: the classes of request above the lowest keep a
// share of the bucket's burst for themselves. A request's class (its
// priority) makes its bucket's limit keep the reserves of the classes
// above its own (gcra.Limit.Kept): the take is allowed while the bucket
// holds its cost above them, in both stores and in the Redis store's
// over-limit cache alike, since all three decide by the request's
// limit. The classes and their rules are those of `concurrency
// adaptive`'s reserves (adaptive_zone.go).

// reservesConfig is a zone's reserves of its bucket for classes of
// request.
type reservesConfig struct {
	// The class of a request, for the zone's reserves: placeholders, such
	// as `{http.request.header.X-Priority}`, whose expansion is a class
	// that reserve names, or any other value (or none) for the lowest
	// class. Required with reserve. Default: none, every request of one
	// class.
	Priority string `json:"priority,omitempty"`

	// The classes above the lowest, from the highest down, each with the
	// share of the bucket's burst held back for it and the classes above
	// it: a request is admitted only if, after its cost (or estimate) is
	// taken, the bucket still holds the reserves of the classes above its
	// own. So the highest class may use the whole burst, and the lowest
	// (`other`, every request that no reserve names) the burst less every
	// reserve. A key's own burst (an override) or a plan's keeps the same
	// shares. Each share is above 0% and below 100%, and together below
	// 100%; each class once. Required with priority. Not with ban,
	// delay, sync or share. Default: none.
	Reserve []AdaptiveReserve `json:"reserve,omitempty"`
}

var reservesKind = kind{
	in: func(z *Zone) bool { return z.Priority != "" || len(z.Reserve) > 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"priority": func(d *caddyfile.Dispenser, z *Zone) error { return priorityArg(d, &z.Priority) },
		"reserve":  func(d *caddyfile.Dispenser, z *Zone) error { return reserveArg(d, &z.Reserve) },
	},
	repeatable: []string{"reserve"},
	check:      (*Zone).checkReserves,
	shape: func(z *Zone, l *gcra.Limit) error {
		// A fixed limit: the lowest class must be able to pay its cost.
		if len(z.Reserve) == 0 {
			return nil
		}
		shares := reserveShares(z.Reserve)
		low := l.Keeping(shares[len(shares)-1])
		if cost := max(z.Cost, 1); low.Capacity() < cost {
			return fmt.Errorf("reserves leave the lowest class %d of the burst of %d: below the cost of %d, no request of it could pass", low.Capacity(), l.Burst, cost)
		}
		return nil
	},
	provision: func(z *Zone) error {
		z.reserves = nil
		if len(z.Reserve) > 0 {
			names := classNames(z.Reserve)
			z.reserves = &reserveZone{priorityClasses: newPriorityClasses(z.Priority, names), names: names, shares: reserveShares(z.Reserve)}
		}
		return nil
	},
	join: func(_ *Handler, z *Zone, st *zoneState) {
		if z.reserves != nil {
			st.classDenials.CompareAndSwap(nil, &classDenials{names: z.reserves.names, denied: make([]atomic.Uint64, len(z.reserves.names))})
			z.reserves.denials = st.classDenials.Load()
		}
	},
	decided: func(st *zoneState, d *store.Demands, m *match) {
		if c := st.classDenials.Load(); c != nil && m.bucket >= 0 {
			if b := &d.Buckets[m.bucket]; !b.OK && !b.Soft {
				c.denied[m.class].Add(1)
			}
		}
	},
	describe: func(z *Zone) string {
		if len(z.Reserve) == 0 {
			return ""
		}
		s := "reserve"
		for _, r := range z.Reserve {
			s += " " + r.Class + " " + strconv.FormatFloat(r.Percent, 'g', -1, 64) + "%"
		}
		return s
	},
	descs: []*prometheus.Desc{classDeniedDesc},
	collect: func(ch chan<- prometheus.Metric, _ counterFunc, _ *prometheus.Desc, id zoneID, s *zoneState) {
		if c := s.classDenials.Load(); c != nil {
			for i, name := range c.names {
				ch <- prometheus.MustNewConstMetric(classDeniedDesc, prometheus.CounterValue, float64(c.denied[i].Load()), id.name, id.limit, name)
			}
		}
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		r := z.reserves
		if r == nil {
			return
		}
		info.Reserves = &reservesZoneInfo{Priority: z.Priority}
		for i, name := range r.names {
			ci := reserveClassInfo{Class: name, Denied: r.denials.denied[i].Load()}
			if i < len(z.Reserve) {
				ci.Reserve = z.Reserve[i].Percent
			}
			info.Reserves.Classes = append(info.Reserves.Classes, ci)
		}
	},
	view: func(_ context.Context, _ *Handler, z *Zone, _ store.Key, d *store.Demands, v *keyView) error {
		r := z.reserves
		if r == nil || len(d.Buckets) == 0 || !z.knownLimit(&d.Buckets[0]) {
			return nil
		}
		b := &d.Buckets[0]
		for i, name := range r.names {
			l := b.Limit.Keeping(r.shares[i])
			v.Classes = append(v.Classes, reserveKeyClass{Class: name, Remaining: l.WholeTokens(b.Debt), Capacity: l.Capacity()})
		}
		return nil
	},
}

// checkReserves checks a zone's priority and reserves, and that it has a
// bucket to keep them in.
func (z *Zone) checkReserves() error {
	if z.Priority == "" && len(z.Reserve) == 0 {
		return nil
	}
	if err := checkClasses(z.Priority, z.Reserve); err != nil {
		return err
	}
	if !z.hasRate() {
		return errors.New("reserve needs a rate: it keeps part of the zone's bucket")
	}
	return nil
}

// reserveShares are, by class from the highest, the shares of the burst
// that a request of the class keeps for the classes above its own: 0
// for the highest, every reserve for the lowest.
func reserveShares(reserves []AdaptiveReserve) []float64 {
	shares := make([]float64, len(reserves)+1)
	sum := 0.0
	for i, r := range reserves {
		sum += r.Percent
		shares[i+1] = sum / 100
	}
	return shares
}

// classNames are the names of the classes of reserves, from the highest:
// the reserves' and lowestClass.
func classNames(reserves []AdaptiveReserve) []string {
	names := make([]string, 0, len(reserves)+1)
	for _, r := range reserves {
		names = append(names, r.Class)
	}
	return append(names, lowestClass)
}

// reserveZone is a zone's reserves at run time.
type reserveZone struct {
	priorityClasses
	names   []string      // the classes, from the highest
	shares  []float64     // by class: what it keeps for those above (reserveShares)
	denials *classDenials // the zone state's
}

// keeping is l as a request of r's class sees it, and that class.
func (rz *reserveZone) keeping(r *http.Request, l gcra.Limit) (gcra.Limit, int) {
	class := rz.classOf(r)
	return l.Keeping(rz.shares[class]), class
}

// classDenials are the requests of each class that a zone with reserves
// refused, in its state, from the highest class. A zone's reserves are
// part of its limit (see describe), so the classes of a zone state never
// change.
type classDenials struct {
	names  []string
	denied []atomic.Uint64
}

// reservesCounts are what reserves count, in a zone's state.
type reservesCounts struct {
	classDenials atomic.Pointer[classDenials] // nil without reserves
}

// classDeniedDesc is the metric of the refusals of a zone with reserves,
// by class.
var classDeniedDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "class_denied_total"),
	"Requests that a zone with reserves refused, by class: a class of a reserve, or other.",
	[]string{"zone", "limit", "class"}, nil)

// reservesInfo is a zone's reserves in the admin API, and
// reservesKeyView a key's tokens by class.
type (
	reservesInfo struct {
		Reserves *reservesZoneInfo `json:"reserves,omitempty"`
	}
	reservesKeyView struct {
		// With reserves: the whole tokens that each class may take now,
		// and at most, from the highest class.
		Classes []reserveKeyClass `json:"classes,omitempty"`
	}
)

// reservesZoneInfo describes a zone's reserves in the admin API.
type reservesZoneInfo struct {
	Priority string             `json:"priority"`
	Classes  []reserveClassInfo `json:"classes"`
}

// reserveClassInfo is a class of a zone with reserves: its reserve (0
// for the lowest) and the requests of it that the zone refused.
type reserveClassInfo struct {
	Class   string  `json:"class"`
	Reserve float64 `json:"reserve_percent"`
	Denied  uint64  `json:"denied"`
}

// reserveKeyClass is what a class may take of a key's bucket: the
// tokens now, and the most (the burst less the reserves above it).
type reserveKeyClass struct {
	Class     string `json:"class"`
	Remaining int64  `json:"remaining"`
	Capacity  int64  `json:"capacity"`
}
