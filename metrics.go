// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"hash/fnv"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddy-tokenbucket/ratelimit/internal/topn"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// zoneState is what a zone has counted: its decisions and the keys it
// denies most. It is shared by every zone of that name, across handlers
// and config reloads, as the buckets are; the metrics and the admin API
// read it. Counting costs an atomic add per decision.
type zoneState struct {
	allowed     atomic.Uint64 // passed this zone and went on
	denied      atomic.Uint64 // refused by this zone
	storeErrors atomic.Uint64 // the store failed; fail_mode decided
	cacheHits   atomic.Uint64 // denied by the Redis store's over-limit cache
	// ownBurst throttles the errors of requests whose cost is above their
	// key's own burst: one a minute for the zone, whatever handler has it,
	// and across reloads.
	ownBurst throttle.Throttle

	kindsCounts

	// metered counts the handlers using the zone with metrics enabled;
	// the zone is exported while it is above zero.
	metered atomic.Int64

	top *topn.Sketch[store.Key] // the keys it refuses most (topKey)
}

// Destruct is called when no config has the zone any more.
func (*zoneState) Destruct() error { return nil }

// zoneStates holds the zoneState of every zone in the loaded configs, so
// that counters keep counting across reloads. A zone is its name and its
// limit (see Zone.describe): zones of one name and limit share their
// buckets, and count as one; zones of one name with different limits
// limit separately, and count separately.
var zoneStates = caddy.NewUsagePool()

// A zoneID names a zone's state: its name and its limit.
type zoneID struct{ name, limit string }

// topKeysSize is how many keys each zone's heavy-hitter sketch tracks.
const topKeysSize = 64

// topKeyMax bounds the bytes of a key the sketch keeps: a longer key is
// kept as its first bytes and a hash of the whole (topKey).
const topKeyMax = 128

// topKey is k as a zone's heavy-hitter sketch counts it: a key longer
// than topKeyMax as its first bytes and a hash of the whole, so that long
// keys stay distinct in bounded memory.
func topKey(k store.Key) store.Key {
	if len(k.Text) > topKeyMax {
		h := fnv.New64a()
		h.Write([]byte(k.Text))
		k.Text = k.Text[:topKeyMax-20] + "…" + strconv.FormatUint(h.Sum64(), 16)
	}
	return k
}

// keepKey is the copy of k that the sketch keeps, so that it does not
// keep a request's memory alive.
func keepKey(k store.Key) store.Key {
	k.Text = strings.Clone(k.Text)
	return k
}

func acquireZoneState(id zoneID) (*zoneState, error) {
	v, _, err := zoneStates.LoadOrNew(id, func() (caddy.Destructor, error) {
		return &zoneState{top: topn.New(topKeysSize, keepKey)}, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*zoneState), nil
}

// Metrics. Labels hold only zone names, store names and results, all
// fixed by the config: never a key, an IP or any other request value.
const metricsNamespace, metricsSubsystem = "caddy", "rate_limit"

var (
	storeLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_latency_seconds",
		Help:      "Time a store took to decide a request.",
		Buckets:   []float64{0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1},
	}, []string{"store"})

	storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_errors_total",
		Help:      "Requests for which the store failed and fail_mode decided.",
	}, []string{"store"})

	zoneCollector = newCollector()
)

// collector exports what the zone states and the stores count, read
// when Prometheus scrapes.
type collector struct {
	requests, cacheHits, keys, maxKeys, evictions, circuitOpen *prometheus.Desc
}

