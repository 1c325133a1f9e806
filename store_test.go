// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// stepQuotaWindow is the length of the quotas' windows in the usage and
// flight steps, which start at a window's start.
const stepQuotaWindow = 100 * time.Second

// The plan steps, whose limit comes with each request, give the same
// decisions on every store. (The steps of fixed limits are the stores'
// conformance suite, internal/store/storetest, which their engines' tests
// run.)
func TestStoresAgree(t *testing.T) {
	t.Run("plans/local", func(t *testing.T) {
		runPlanSteps(t, newTestHandler(t, `{"zones":`+strings.ReplaceAll(planZones, `"name":"`, `"name":"agree-`)+`}`))
	})
	r := startRedis(t)
	for _, storeCfg := range []string{`,"disable_over_limit_cache":true`, ``} {
		t.Run("plans/redis"+storeCfg, func(t *testing.T) {
			runPlanSteps(t, newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":%q%s}}`,
				planZones, r.Addr(), t.Name()+":", storeCfg)))
		})
	}
}

// The zone of the plan steps, whose rate and burst come with each
// request: plan free is 1r/s burst 2 (full in 2s), pro 10r/s burst 5
// (full in 500ms).
const planZones = `[{"name":"p","rate":"{http.vars.rate}","burst":"{http.vars.burst}"}]`

var planValues = map[string]planKey{"free": {rate: "1r/s", burst: "2"}, "pro": {rate: "10r/s", burst: "5"}}

type planStep struct {
	at   time.Duration
	plan string
	ok   bool
	rem  int64
}

var planSteps = []planStep{
	{0, "free", true, 1},
	{0, "free", true, 0},
	{0, "free", false, 0}, // owes 2s: all of its bucket
	// Now pro: the bucket owes all of a pro bucket, from now on…
	{0, "pro", false, 0},
	// …so a pro token comes back at pro's rate, not after free's 2s.
	{100 * time.Millisecond, "pro", true, 0},
	// Back to free, the bucket owes what it owed, all of it: a change of
	// plan hands back no tokens (free would have 1.5 of its 2 if the
	// debt were carried as time).
	{100 * time.Millisecond, "free", false, 0},
	{100 * time.Millisecond, "free", false, 0},
	{100 * time.Millisecond, "pro", false, 0}, // all of a pro bucket again: full at 600ms
	{700 * time.Millisecond, "pro", true, 4},
	// A fifth of a pro bucket owed is a fifth of free's: 0.4s of 2s.
	{700 * time.Millisecond, "free", true, 0},
}

// runPlanSteps replays planSteps against h's store, with the store's
// clock replaced by the steps' instants.
func runPlanSteps(t *testing.T, h *Handler) {
	t.Helper()
	start := time.Now()
	var now time.Time
	if rs, ok := h.store.(*redisstore.Store); ok {
		rs.TestClock = func() time.Time { return now }
	}
	z := h.Zones[0]
	for i, s := range planSteps {
		now = start.Add(s.at)
		p, err := z.parsePlan(planValues[s.plan])
		if err != nil {
			t.Fatal(err)
		}
		reqs := &store.Demands{Buckets: []store.BucketDemand{{Zone: z.index, Key: store.Key{Text: "k"}, Limit: p.limit, Cost: p.costTime}}}
		ok, err := h.store.Take(context.Background(), now, reqs)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if ok != s.ok {
			t.Fatalf("step %d (%s): allowed = %v, want %v", i, s.plan, ok, s.ok)
		}
		if got := reqs.Buckets[0].Remaining(); got != s.rem {
			t.Fatalf("step %d (%s): %d tokens left, want %d", i, s.plan, got, s.rem)
		}
	}
}

