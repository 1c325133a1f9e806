// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

const minShare, maxShare = 10 * time.Millisecond, 10 * time.Minute

func checkShareTTL(d time.Duration) error {
	if d < minShare || d > maxShare {
		return fmt.Errorf("invalid share %v: must be 10ms to 10m", d)
	}
	return nil
}

// shareConfig is how long the shares of a zone's buckets last.
type shareConfig struct {
	// Decide a busy key's requests in this instance, from a share of its
	// bucket's tokens that Redis grants in advance and that lasts this
	// long, renewed while the key is busy and returned when it goes
	// idle; a key used rarely is decided by Redis, exactly. However many
	// instances, they never admit more than one exact bucket would
	// (docs/share.md). Needs the Redis store and a fixed rate; not with
	// sync, ban, delay, count, usage, quota, concurrency, plans or keys'
	// own limits. A duration from 10ms to 10m. Default: none (Redis
	// decides every request).
	Share caddy.Duration `json:"share,omitempty"`
}

var shareKind = kind{
	in: func(z *Zone) bool { return z.Share != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"share": durationSub("1s", func(z *Zone) *caddy.Duration { return &z.Share }, checkShareTTL),
	},
	check:        (*Zone).checkShare,
	checkHandler: (*Handler).checkShareStore,
	descs:        []*prometheus.Desc{shareGrantsDesc, shareReturnsDesc, shareWriteOffsDesc, shareDecisionsDesc, shareKeysDesc},
	collectStore: collectShare,
	view: func(ctx context.Context, h *Handler, z *Zone, k store.Key, _ *store.Demands, v *keyView) error {
		sh, ok := h.store.(store.Sharer)
		if z.Share == 0 || !ok {
			return nil
		}
		st, err := sh.ShareState(ctx, z.index, k)
		if err != nil {
			return apiError(http.StatusBadGateway, "reading the shares: %v", err)
		}
		tokens := func(d time.Duration) float64 { return float64(d) / float64(z.limit.TokenTime) }
		if v.Tokens != nil {
			*v.Tokens = min(*v.Tokens, tokens(z.limit.BurstTime-st.Out))
		}
		v.Share = &shareKeyView{Out: tokens(st.Out), Holders: st.Holders, Here: tokens(st.Here), EndsIn: st.EndsIn.Seconds()}
		return nil
	},
}

// shareKeyView is a key's shares in the admin API: the tokens out in
// every share (granted, not reported spent), the shares, this instance's
// share and the seconds until it ends here.
type shareKeyView struct {
	Out     float64 `json:"out"`
	Holders int     `json:"holders"`
	Here    float64 `json:"here"`
	EndsIn  float64 `json:"ends_in"`
}

type shareKeyViewField struct {
	Share *shareKeyView `json:"share,omitempty"`
}

// checkShare checks a zone's share; what it cannot go with is in
// exclusions.
func (z *Zone) checkShare() error {
	if z.Share == 0 {
		return nil
	}
	if err := checkShareTTL(time.Duration(z.Share)); err != nil {
		return err
	}
	if !z.hasRate() {
		return errors.New("share needs a rate: it shares the zone's token buckets")
	}
	if z.perRequest() {
		return errors.New("share needs a fixed limit: shares already out cannot follow a rate, burst or cost that each request brings (plans); give the plans' zone no share")
	}
	return nil
}

// checkShareStore checks that the zones with share have the Redis store.
func (h *Handler) checkShareStore() error {
	if h.storeBackend() == "redis" {
		return nil
	}
	for _, z := range h.Zones {
		if z != nil && z.Share != 0 {
			return fmt.Errorf("zone %s: share needs the Redis store (store redis { ... }): it shares a limit between instances", z.Name)
		}
	}
	return nil
}

// errShareOwnLimit refuses a key's own limit in a zone with share.
var errShareOwnLimit = errors.New("a zone with share has no keys' own limits: the shares already out could not follow a new one")

// The metrics of the zones with share, from what their stores report
// (store.ZoneStats).
var (
	shareGrantsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "share_grants_total"),
		"Shares of a key's tokens that Redis granted this instance in a zone with share, renewals included.",
		[]string{"zone", "limit"}, nil)
	shareReturnsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "share_returns_total"),
		"Shares that this instance returned to Redis, what they did not spend going back to the bucket.",
		[]string{"zone", "limit"}, nil)
	shareWriteOffsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "share_write_offs_total"),
		"Shares that ended in this instance unreturned: Redis writes off what they did not spend, which comes back by refill.",
		[]string{"zone", "limit"}, nil)
	shareDecisionsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "share_decisions_total"),
		"Requests of a zone with share, by where they were decided: here (from a share, or a refusal remembered) or redis.",
		[]string{"zone", "limit", "where"}, nil)
	shareKeysDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "share_keys"),
		"Keys of a zone with share that this instance tracks.",
		[]string{"zone", "limit"}, nil)
)

// collectShare exports what the zone id's stores did with shares.
func collectShare(ch chan<- prometheus.Metric, id zoneID, _ zoneRef, sum store.ZoneStats) {
	if sum.Shares == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(shareGrantsDesc, prometheus.CounterValue, float64(sum.ShareGrants), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(shareReturnsDesc, prometheus.CounterValue, float64(sum.ShareReturns), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(shareWriteOffsDesc, prometheus.CounterValue, float64(sum.ShareWriteOffs), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(shareDecisionsDesc, prometheus.CounterValue, float64(sum.ShareHere), id.name, id.limit, "here")
	ch <- prometheus.MustNewConstMetric(shareDecisionsDesc, prometheus.CounterValue, float64(sum.ShareRedis), id.name, id.limit, "redis")
	ch <- prometheus.MustNewConstMetric(shareKeysDesc, prometheus.GaugeValue, float64(sum.ShareKeys), id.name, id.limit)
}
