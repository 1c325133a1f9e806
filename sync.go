// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"fmt"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

const (
	minSync, maxSync = time.Millisecond, time.Minute

	// syncOwe is how many intervals of refill the shared bucket of a zone
	// with sync may owe beyond empty: what the instances spent together
	// beyond it before their copies knew, which the bound counts on being
	// charged. About one interval an instance: room for 32 of them.
	syncOwe = 32
)

func checkSyncInterval(d time.Duration) error {
	if d < minSync || d > maxSync {
		return fmt.Errorf("invalid sync %v: must be 1ms to 1m", d)
	}
	return nil
}

// syncConfig is a zone's interval of reconciliation with Redis.
type syncConfig struct {
	// Decide the zone's requests in this instance, from its own copy of
	// each key's shared bucket, and reconcile the copies with Redis every
	// this long: what this instance spent goes up, the shared state comes
	// back, many keys in one script call. With N instances, they admit
	// together at most (N - 1) x (rate x sync + 1) more than Redis alone
	// would, and a key this instance has no copy of is decided by Redis.
	// While Redis is down the zone goes on deciding here, not by
	// fail_mode (see docs/sync.md). Needs the Redis store and a rate;
	// not with ban, delay, count, usage, quota or concurrency. A duration
	// from 1ms to 1m. Default: none (Redis decides every request).
	Sync caddy.Duration `json:"sync,omitempty"`
}

var syncKind = kind{
	in: func(z *Zone) bool { return z.Sync != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"sync": durationSub("100ms", func(z *Zone) *caddy.Duration { return &z.Sync }, checkSyncInterval),
	},
	check:        (*Zone).checkSync,
	checkHandler: (*Handler).checkSyncStore,
	descs:        []*prometheus.Desc{syncReconciliationsDesc, syncKeysDesc, syncCopiesDesc},
	collectStore: collectSync,
	shape: func(z *Zone, l *gcra.Limit) error {
		if z.Sync == 0 {
			return nil
		}
		var err error
		*l, err = withSyncDebt(*l, time.Duration(z.Sync))
		return err
	},
}

// checkSync checks a zone's sync; what it cannot go with (what takes or
// gives back tokens that only Redis can account for exactly) is in
// exclusions.
func (z *Zone) checkSync() error {
	if z.Sync == 0 {
		return nil
	}
	if err := checkSyncInterval(time.Duration(z.Sync)); err != nil {
		return err
	}
	if !z.hasRate() {
		return errors.New("sync needs a rate: it shares the zone's token buckets")
	}
	return nil
}

// errSyncNeedsRedis refuses the zone name's sync on a store of one
// instance.
func errSyncNeedsRedis(name string) error {
	return fmt.Errorf("zone %s: sync needs the Redis store (store redis { ... }): it shares a limit between instances", name)
}

// checkSyncStore checks that the zones with sync have the Redis store:
// the local store is one instance's, exact already (and refuses them
// when it binds them).
func (h *Handler) checkSyncStore() error {
	if h.storeBackend() == "redis" {
		return nil
	}
	for _, z := range h.Zones {
		if z != nil && z.Sync != 0 {
			return errSyncNeedsRedis(z.Name)
		}
	}
	return nil
}

// withSyncDebt is l of a zone that syncs every interval: its bucket may
// owe syncOwe intervals beyond empty.
func withSyncDebt(l gcra.Limit, interval time.Duration) (gcra.Limit, error) {
	l.Owe = syncOwe * interval
	if l.BurstTime+l.Owe > gcra.MaxBurstTime {
		return gcra.Limit{}, fmt.Errorf("invalid sync %v: the burst and %d intervals must refill within 100 years", interval, syncOwe)
	}
	return l, nil
}

// syncZones holds the copies of every zone with sync, by its Redis
// setup, its buckets' names and its interval, so that a reload that
// keeps them keeps the copies and what they spent, and their
// reconciliation goes on.
var syncZones = caddy.NewUsagePool()

// syncPooled is the syncPool of syncZones.
type syncPooled struct{}

func (syncPooled) Acquire(id redisstore.SyncID, make func() *redisstore.SyncZone) (*redisstore.SyncZone, error) {
	v, _, err := syncZones.LoadOrNew(id, func() (caddy.Destructor, error) { return make(), nil })
	if err != nil {
		return nil, err
	}
	return v.(*redisstore.SyncZone), nil
}

func (syncPooled) Release(id redisstore.SyncID) error {
	_, err := syncZones.Delete(id)
	return err
}

// The metrics of the zones with sync, from what their stores report of
// their copies (store.ZoneStats).
var (
	syncReconciliationsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "sync_reconciliations_total"),
		"Reconciliations of a zone with sync with Redis, one script call each (one per hash tag on a cluster), by result: ok or error.",
		[]string{"zone", "limit", "result"}, nil)
	syncKeysDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "sync_reconciled_keys_total"),
		"Keys that the reconciliations of a zone with sync carried: over sync_reconciliations_total, their size.",
		[]string{"zone", "limit"}, nil)
	syncCopiesDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "sync_keys"),
		"Keys of a zone with sync that this instance holds a copy of.",
		[]string{"zone", "limit"}, nil)
)

// collectSync exports the reconciliations of the zone id's copies, summed
// over its stores.
func collectSync(ch chan<- prometheus.Metric, id zoneID, _ zoneRef, sum store.ZoneStats) {
	if sum.SyncCopies == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(syncReconciliationsDesc, prometheus.CounterValue, float64(sum.SyncCalls-sum.SyncFailed), id.name, id.limit, "ok")
	ch <- prometheus.MustNewConstMetric(syncReconciliationsDesc, prometheus.CounterValue, float64(sum.SyncFailed), id.name, id.limit, "error")
	ch <- prometheus.MustNewConstMetric(syncKeysDesc, prometheus.CounterValue, float64(sum.SyncKeys), id.name, id.limit)
	ch <- prometheus.MustNewConstMetric(syncCopiesDesc, prometheus.GaugeValue, float64(sum.SyncHeld), id.name, id.limit)
}