// A refund gives an empty bucket its tokens back whatever its rate: one
// whose token is not a whole number of nanoseconds (11/2914ms), emptied,
// then refunded at the same instant, holds a token again on every store.
func TestRefundEmptyBucket(t *testing.T) {
	r := startRedis(t)
	zone := `{"zones":[{"name":"refund","rate":"11/2914ms","burst":2}]`
	for _, tc := range []struct{ name, config string }{
		{"local", zone + `}`},
		{"redis", zone + `,"store":{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"rf1:"}}`},
		{"redis, no cache", zone + `,"store":{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"rf2:","disable_over_limit_cache":true}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, tc.config)
			now := time.Now()
			if rs, ok := h.store.(*redisstore.Store); ok {
				rs.TestClock = func() time.Time { return now }
			}
			z := h.Zones[0]
			reqs := &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, store.Key{Text: "k"})}}
			for range 2 {
				if ok, err := h.store.Take(context.Background(), now, reqs); !ok || err != nil {
					t.Fatalf("take: %v, %v", ok, err)
				}
			}
			if got := reqs.Buckets[0].Remaining(); got != 0 {
				t.Fatalf("%d tokens left after two takes, want 0", got)
			}
			reqs.Buckets[0].Cost = -reqs.Buckets[0].Cost // a refund
			if err := h.store.Adjust(context.Background(), now, reqs); err != nil {
				t.Fatal(err)
			}
			d := &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, store.Key{Text: "k"})}}
			if err := h.store.Peek(context.Background(), now, d); err != nil {
				t.Fatal(err)
			}
			if q := &d.Buckets[0]; q.Remaining() != 1 {
				got := q.Remaining()
				t.Fatalf("%d tokens after the refund, want 1 (debt %v, a token %v)", got, q.Debt, z.costTime)
			}
		})
	}
}

// The zone of the usage steps: 100/m (a token is 600ms), burst 100, and
// a usage that may take the bucket 20 tokens past empty; its quota of
// 1000 counts the same usage.
const usageZones = `[{"name":"u","rate":"100/m","burst":100,"usage":{"json":"usage.total_tokens"},"max_debt":20,
	"quota":1000,"quota_period":"day"}]`

type usageStep struct {
	at     time.Duration
	adjust int64 // tokens a response's usage charges beyond the cost (negative: gives back); 0: a take
	ok     bool  // a take: allowed
	owed   int64 // tokens the bucket owes after the step: 100 is empty, 110 ten in debt
	used   int64 // the quota's count after the step
}

// Costs known after the response: the example of usage's docs (a
// response of 60 tokens, then one of 50, leave the bucket owing 10, and
// the next request waits for 11 tokens: 6.6s), then a debt clamped to
// max_debt, a counter past its limit, and refunds.
var usageSteps = []usageStep{
	{0, 0, true, 1, 1},
	{0, 59, true, 60, 60},
	{0, 0, true, 61, 61},
	{0, 49, true, 110, 110},
	{0, 0, false, 110, 110},
	{6 * time.Second, 0, false, 100, 110},
	{6600 * time.Millisecond, 0, true, 100, 111},
	{6600 * time.Millisecond, 1000, true, 120, 1111},
	{6600 * time.Millisecond, 0, false, 120, 1111},
	{6600 * time.Millisecond, -5, true, 115, 1106},
	{6600 * time.Millisecond, -200, true, 0, 906},
}

// runUsageSteps replays usageSteps against h's store, as runPlanSteps
// replays planSteps, and reads the bucket and counter back after each.
func runUsageSteps(t *testing.T, h *Handler) {
	t.Helper()
	start := time.Unix(time.Now().Add(stepQuotaWindow).Unix()/100*100, 0)
	var now time.Time
	if rs, ok := h.store.(*redisstore.Store); ok {
		rs.TestClock = func() time.Time { return now }
	}
	z := h.Zones[0]
	z.quota.Every = stepQuotaWindow
	k := store.Key{Text: "k"}
	for i, s := range usageSteps {
		now = start.Add(s.at)
		d := &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, k)}, Counters: []store.CounterDemand{counterReq(z, k, now)}}
		var err error
		if s.adjust == 0 {
			var ok bool
			if ok, err = h.store.Take(context.Background(), now, d); ok != s.ok {
				t.Fatalf("step %d: allowed = %v, want %v", i, ok, s.ok)
			}
			if b := &d.Buckets[0]; !s.ok && b.Debt > z.limit.BurstTime && b.Wait() != time.Duration(s.owed+1-100)*z.costTime {
				t.Fatalf("step %d: wait %v for a bucket owing %d tokens, want the time of %d tokens", i, b.Wait(), s.owed, s.owed+1-100)
			}
		} else {
			d.Buckets[0].Cost = z.limit.Spend(s.adjust+1) - z.costTime
			d.Counters[0].Cost = s.adjust
			err = h.store.Adjust(context.Background(), now, d)
		}
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		d = &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, k)}, Counters: []store.CounterDemand{counterReq(z, k, now)}}
		if err := h.store.Peek(context.Background(), now, d); err != nil {
			t.Fatalf("step %d: peek: %v", i, err)
		}
		if got, want := d.Buckets[0].Debt, time.Duration(s.owed)*z.costTime; got != want {
			t.Fatalf("step %d: the bucket owes %v, want %v (%d tokens)", i, got, want, s.owed)
		}
		if got := d.Counters[0].Used; got != s.used {
			t.Fatalf("step %d: the quota counted %d, want %d", i, got, s.used)
		}
	}
}

// The usage steps give the same answers on every store.
func TestStoresAgreeOnUsage(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		runUsageSteps(t, newTestHandler(t, `{"zones":`+strings.ReplaceAll(usageZones, `"name":"`, `"name":"agree-`)+`}`))
	})
	r := startRedis(t)
	for _, storeCfg := range []string{`,"disable_over_limit_cache":true`, ``} {
		t.Run("redis"+storeCfg, func(t *testing.T) {
			runUsageSteps(t, newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":%q%s}}`,
				usageZones, r.Addr(), t.Name()+":", storeCfg)))
		})
	}
	t.Run("cluster", func(t *testing.T) {
		nodes := startCluster(t)
		runUsageSteps(t, newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s"}}`,
			usageZones, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())))
	})
}

