// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// How decisions spread over the masters of a Redis Cluster, and what one
// master's core decides. `make masters` runs both with the figures logged
// (see bench/results/masters.md).

// evalStats is what INFO commandstats says of the script calls: calls and
// the microseconds Redis spent in them.
func evalStats(t testing.TB, r *redisServer) (calls, usec int64) {
	t.Helper()
	for _, line := range strings.Split(r.CLI("INFO", "commandstats"), "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd)
			if !ok {
				continue
			}
			for _, kv := range strings.Split(rest, ",") {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseInt(v, 10, 64)
				switch k {
				case "calls":
					calls += n
				case "usec":
					usec += n
				}
			}
		}
	}
	return calls, usec
}

// Decisions on distinct keys spread evenly over a cluster's masters: each
// of 3 masters runs a third of 10k decisions' script calls, within 20%.
func TestRedisClusterSpread(t *testing.T) {
	nodes := startCluster(t)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, strconv.Quote(n.Addr()))
	}
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"spread","rate":"1000r/s"}],
		"store":{"backend":"redis","addresses":[%s],"timeout":"5s","fail_mode":"closed"}}`, strings.Join(addrs, ",")))
	rs, z := h.store.(*redisstore.Store), h.Zones[0]
	// The script loaded on every node: no EVAL.
	before := make([]int64, len(nodes))
	for i, n := range nodes {
		if err := redis.NewScript(lua.Decide).Load(context.Background(), newRedisClient(t, n.Addr())).Err(); err != nil {
			t.Fatal(err)
		}
		before[i], _ = evalStats(t, n)
	}
	const keys = 10_000
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < keys; i = next.Add(1) - 1 {
				k := fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
				if ok, err := rs.Take(context.Background(), time.Now(), &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, z.keyFor(k))}}); err != nil || !ok {
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
		c, _ := evalStats(t, n)
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
	if f := os.Getenv("RATE_LIMIT_SCRIPT"); f != "" {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		saved := redisScripts
		redisScripts = rediswire.NewScripts(string(src), lua.Peek)
		t.Cleanup(func() { redisScripts = saved })
		t.Logf("script %s", f)
	}
	core := os.Getenv("RATE_LIMIT_REDIS_CORE")
	if core == "" {
		core = "1"
	}
	requireRedis(t)
	r := &redisServer{T: t, Port: freePort(t, 0), Dir: t.TempDir()}
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
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"m","key":"{http.request.header.X-Key}","rate":"1000000r/s"},
		{"name":"f","key":"{http.request.header.X-Key}","rate":"10r/s","burst":20}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"2s","fail_mode":"closed"}}`, r.Addr()))
	rs := h.store.(*redisstore.Store)
	keys := make([]store.Key, 100_000)
	for i := range keys {
		keys[i] = h.Zones[0].keyFor(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255))
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
			z := h.Zones[0]
			if load == "flooded" {
				z = h.Zones[1]
			}
			c0, u0 := evalStats(t, r)
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
						if _, err := rs.Take(context.Background(), time.Now(), &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, k)}}); err != nil {
							errs.Add(1)
							firstErr.CompareAndSwap(nil, err.Error())
						}
						n.Add(1)
					}
				})
			}
			wg.Wait()
			secs := time.Since(start).Seconds()
			c1, u1 := evalStats(t, r)
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

