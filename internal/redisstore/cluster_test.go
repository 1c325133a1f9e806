// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// How decisions spread over the masters of a Redis Cluster, and what one
// master's core decides. `make masters` runs both with the figures logged
// (see bench/results/masters.md).

// Decisions on distinct keys spread evenly over a cluster's masters: each
// of 3 masters runs a third of 10k decisions' script calls, within 20%.
func TestClusterSpread(t *testing.T) {
	nodes := redistest.StartCluster(t)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.Addr())
	}
	l := gcra.NewLimit(1000, 1000)
	rs := redisstore.Open(t, redisstore.OpenClient(t, addrs...), []store.ZoneSpec{redisstore.Bucket("spread", l)}, redisstore.Options{FailMode: "closed"})
	// The script loaded on every node: no EVAL.
	before := make([]int64, len(nodes))
	for i, n := range nodes {
		if err := redis.NewScript(lua.Decide).Load(context.Background(), newRedisClient(t, n.Addr())).Err(); err != nil {
			t.Fatal(err)
		}
		before[i], _ = n.ScriptStats()
	}
	const keys = 10_000
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < keys; i = next.Add(1) - 1 {
				k := fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
				d := &store.Demands{Buckets: []store.BucketDemand{{Key: ipKey(k), Limit: l, Cost: l.TokenTime}}}
				if ok, err := rs.Take(context.Background(), time.Now(), d); err != nil || !ok {
					t.Errorf("key %s: %v, %v", k, ok, err)
					return
				}
			}
		})
	}
	wg.Wait()
	var total int64
	per := make([]int64, len(nodes))
	for i, n := range nodes {
		c, _ := n.ScriptStats()
		per[i] = c - before[i]
		total += per[i]
	}
	// A flight's decisions of one hash tag share a call; keys of distinct
	// tags, as nearly all of these are, a call each.
	if total > keys || total < keys*9/10 {
		t.Fatalf("%d script calls for %d decisions of distinct keys", total, keys)
	}
	mean := float64(total) / float64(len(nodes))
	for i, c := range per {
		dev := (float64(c) - mean) / mean
		t.Logf("master %d: %d script calls, %+.1f%% from an even share", i+1, c, 100*dev)
		if dev < -0.2 || dev > 0.2 {
			t.Errorf("master %d ran %d of %d calls: more than 20%% from an even share", i+1, c, total)
		}
	}
}