// The zones of the override steps: o 1r/s burst 2, and p, whose limit
// comes with each request (planZones' p, at plan free: 1r/s burst 2).
const overrideZones = `[{"name":"o","rate":"1r/s","burst":2},
	{"name":"p","rate":"{http.vars.rate}","burst":"{http.vars.burst}"}]`

// An overrideStep takes a token of a key in a zone, or sets (rate) or
// removes (remove) the key's own limit there.
type overrideStep struct {
	at         time.Duration
	zone, key  string
	rate       string // set the key's own limit: this rate and burst
	burst      int64
	remove     bool  // remove it; ok says whether there was one
	ok         bool  // a take: allowed
	rem, limit int64 // a take: tokens left, of a bucket of this burst
}

var overrideSteps = []overrideStep{
	{0, "o", "k", "", 0, false, true, 1, 2},
	{0, "o", "k", "", 0, false, true, 0, 2},
	{0, "o", "k", "", 0, false, false, 0, 2},
	// Emptied at burst 2, raised to 5: 3 tokens at once.
	{0, "o", "k", "1r/s", 5, false, false, 0, 0},
	{0, "o", "k", "", 0, false, true, 2, 5},
	{0, "o", "k", "", 0, false, true, 1, 5},
	{0, "o", "k", "", 0, false, true, 0, 5},
	{0, "o", "k", "", 0, false, false, 0, 5},
	// A faster rate keeps the tokens spent: all 5, now of 100ms each.
	{0, "o", "k", "10r/s", 5, false, false, 0, 0},
	{0, "o", "k", "", 0, false, false, 0, 5},
	{100 * time.Millisecond, "o", "k", "", 0, false, true, 0, 5},
	// Back to the zone's limit, owing a whole bucket: empty, refilling
	// at the zone's rate.
	{100 * time.Millisecond, "o", "k", "", 0, true, true, 0, 0},
	{100 * time.Millisecond, "o", "k", "", 0, false, false, 0, 2},
	{1100 * time.Millisecond, "o", "k", "", 0, false, true, 0, 2},
	{1100 * time.Millisecond, "o", "k", "", 0, true, false, 0, 0}, // none to remove
	// Lowered, a bucket keeps the tokens it holds, up to its burst.
	{2 * time.Second, "o", "j", "100r/s", 100, false, false, 0, 0},
	{2 * time.Second, "o", "j", "", 0, false, true, 99, 100},
	{2 * time.Second, "o", "j", "", 0, false, true, 98, 100},
	{2 * time.Second, "o", "j", "100r/s", 10, false, false, 0, 0},
	{2 * time.Second, "o", "j", "", 0, false, true, 9, 10},
	{2 * time.Second, "o", "j", "", 0, true, true, 0, 0},
	{2 * time.Second, "o", "j", "", 0, false, true, 1, 2},
	// A key without a bucket has its own limit from its first request.
	{3 * time.Second, "o", "n", "1r/m", 3, false, false, 0, 0},
	{3 * time.Second, "o", "n", "", 0, false, true, 2, 3},
	// Where the limit comes with each request, an override is one more
	// plan: the bucket keeps the fraction it owed (all of it here).
	{0, "p", "k", "", 0, false, true, 1, 2},
	{0, "p", "k", "", 0, false, true, 0, 2},
	{0, "p", "k", "1r/s", 10, false, false, 0, 0},
	{0, "p", "k", "", 0, false, false, 0, 10},
	{100 * time.Millisecond, "p", "k", "", 0, false, false, 0, 10},
	{time.Second, "p", "k", "", 0, false, true, 0, 10},
}