func newCollector() *collector {
	name := func(n string) string { return prometheus.BuildFQName(metricsNamespace, metricsSubsystem, n) }
	return &collector{
		requests: prometheus.NewDesc(name("requests_total"),
			"Rate limit decisions by zone and result: allowed, denied, dry_run_denied, spilled or store_error; shed or dry_run_shed for an adaptive concurrency limit.",
			[]string{"zone", "limit", "result"}, nil),
		cacheHits: prometheus.NewDesc(name("over_limit_cache_hits_total"),
			"Requests the Redis store denied from its over-limit cache, without asking Redis.",
			[]string{"zone", "limit"}, nil),
		keys: prometheus.NewDesc(name("keys"),
			"Buckets and calendar quota counters the local store tracks.",
			[]string{"zone", "limit"}, nil),
		maxKeys: prometheus.NewDesc(name("max_keys"),
			"The most buckets and calendar quota counters the local store keeps, counted as keys counts them: max_keys for each table of the zone, rounded down to a whole share per shard.",
			[]string{"zone", "limit"}, nil),
		evictions: prometheus.NewDesc(name("evictions_total"),
			"Buckets the local store evicted before they refilled, to stay within max_keys.",
			[]string{"zone", "limit"}, nil),
		circuitOpen: prometheus.NewDesc(name("circuit_open"),
			"Redis connections whose circuit breaker is open: their store decides by fail_mode.",
			nil, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.requests
	ch <- c.cacheHits
	ch <- c.keys
	ch <- c.maxKeys
	ch <- c.evictions
	ch <- c.circuitOpen
	for _, k := range kinds {
		for _, d := range k.descs {
			ch <- d
		}
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	exported := make(map[zoneID]bool)
	zoneStates.Range(func(k, v any) bool {
		id, s := k.(zoneID), v.(*zoneState)
		if s.metered.Load() <= 0 {
			return true
		}
		exported[id] = true
		c.collectZone(ch, id, s)
		return true
	})
	c.collectStores(ch, exported)
}

// collectZone exports what a zone has counted.
func (c *collector) collectZone(ch chan<- prometheus.Metric, id zoneID, s *zoneState) {
	var counter counterFunc = func(d *prometheus.Desc, n *atomic.Uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(n.Load()), append([]string{id.name, id.limit}, labels...)...)
	}
	counter(c.requests, &s.allowed, "allowed")
	counter(c.requests, &s.denied, "denied")
	counter(c.requests, &s.storeErrors, "store_error")
	counter(c.cacheHits, &s.cacheHits)
	for _, k := range kinds {
		if k.collect != nil {
			k.collect(ch, counter, c.requests, id, s)
		}
	}
}

// A counterFunc exports a counter of a zone, with the labels that follow
// its zone and limit.
type counterFunc func(d *prometheus.Desc, n *atomic.Uint64, labels ...string)

// collectStores exports what the stores of the provisioned handlers keep
// (read through their stats): the keys, capacity and evictions of each
// zone, the tables that zones of one name and limit share counted once,
// the kinds' metrics their stores keep (see kind.collectStore), and the
// connections whose circuit breaker is open.
func (c *collector) collectStores(ch chan<- prometheus.Metric, exported map[zoneID]bool) {
	t := storeTotals{zones: make(map[zoneID]*tracked), tables: make(map[any]bool), copies: make(map[any]bool),
		clients: make(map[any]bool), sums: make(map[zoneID]*store.ZoneStats)}
	counted := make(map[zoneID]zoneRef)
	registry.Lock()
	for _, refs := range registry.zones {
		for _, ref := range refs {
			id := ref.z.id
			if _, ok := counted[id]; !ok && exported[id] && !ref.z.rateless {
				counted[id] = ref
			}
			for _, s := range []store.Store{ref.h.store, ref.h.fallback} {
				if s != nil {
					t.add(id, s.Stats(ref.z.index), exported[id])
				}
			}
		}
	}
	registry.Unlock()
	for id, z := range t.zones {
		ch <- prometheus.MustNewConstMetric(c.keys, prometheus.GaugeValue, float64(z.keys), id.name, id.limit)
		ch <- prometheus.MustNewConstMetric(c.maxKeys, prometheus.GaugeValue, float64(z.capacity), id.name, id.limit)
		ch <- prometheus.MustNewConstMetric(c.evictions, prometheus.CounterValue, float64(z.evictions), id.name, id.limit)
	}
	for id, ref := range counted {
		var sum store.ZoneStats
		if s := t.sums[id]; s != nil {
			sum = *s
		}
		for _, k := range kinds {
			if k.collectStore != nil {
				k.collectStore(ch, id, ref, sum)
			}
		}
	}
	open := 0
	for _, down := range t.clients {
		if down {
			open++
		}
	}
	ch <- prometheus.MustNewConstMetric(c.circuitOpen, prometheus.GaugeValue, float64(open))
}

// storeTotals add up what the stores report of the zones: what zones of
// one name and limit share (a table, copies) is counted once.
type storeTotals struct {
	zones          map[zoneID]*tracked
	tables, copies map[any]bool
	clients        map[any]bool                // whether each connection is down
	sums           map[zoneID]*store.ZoneStats // what the kinds' collectStore read
}

// tracked are the keys a zone's tables keep.
type tracked struct {
	keys, capacity int
	evictions      uint64
}

// add adds what a store reports of a zone id; exported: the zone's
// metrics are exported.
func (t *storeTotals) add(id zoneID, st store.ZoneStats, exported bool) {
	if st.Client != nil {
		t.clients[st.Client] = st.Unavailable
	}
	if !exported {
		return
	}
	if st.SyncCopies != nil && !t.copies[st.SyncCopies] {
		t.copies[st.SyncCopies] = true
		sumSync(t.sums, id, &st)
	}
	if st.Shares != nil && !t.copies[st.Shares] {
		t.copies[st.Shares] = true
		sumShares(t.sums, id, &st)
	}
	if st.Keys == nil || t.tables[st.Table] {
		return
	}
	t.tables[st.Table] = true
	if t.zones[id] == nil {
		t.zones[id] = new(tracked)
	}
	t.zones[id].keys += *st.Keys
	t.zones[id].capacity += st.Capacity
	t.zones[id].evictions += *st.Evictions
}

// sumSync adds the reconciliations of copies that st reports to the sums
// of the zone id.
func sumSync(sums map[zoneID]*store.ZoneStats, id zoneID, st *store.ZoneStats) {
	s := sums[id]
	if s == nil {
		s = new(store.ZoneStats)
		sums[id] = s
	}
	s.SyncCopies = st.SyncCopies
	s.SyncCalls += st.SyncCalls
	s.SyncFailed += st.SyncFailed
	s.SyncKeys += st.SyncKeys
	s.SyncHeld += st.SyncHeld
}

// sumShares adds what the shares that st reports did to the sums of the
// zone id.
func sumShares(sums map[zoneID]*store.ZoneStats, id zoneID, st *store.ZoneStats) {
	s := sums[id]
	if s == nil {
		s = new(store.ZoneStats)
		sums[id] = s
	}
	s.Shares = st.Shares
	s.ShareGrants += st.ShareGrants
	s.ShareReturns += st.ShareReturns
	s.ShareWriteOffs += st.ShareWriteOffs
	s.ShareHere += st.ShareHere
	s.ShareRedis += st.ShareRedis
	s.ShareKeys += st.ShareKeys
}

// registerMetrics adds the collectors to a config's registry, which is
// new at every config load. Registering again in the same registry (a
// second handler) is fine.
func registerMetrics(reg prometheus.Registerer) error {
	collectors := []prometheus.Collector{storeLatency, storeErrors, zoneCollector}
	for _, k := range kinds {
		collectors = append(collectors, k.collectors...)
	}
	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			if _, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); !ok {
				return err
			}
		}
	}
	return nil
}