// The decisions/s of one master on one core, loaded from the other core
// by the store: `make masters` (RATE_LIMIT_MASTERS=1, this process pinned
// to core 0 and Redis to core 1). Three loads, alternating, each run
// several times; medians are logged:
//
//   - distinct: 256 callers, each decision for another of 100k keys that
//     never run out (every decision is a script call);
//   - hot: the same callers, all on one key that never runs out: one slot,
//     so one master, whatever the cluster's size;
//   - flooded: all on one key limited to 10r/s burst 20: the over-limit
//     cache denies locally, and Redis sees about the allowed requests.
//
// RATE_LIMIT_SCRIPT=<file> runs another version of the script instead,
// for comparison (the keys are this version's).
func TestMastersThroughput(t *testing.T) {
	if os.Getenv("RATE_LIMIT_MASTERS") == "" {
		t.Skip("set RATE_LIMIT_MASTERS=1, or run make masters")
	}
	var decide string // the module's
	if f := os.Getenv("RATE_LIMIT_SCRIPT"); f != "" {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		decide = string(src)
		t.Logf("script %s", f)
	}
	core := os.Getenv("RATE_LIMIT_REDIS_CORE")
	if core == "" {
		core = "1"
	}
	redistest.Require(t)
	r := &redistest.Server{T: t, Port: redistest.FreePort(t, 0), Dir: t.TempDir()}
	r.Cmd = exec.Command("taskset", "-c", core, redistest.ServerBin(), "--bind", "127.0.0.1", "--port", strconv.Itoa(r.Port),
		"--save", "", "--appendonly", "no", "--dir", r.Dir)
	if err := r.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Kill)
	r.WaitReady()
	cpu := func() time.Duration { // Redis's CPU time: utime + stime, in ticks of 10 ms
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", r.Cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(b)[strings.LastIndexByte(string(b), ')')+2:])
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		return time.Duration(u+s) * 10 * time.Millisecond
	}
	limits := []gcra.Limit{gcra.NewLimit(1e6, 1e6), gcra.NewLimit(10, 20)}
	rs := redisstore.Open(t, redisstore.OpenClientWith(t, redisstore.ClientOptions{Decide: decide, Timeout: 2 * time.Second}, r.Addr()),
		[]store.ZoneSpec{redisstore.Bucket("m", limits[0]), redisstore.Bucket("f", limits[1])},
		redisstore.Options{KeyPrefix: "rl:", CallTimeout: 2 * time.Second, FailMode: "closed"})
	keys := make([]store.Key, 100_000)
	for i := range keys {
		keys[i] = ipKey(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255))
	}
	const callers = 256
	runs, _ := strconv.Atoi(os.Getenv("RATE_LIMIT_MASTERS_RUNS"))
	if runs < 1 {
		runs = 5
	}
	dur := 3 * time.Second
	type figures struct{ decisions, calls, usecPerCall, busy []float64 }
	loads := []string{"distinct", "hot", "flooded"}
	got := map[string]*figures{}
	for _, l := range loads {
		got[l] = new(figures)
	}
	for run := range runs {
		for _, load := range loads {
			zone := 0
			if load == "flooded" {
				zone = 1
			}
			c0, u0 := r.ScriptStats()
			cpu0 := cpu()
			var n, errs atomic.Int64
			var firstErr atomic.Value
			var next atomic.Int64
			start := time.Now()
			stop := start.Add(dur)
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					for time.Now().Before(stop) {
						k := keys[0]
						if load == "distinct" {
							k = keys[next.Add(1)%int64(len(keys))]
						}
						d := &store.Demands{Buckets: []store.BucketDemand{{Zone: zone, Key: k, Limit: limits[zone], Cost: limits[zone].TokenTime}}}
						if _, err := rs.Take(context.Background(), time.Now(), d); err != nil {
							errs.Add(1)
							firstErr.CompareAndSwap(nil, err.Error())
						}
						n.Add(1)
					}
				})
			}
			wg.Wait()
			secs := time.Since(start).Seconds()
			c1, u1 := r.ScriptStats()
			busy := (cpu() - cpu0).Seconds() / secs
			// A machine that other work loads may make a few decisions
			// miss their timeout: logged, not failed.
			if e := errs.Load(); e > 0 {
				t.Logf("run %d, %s: %d of %d decisions failed: %v", run+1, load, e, n.Load(), firstErr.Load())
			}
			if c1 == c0 {
				t.Fatalf("run %d, %s: no script calls", run+1, load)
			}
			if load == "flooded" && float64(c1-c0) > 0.01*float64(n.Load()) {
				t.Errorf("run %d, flooded: %d script calls for %d decisions: the over-limit cache let the flood through", run+1, c1-c0, n.Load())
			}
			f := got[load]
			f.decisions = append(f.decisions, float64(n.Load())/secs)
			f.calls = append(f.calls, float64(c1-c0)/secs)
			f.usecPerCall = append(f.usecPerCall, float64(u1-u0)/float64(c1-c0))
			f.busy = append(f.busy, busy)
			t.Logf("run %d %-8s %8.0f decisions/s, %7.0f script calls/s, %.2f µs per call in Redis, Redis core %3.0f%% busy",
				run+1, load, float64(n.Load())/secs, float64(c1-c0)/secs, float64(u1-u0)/float64(c1-c0), 100*busy)
		}
	}
	med := func(v []float64) float64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	t.Logf("medians of %d runs of %v, %d callers:", runs, dur, callers)
	t.Logf("| load | decisions/s | script calls/s | µs per call in Redis | Redis core busy | decisions per Redis CPU-second |")
	t.Logf("| --- | ---: | ---: | ---: | ---: | ---: |")
	for _, l := range loads {
		f := got[l]
		per := make([]float64, len(f.decisions))
		for i := range per {
			per[i] = f.decisions[i] / f.busy[i]
		}
		t.Logf("| %s | %.0f | %.0f | %.2f | %.0f%% | %.0f |", l, med(f.decisions), med(f.calls), med(f.usecPerCall), 100*med(f.busy), med(per))
	}
}

// apartKeys are n keys whose buckets lie in n different slots of the
// cluster of nodes, in s's zone.
func apartKeys(t *testing.T, s *redisstore.Store, node *redistest.Server, n int) []string {
	t.Helper()
	var keys []string
	slots := map[string]bool{}
	for i := 0; len(keys) < n; i++ {
		k := "key-" + strconv.Itoa(i)
		hash, _ := s.BucketName(0, store.Key{Text: k})
		if slot := node.CLI("CLUSTER", "KEYSLOT", hash); !slots[slot] {
			slots[slot] = true
			keys = append(keys, k)
		}
		if i > 1000 {
			t.Fatalf("no %d keys in distinct slots", n)
		}
	}
	return keys
}

