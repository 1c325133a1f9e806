// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The load runs of docs/share.md: `make share` (RATE_LIMIT_SHARE=1)
// writes bench/results/share.md. Each instance is a handler of its own,
// with its own store and connections, on one Redis for the zones with
// share and another for the exact zones beside them.
//
//   - One fresh key at rate 20r/s burst 40, share 1s, on N of 1, 3 and 5
//     instances for 5 s: flooded (8 clients, a request a millisecond
//     each) and trickled (a request every 40ms in all, about the rate),
//     round robin, beside an exact zone flooded alike. The excess is the
//     largest, over every pair of admissions, of what was admitted
//     between them less the exact bucket's bound, burst + rate x span: 0
//     or less when the bound holds. A decision's instant is known to
//     within its call (this process's clock before and after): the
//     table gives the excess at the calls' midpoints, and the excess no
//     reading of the instants within their calls avoids.
//   - The goal's floods: 20 runs on three instances evenly, and 20 with
//     one instance taking 80%.
//   - Ten busy keys at rate 100000r/s burst 100000 on three instances,
//     16 clients, 5 s: script calls a request.
//   - Cost, in 5 rounds rotated among the local store, share and the
//     exact path: ten busy keys, keys drawn by a Zipf law (s = 1.1) over
//     100,000 at rate 1000000r/s, and one hot key at that rate: the
//     requests 16 clients sent in 2 s (closed loop), this process's CPU
//     and Redis's a request, medians.
func TestShareLoad(t *testing.T) {
	if os.Getenv("RATE_LIMIT_SHARE") == "" {
		t.Skip("set RATE_LIMIT_SHARE=1, or run make share")
	}
	shareRedis, exactRedis := startRedis(t), startRedis(t)
	var out strings.Builder
	fmt.Fprintf(&out, "# share: load runs\n\n`make share` on %s, %d CPUs (%s).\n\n", runtime.GOOS+"/"+runtime.GOARCH, runtime.NumCPU(), time.Now().UTC().Format("2006-01-02"))
	out.WriteString("## One fresh key for 5 s, rate 20r/s burst 40, share 1s\n\n")
	out.WriteString("| instances | load | allowed | exact zone | of exact | excess at midpoints | excess certain | script calls (share) | script calls (exact) |\n|---|---|---|---|---|---|---|---|---|\n")
	run := 0
	instances := func(n int, zone, addr string) []*Handler {
		var hs []*Handler
		for i := range n {
			h, unload := provision(t, fmt.Sprintf(`{"zones":[%s],"store":{"backend":"redis","addresses":[%q],"timeout":"5s","pool_size":%d}}`, zone, addr, 10+i))
			t.Cleanup(unload)
			hs = append(hs, h)
		}
		return hs
	}
	fresh := func(rate, burst string, share bool) string {
		run++
		s := ""
		if share {
			s = `,"share":"1s"`
		}
		return fmt.Sprintf(`{"name":"z%d","key":"{http.request.header.X-Key}","rate":%q,"burst":%s%s}`, run, rate, burst, s)
	}
	type result struct {
		allowed, exact    int
		excess, certain   float64
		calls, exactCalls int
	}
	oneKey := func(n int, flood bool, skew bool) result {
		hs := instances(n, fresh("20r/s", "40", true), shareRedis.Addr())
		exact := instances(1, fresh("20r/s", "40", false), exactRedis.Addr())[0]
		calls, exactCalls := shareRedis.Calls(), exactRedis.Calls()
		var mu sync.Mutex
		var at, sentAt, doneAt []time.Duration
		var exactAllowed atomic.Int64
		var next atomic.Int64
		start := time.Now()
		clients, pause := 8, time.Millisecond
		if !flood {
			clients, pause = 1, 40*time.Millisecond
		}
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				for time.Since(start) < 5*time.Second {
					i := int(next.Add(1))
					h := hs[i%n]
					if skew && i%10 < 8 {
						h = hs[0]
					}
					sent := time.Now()
					if code, _ := serve(h, "10.0.0.1", "X-Key", "k"); code == http.StatusOK {
						done := time.Now()
						mu.Lock()
						at = append(at, sent.Sub(start)+done.Sub(sent)/2)
						sentAt, doneAt = append(sentAt, sent.Sub(start)), append(doneAt, done.Sub(start))
						mu.Unlock()
					}
					if code, _ := serve(exact, "10.0.0.1", "X-Key", "k"); code == http.StatusOK {
						exactAllowed.Add(1)
					}
					time.Sleep(pause)
				}
			})
		}
		wg.Wait()
		return result{len(at), int(exactAllowed.Load()), overBound(at, at, 40, 50*time.Millisecond), overBound(sentAt, doneAt, 40, 50*time.Millisecond),
			shareRedis.Calls() - calls, exactRedis.Calls() - exactCalls}
	}
	for _, n := range []int{1, 3, 5} {
		for _, flood := range []bool{true, false} {
			r := oneKey(n, flood, false)
			load := map[bool]string{true: "flood", false: "trickle"}[flood]
			fmt.Fprintf(&out, "| %d | %s | %d | %d | %.0f%% | %.2f | %.2f | %d | %d |\n", n, load, r.allowed, r.exact,
				100*float64(r.allowed)/float64(r.exact), r.excess, r.certain, r.calls, r.exactCalls)
			t.Logf("%d instances, %s: %+v", n, load, r)
		}
	}

	out.WriteString("\n## 20 floods of a fresh key on three instances, each way\n\n")
	out.WriteString("| load | runs | of exact: median | of exact: least | excess at midpoints: worst | excess certain: worst |\n|---|---|---|---|---|---|\n")
	for _, skew := range []bool{false, true} {
		var of []float64
		worst, certain := -1e9, -1e9
		for range 20 {
			r := oneKey(3, true, skew)
			of = append(of, float64(r.allowed)/float64(r.exact))
			worst, certain = max(worst, r.excess), max(certain, r.certain)
		}
		slices.Sort(of)
		load := map[bool]string{false: "even", true: "one instance 80%"}[skew]
		fmt.Fprintf(&out, "| %s | 20 | %.0f%% | %.0f%% | %.2f | %.2f |\n", load, 100*of[len(of)/2], 100*of[0], worst, certain)
		t.Logf("%s: of exact %v, worst excess %.2f", load, of, worst)
	}

	out.WriteString("\n## Ten busy keys on three instances, rate 100000r/s burst 100000, 16 clients, 5 s\n\n")
	hs := instances(3, fresh("100000r/s", "100000", true), shareRedis.Addr())
	calls := shareRedis.Calls()
	requests := hammer(hs, 16, 5*time.Second, tenKeys)
	calls = shareRedis.Calls() - calls
	fmt.Fprintf(&out, "%d requests, %d script calls: %.5f calls a request.\n", requests, calls, float64(calls)/float64(requests))

	out.WriteString("\n## Cost a request, medians of 5 rounds rotated: local store, share, exact\n\n")
	out.WriteString("| keys | store | requests in 2 s | this process's CPU a request | Redis CPU a request | script calls a request |\n|---|---|---|---|---|---|\n")
	for _, keys := range []struct {
		name, rate string
		key        func(*rand.Rand) func() string
	}{
		{"ten busy", "100000r/s", tenKeys},
		{"Zipf 1.1 over 100,000", "1000000r/s", zipfKeys},
		{"one hot", "1000000r/s", func(*rand.Rand) func() string { return func() string { return "hot" } }},
	} {
		type setup struct {
			name string
			hs   []*Handler
		}
		local := []*Handler{}
		for range 3 {
			h, unload := provision(t, fmt.Sprintf(`{"zones":[%s]}`, fresh(keys.rate, strings.TrimSuffix(keys.rate, "r/s"), false)))
			t.Cleanup(unload)
			local = append(local, h)
		}
		setups := []setup{
			{"local", local},
			{"share", instances(3, fresh(keys.rate, strings.TrimSuffix(keys.rate, "r/s"), true), shareRedis.Addr())},
			{"exact", instances(3, fresh(keys.rate, strings.TrimSuffix(keys.rate, "r/s"), false), shareRedis.Addr())},
		}
		type cost struct{ n, cpu, redis, calls []float64 }
		costs := make([]cost, len(setups))
		for round := range 5 {
			for k := range setups {
				i := (k + round) % len(setups)
				c0, r0, n0 := processCPU(), redisCPU(shareRedis), shareRedis.Calls()
				n := hammer(setups[i].hs, 16, 2*time.Second, keys.key)
				cpu, rcpu, ncalls := processCPU()-c0, redisCPU(shareRedis)-r0, shareRedis.Calls()-n0
				costs[i].cpu = append(costs[i].cpu, float64(cpu.Microseconds())/float64(n))
				costs[i].redis = append(costs[i].redis, float64(rcpu.Microseconds())/float64(n))
				costs[i].calls = append(costs[i].calls, float64(ncalls)/float64(n))
				costs[i].n = append(costs[i].n, float64(n))
			}
		}
		for i, s := range setups {
			fmt.Fprintf(&out, "| %s | %s | %.0f | %.1f µs | %.2f µs | %.4f |\n", keys.name, s.name, median(costs[i].n),
				median(costs[i].cpu), median(costs[i].redis), median(costs[i].calls))
		}
	}
	if err := os.WriteFile("bench/results/share.md", []byte(out.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
}

// overBound is the largest excess, over every pair of admissions, of
// what was admitted between them over burst + the refill of a token every
// tt: 0 or less when the bound holds. An admission's instant is known to
// lie in [from[i], to[i]] (the same instants for both when known
// exactly): a pair's span is taken at its longest, from the first's from
// to the second's to, in the order of from.
func overBound(from, to []time.Duration, burst int, tt time.Duration) float64 {
	idx := make([]int, len(from))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return int(from[a] - from[b]) })
	worst, low := -float64(burst), 0.0
	for j, k := range idx {
		if v := float64(j) - float64(from[k])/float64(tt); j == 0 || v < low {
			low = v
		}
		worst = max(worst, float64(j)-float64(to[k])/float64(tt)-low+1-float64(burst))
	}
	return worst
}

// hammer sends requests from clients to hs round robin, with keys that
// each client's key draws, for d; it returns how many it sent.
func hammer(hs []*Handler, clients int, d time.Duration, key func(*rand.Rand) func() string) int {
	var n atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := range clients {
		wg.Go(func() {
			next := key(rand.New(rand.NewPCG(uint64(c), uint64(start.UnixNano()))))
			for i := 0; time.Since(start) < d; i++ {
				serve(hs[(c+i)%len(hs)], "10.0.0.1", "X-Key", next())
				n.Add(1)
			}
		})
	}
	wg.Wait()
	return int(n.Load())
}

// tenKeys draws one of ten keys; zipfKeys, one of 100,000 by a Zipf law
// of s = 1.1.
func tenKeys(rng *rand.Rand) func() string {
	return func() string { return strconv.Itoa(rng.IntN(10)) }
}

func zipfKeys(rng *rand.Rand) func() string {
	z := rand.NewZipf(rng, 1.1, 1, 99_999)
	return func() string { return strconv.FormatUint(z.Uint64(), 10) }
}

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