// A master of a Redis Cluster killed under load, with two Caddy
// instances sharing a zone of 1r/m burst 5 and one with sync 100ms:
// every request is answered, none with a 5xx (fail_mode local decides
// what the cluster cannot), and within 5 s of the cluster serving every
// slot again (the master's replica took over) the instances share exact
// limits again: a fresh key sent 8 requests alternately to both is
// allowed 5, and 6 at most with sync (its bound, (2 − 1) × (r × T + 1)).
func TestRedisClusterFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	masters, replicas := redistest.StartReplicatedCluster(t)
	bin, _ := buildCaddy(t)
	var addrs []string
	for _, n := range append(slices.Clone(masters), replicas...) {
		addrs = append(addrs, n.Addr())
	}
	// A timeout of a second, so that a machine loaded by other work does
	// not make a healthy master's call fail_mode's.
	site := fmt.Sprintf(`	rate_limit {
		zone exact {
			key {http.request.header.X-Key}
			match not path /sync
			rate 1r/m
			burst 5
		}
		zone synced {
			key {http.request.header.X-Key}
			match path /sync
			rate 1r/m
			burst 5
			sync 100ms
		}
		store redis {
			address %s
			key_prefix failover:
			timeout 1s
			fail_mode local
		}
	}
	respond "ok"`, strings.Join(addrs, " "))
	instances := []*faultCaddy{startCaddyProcess(t, bin, site), startCaddyProcess(t, bin, site)}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	served := newTally()

	// allowed sends each of n fresh keys 8 requests to path, alternately
	// to both instances (the keys at once, a key's requests in turn), and
	// counts what each key was allowed.
	var fresh atomic.Int64
	allowed := func(path string, n int) []int {
		got := make([]int, n)
		var wg sync.WaitGroup
		for k := range got {
			key := fmt.Sprintf("fresh-%d", fresh.Add(1))
			wg.Go(func() {
				for i := range 8 {
					rep := send(client, instances[i%2].url+path, "X-Key", key)
					served.note(rep)
					if rep.status == http.StatusOK {
						got[k]++
					}
				}
			})
		}
		wg.Wait()
		return got
	}
	exact := func(got []int, most int) bool {
		for _, n := range got {
			if n < 5 || n > most {
				return false
			}
		}
		return true
	}
	if got := allowed("/", 10); !exact(got, 5) {
		t.Fatalf("before the failover, fresh keys were allowed %v of 8, want 5 each", got)
	}

	// The load: 8 clients on 40 keys, alternately to both instances and
	// both zones, from before the kill to the end.
	stop := make(chan struct{})
	wait := loop(8, 2*time.Millisecond, stop, func(c, i int) {
		path := []string{"/", "/sync"}[i/2%2]
		served.note(send(client, instances[i%2].url+path, "X-Key", fmt.Sprintf("load-%d", (5*c+i)%40)))
	})
	var stopped sync.Once
	stopLoad := func() { stopped.Do(func() { close(stop); wait() }) }
	defer stopLoad()
	time.Sleep(time.Second)

	victim, heir := masters[0], replicas[0]
	victim.Kill()
	killed := time.Now()
	waitFor(t, 20*time.Second, "the replica to take over", func() bool {
		if strings.Fields(heir.CLI("ROLE"))[0] != "master" {
			return false
		}
		for _, n := range append(slices.Clone(masters[1:]), replicas...) {
			if !n.ClusterOK() {
				return false
			}
		}
		return true
	})
	ok := time.Now()
	t.Logf("cluster_state:ok on every node %v after the kill", ok.Sub(killed).Round(time.Millisecond))

	// Until 5 s after, batches of fresh keys say when the limits are exact
	// again (logged); from then on every fresh key's must be.
	var since time.Duration = -1
	for time.Since(ok) < 5*time.Second {
		at := time.Since(ok)
		if got := allowed("/", 10); !exact(got, 5) {
			since = -1
			t.Logf("%v after cluster_state:ok, 10 fresh keys allowed %v of 8", at.Round(time.Millisecond), got)
		} else if since < 0 {
			since = at
		}
		time.Sleep(200 * time.Millisecond)
	}
	if since >= 0 {
		t.Logf("every batch of 10 fresh keys exact from %v after cluster_state:ok", since.Round(time.Millisecond))
	}
	if got := allowed("/", 20); !exact(got, 5) {
		t.Errorf("5 s after cluster_state:ok, fresh keys were allowed %v of 8, want 5 each", got)
	}
	if got := allowed("/sync", 20); !exact(got, 6) {
		t.Errorf("5 s after cluster_state:ok, fresh keys of the zone with sync were allowed %v of 8, want 5 or 6 each", got)
	}

	stopLoad()
	t.Logf("responses: %v, %d without one (%v)", served.codes, served.errs, served.firstErr)
	if served.errs > 0 {
		t.Errorf("%d requests got no response: %v", served.errs, served.firstErr)
	}
	for code, n := range served.codes {
		if code != http.StatusOK && code != http.StatusTooManyRequests {
			t.Errorf("%d requests answered %d", n, code)
		}
	}
}