// On a cluster, a request whose keys lie in different slots is taken a
// slot at a time, all or nothing all the same: when a bucket, a counter
// or a slot refuses, what the others took is given back (buckets' and
// counters' tokens, slots), what was not asked refuses nothing, and a
// soft demand that lacked is given nothing back. Adjustments and
// releases go a slot at a time too.
func TestClusterTakesApart(t *testing.T) {
	nodes := redistest.StartCluster(t)
	five, one := redisstore.PerMinute(5), redisstore.PerMinute(1)
	rateless := gcra.NewLimit(1, 1)
	zones := []store.ZoneSpec{
		redisstore.Bucket("ip", five), redisstore.Bucket("api", five), redisstore.Bucket("user", one),
		{Name: "q", Shape: rateless, Quota: "day@UTC"},
		{Name: "k", Shape: rateless, Slots: true}, {Name: "k2", Shape: rateless, Slots: true},
	}
	s := redisstore.Open(t, redisstore.OpenClient(t, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()), zones,
		redisstore.Options{DisableOverLimitCache: true})
	keys := apartKeys(t, s, nodes[0], 3)
	a, b, c := store.Key{Text: keys[0]}, store.Key{Text: keys[1]}, store.Key{Text: keys[2]}
	ctx := context.Background()
	days := &calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}
	bucket := func(zone int, k store.Key, l gcra.Limit) store.BucketDemand {
		return store.BucketDemand{Zone: zone, Key: k, Limit: l, Cost: l.TokenTime}
	}
	counter := store.CounterDemand{Zone: 3, Key: b, Limit: 1, Cost: 1, Window: days.Window(time.Now())}
	slot := func(zone int, k store.Key) store.SlotDemand {
		return store.SlotDemand{Zone: zone, Key: k, Limit: 1, Lease: time.Minute}
	}
	left := func(zone int, k store.Key, l gcra.Limit) int64 {
		t.Helper()
		d := &store.Demands{Buckets: []store.BucketDemand{bucket(zone, k, l)}}
		if err := s.Peek(ctx, time.Now(), d); err != nil {
			t.Fatal(err)
		}
		return d.Buckets[0].Remaining()
	}
	take := func(want bool, d *store.Demands) {
		t.Helper()
		if ok, err := s.Take(ctx, time.Now(), d); ok != want || err != nil {
			t.Fatalf("%v, %v; want %v", ok, err, want)
		}
	}

	// Buckets: the last refuses, the first two get their tokens back.
	three := func() *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{bucket(0, a, five), bucket(1, b, five), bucket(2, c, one)}}
	}
	take(true, three())
	take(false, three())
	if ip, api := left(0, a, five), left(1, b, five); ip != 4 || api != 4 {
		t.Fatalf("after a refusal in the third slot: %d and %d tokens left, want 4 and 4", ip, api)
	}
	// The first refuses: the others are not asked, and refuse nothing.
	d := &store.Demands{Buckets: []store.BucketDemand{bucket(2, c, one), bucket(0, a, five)}}
	take(false, d)
	if q := d.Buckets[1]; !q.OK || q.Debt != 0 || left(0, a, five) != 4 {
		t.Fatalf("a bucket after a refusal: ok %v, debt %v, %d left; want not asked", q.OK, q.Debt, left(0, a, five))
	}
	// A counter refuses: the bucket gets its token back.
	withCounter := func() *store.Demands {
		return &store.Demands{Buckets: []store.BucketDemand{bucket(0, a, five)}, Counters: []store.CounterDemand{counter}}
	}
	take(true, withCounter())
	take(false, withCounter())
	if n := left(0, a, five); n != 3 {
		t.Fatalf("after a counter's refusal: %d tokens left, want 3", n)
	}
	// A slot refuses: the bucket gets its token back, and the slot taken
	// before it is free again.
	full := &store.Demands{Slots: []store.SlotDemand{slot(5, c)}}
	take(true, full)
	slots := &store.Demands{Buckets: []store.BucketDemand{bucket(1, b, five)}, Slots: []store.SlotDemand{slot(4, b), slot(5, c)}}
	take(false, slots)
	if n := left(1, b, five); n != 4 {
		t.Fatalf("after a slot's refusal: %d tokens left in the bucket, want 4", n)
	}
	if q := slots.Slots[0]; q.Held {
		t.Fatal("the slot taken before a refusal is still held")
	}
	again := &store.Demands{Slots: []store.SlotDemand{slot(4, b)}}
	take(true, again)
	// Releases of slots in two slots of the cluster, one call each.
	if err := s.Release(ctx, append(again.Slots, full.Slots...)); err != nil {
		t.Fatal(err)
	}
	take(true, &store.Demands{Slots: []store.SlotDemand{slot(4, b), slot(5, c)}})
	// An adjustment of buckets in two slots: a token back to each.
	back := &store.Demands{Buckets: []store.BucketDemand{bucket(0, a, five), bucket(1, b, five)}}
	for i := range back.Buckets {
		back.Buckets[i].Cost = -back.Buckets[i].Cost
	}
	if err := s.Adjust(ctx, time.Now(), back); err != nil {
		t.Fatal(err)
	}
	if ip, api := left(0, a, five), left(1, b, five); ip != 4 || api != 5 {
		t.Fatalf("after a refund in two slots: %d and %d tokens left, want 4 and 5", ip, api)
	}
}