// runOverrideSteps replays overrideSteps against h's store, as
// runPlanSteps replays planSteps.
func runOverrideSteps(t *testing.T, h *Handler) {
	t.Helper()
	start := time.Now()
	var now time.Time
	if rs, ok := h.store.(*redisstore.Store); ok {
		rs.TestClock = func() time.Time { return now }
	}
	zones := map[string]*Zone{}
	for _, z := range h.Zones {
		zones[z.Name[len(z.Name)-1:]] = z
	}
	ctx := context.Background()
	for i, s := range overrideSteps {
		now = start.Add(s.at)
		z, k := zones[s.zone], store.Key{Text: s.key}
		switch {
		case s.rate != "":
			o, err := z.overrideOf(limitBody{Rate: s.rate, Burst: &s.burst}, now)
			if err == nil {
				err = h.store.SetOverride(ctx, now, z.index, k, o)
			}
			if err != nil {
				t.Fatalf("step %d: %v", i, err)
			}
			continue
		case s.remove:
			if found, err := h.store.DeleteOverride(ctx, now, z.index, k); err != nil || found != s.ok {
				t.Fatalf("step %d: removed %v, %v; want %v", i, found, err, s.ok)
			}
			continue
		}
		b := bucketReq(z, k)
		if z.plans != nil {
			p, err := z.parsePlan(planValues["free"])
			if err != nil {
				t.Fatal(err)
			}
			b.Limit, b.Cost = p.limit, p.costTime
		}
		d := &store.Demands{Buckets: []store.BucketDemand{b}}
		ok, err := h.store.Take(ctx, now, d)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if q := &d.Buckets[0]; ok != s.ok || q.Remaining() != s.rem || q.Limit.Burst != s.limit {
			t.Fatalf("step %d: allowed %v, %d tokens left of %d; want %v, %d of %d", i, ok, q.Remaining(), q.Limit.Burst, s.ok, s.rem, s.limit)
		}
	}
}

// A change of a key's own limit carries its bucket over alike on every
// store.
func TestStoresAgreeOnOverrides(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		runOverrideSteps(t, newTestHandler(t, `{"zones":`+strings.ReplaceAll(overrideZones, `"name":"`, `"name":"agree-`)+`}`))
	})
	r := startRedis(t)
	for _, storeCfg := range []string{`,"disable_over_limit_cache":true`, ``} {
		t.Run("redis"+storeCfg, func(t *testing.T) {
			runOverrideSteps(t, newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":%q%s}}`,
				overrideZones, r.Addr(), t.Name()+":", storeCfg)))
		})
	}
	t.Run("cluster", func(t *testing.T) {
		nodes := startCluster(t)
		runOverrideSteps(t, newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s","disable_over_limit_cache":true}}`,
			overrideZones, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())))
	})
}
