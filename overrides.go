// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// Overrides: a key's own limit in a zone, set and removed through the
// admin API while Caddy runs, in place of the zone's limit (or its
// plan's). An override is a rate and a burst; the zone's ban, delay and
// the debt its usage may run up stay the zone's. A store keeps its
// overrides beside its buckets: the local store in the shards of the
// zone's table, under the bucket's own lock; the Redis store in a key of
// the bucket's own cluster slot, read by the decision's one script call.
//
// A change of a key's limit carries its bucket over (see limit.retune
// for a zone with a fixed limit; in a zone whose limit comes with each
// request, an override is one more plan, and the bucket keeps the
// fraction it owed, as limit.rescale says).

// overridesConfig bounds a zone's overrides.
type overridesConfig struct {
	// The most keys of the zone with a limit of their own, set through the
	// admin API (`PUT /rate_limit/<zone>/<key>/limit`) in place of the
	// zone's: beyond it, setting one more is refused (409). Needs a rate.
	// Default: 100000.
	MaxOverrides int64 `json:"max_overrides,omitempty"`
}

var overridesKind = kind{
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"max_overrides": func(d *caddyfile.Dispenser, z *Zone) error {
			var err error
			if z.MaxOverrides, err = intArg[int64](d); err != nil {
				return err
			}
			return wrapErr(d, checkMaxOverrides(z.MaxOverrides))
		},
	},
	check: func(z *Zone) error {
		switch {
		case z.MaxOverrides == 0:
			return nil
		case !z.hasRate():
			return errors.New("max_overrides needs a rate: an override is a key's own rate and burst")
		}
		return checkMaxOverrides(z.MaxOverrides)
	},
	descs:        []*prometheus.Desc{overridesDesc},
	collectStore: collectOverrides,
	view: func(ctx context.Context, h *Handler, z *Zone, k store.Key, _ *store.Demands, v *keyView) error {
		if z.rateless {
			return nil
		}
		o, has, err := h.store.Override(ctx, z.index, k)
		if err != nil {
			return apiError(http.StatusBadGateway, "reading the key's limit: %v", err)
		}
		if has {
			v.Override = zoneRef{h: h, z: z}.ownLimit("", o)
		}
		return nil
	},
}

var overridesDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "overrides"),
	"Keys with a limit of their own, set through the admin API, that have not ended.",
	[]string{"zone", "limit"}, nil)

// collectOverrides exports how many keys have their own limit in the
// zone id, as its store counts them (the Redis store: in one call, within
// its timeout; a zone whose store cannot tell is left out).
func collectOverrides(ch chan<- prometheus.Metric, id zoneID, ref zoneRef, _ store.ZoneStats) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	n, err := ref.h.store.OverrideCount(ctx, ref.z.index)
	cancel()
	if err == nil {
		ch <- prometheus.MustNewConstMetric(overridesDesc, prometheus.GaugeValue, float64(n), id.name, id.limit)
	}
}

// overridesKeyView is a key's own limit in the admin API.
type overridesKeyView struct {
	// The key's own limit, which tokens and burst are of, when it has one.
	Override *ownLimit `json:"override,omitempty"`
}

func checkMaxOverrides(n int64) error { return checkMin("max_overrides", n, 1) }
