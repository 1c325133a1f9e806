// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// wrkResult is what one wrk run reports.
type wrkResult struct {
	RPS      float64
	P50, P99 time.Duration
	Requests int64
	Non2xx   int64
}

// runWrk runs `wrk -t1 -c50 -d<dur> --latency` against url, with a Lua
// script and its arguments if given.
func (e *env) runWrk(name, url string, dur time.Duration, script string, args ...string) (wrkResult, error) {
	return e.runWrkUntil(name, url, dur, "", script, args...)
}

// runWrkUntil is runWrk that also ends wrk early, as if by Ctrl-C (wrk
// then reports what it did so far), once the file doneFile exists.
func (e *env) runWrkUntil(name, url string, dur time.Duration, doneFile, script string, args ...string) (wrkResult, error) {
	cmd := []string{"-t1", "-c50", "-d" + strconv.Itoa(int(dur.Seconds())) + "s", "--latency"}
	if script != "" {
		cmd = append(cmd, "-s", script)
	}
	cmd = append(cmd, url)
	if len(args) > 0 {
		cmd = append(append(cmd, "--"), args...)
	}
	out := filepath.Join(e.tmp, "wrk-"+name+".txt")
	p, err := start("wrk "+name, out, nil, "wrk", cmd...)
	if err != nil {
		return wrkResult{}, err
	}
	limit := time.After(dur + 60*time.Second)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
wait:
	for {
		select {
		case <-p.done:
			break wait
		case <-limit:
			p.stop(time.Second)
			return wrkResult{}, fmt.Errorf("wrk %s did not finish", name)
		case <-tick.C:
			if doneFile == "" {
				continue
			}
			if _, err := os.Stat(doneFile); err == nil {
				_ = p.cmd.Process.Signal(syscall.SIGINT)
				doneFile = ""
			}
		}
	}
	if p.err != nil {
		return wrkResult{}, fmt.Errorf("wrk %s: %v\n%s", name, p.err, tail(out, 20))
	}
	return parseWrk(out)
}

func parseWrk(file string) (wrkResult, error) {
	var r wrkResult
	f, err := os.Open(file)
	if err != nil {
		return r, err
	}
	defer f.Close()
	inDist := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		fs := strings.Fields(line)
		switch {
		case strings.HasPrefix(line, "Latency Distribution"):
			inDist = true
		case inDist && len(fs) == 2 && strings.HasSuffix(fs[0], "%"):
			d, err := parseWrkDuration(fs[1])
			if err != nil {
				return r, err
			}
			switch fs[0] {
			case "50%":
				r.P50 = d
			case "99%":
				r.P99 = d
			}
		case strings.HasPrefix(line, "Requests/sec:") && len(fs) == 2:
			r.RPS, _ = strconv.ParseFloat(fs[1], 64)
		case len(fs) > 2 && fs[1] == "requests" && fs[2] == "in":
			inDist = false
			r.Requests, _ = strconv.ParseInt(fs[0], 10, 64)
		case strings.HasPrefix(line, "Non-2xx or 3xx responses:") && len(fs) == 5:
			r.Non2xx, _ = strconv.ParseInt(fs[4], 10, 64)
		}
	}
	if r.RPS == 0 || r.P50 == 0 {
		return r, fmt.Errorf("unexpected wrk output in %s:\n%s", file, tail(file, 20))
	}
	return r, sc.Err()
}

// parseWrkDuration reads wrk's "812.00us", "1.23ms", "2.00s", "1.00m".
func parseWrkDuration(s string) (time.Duration, error) {
	units := []struct {
		suffix string
		unit   time.Duration
	}{{"us", time.Microsecond}, {"ms", time.Millisecond}, {"s", time.Second}, {"m", time.Minute}}
	for _, u := range units {
		if v, ok := strings.CutSuffix(s, u.suffix); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, fmt.Errorf("wrk duration %q", s)
			}
			return time.Duration(f * float64(u.unit)), nil
		}
	}
	return 0, fmt.Errorf("wrk duration %q", s)
}

// The throughput comparison: Caddy `respond` with and without a rate
// limiter in front, on a path where the limit is never reached and on one
// where every request is over it.

type tpConfig struct {
	Key, Impl, Path string // Path: "allowed", "denied", "waits" (bench_wait, the floors of waiting), "floor" (the headers') or "" for the baseline
	// Keys: how many keys the requests carry in X-Key, at random: many
	// clients, as users run it; 1 for one client.
	Keys int
	spec caddySpec
	// redis: its requests make script calls, counted per request; they,
	// or pings, ask Redis, whose CPU is counted per request.
	redis, pings bool
	inst         *caddyInst
}

// tpKeys is how many clients the many-keys configurations stand for.
const tpKeys = 10_000

// randomKeysLua makes wrk send each request with one of args[1] keys in
// X-Key, at random.
const randomKeysLua = `local n = 1
local reqs = {}
function init(args)
	n = tonumber(args[1])
	math.randomseed(os.time())
	for i = 1, n do
		reqs[i] = wrk.format(nil, nil, { ["X-Key"] = "key-" .. i })
	end
end
function request()
	return reqs[math.random(n)]
end
`

// tpRun is one wrk run of one configuration.
type tpRun struct {
	wrkResult
	CPUPerReq      time.Duration // Caddy's CPU per request
	RedisCPUPerReq time.Duration // Redis's, for the rows that ask it
	RedisPerReq    num
	// ScriptPerReq is the time Redis spent in script calls, per request,
	// for the rows that make them.
	ScriptPerReq time.Duration
}

// tpResult is the medians of a configuration's runs.
type tpResult struct {
	Key, Impl, Path              string
	Keys                         int
	Runs                         []tpRun
	RPS                          float64
	P50, P99                     time.Duration
	CPUPerReq, RedisCPUPerReq    time.Duration
	RedisPerReq                  num
	ScriptPerReq                 time.Duration
	Non2xx                       float64 // share of non-2xx answers over all runs
	RatioRPS, RatioP50, RatioP99 float64
	RatioCPU                     float64 // CPU per request, to the baseline's
}

func (e *env) tpConfigs() []*tpConfig {
	// zone is our zone with more of its subdirectives (lines), and more
	// of the directive (extra) after it.
	zone := func(rate string, burst int, lines, extra string) string {
		return fmt.Sprintf("rate_limit {\n\tzone %%s {\n\t\tkey {http.request.header.X-Key}\n\t\trate %s\n\t\tburst %d%s\n\t}%s\n}\nrespond \"ok\"", rate, burst, lines, extra)
	}
	ours := func(rate string, burst int, extra string) string { return zone(rate, burst, "", extra) }
	peer := func(events int, window string) string {
		return fmt.Sprintf("rate_limit {\n\tzone %%s {\n\t\tkey {http.request.header.X-Key}\n\t\tevents %d\n\t\twindow %s\n\t}\n}\nrespond \"ok\"", events, window)
	}
	redisStore := "\n\tstore redis {\n\t\taddress " + e.redis.addr + "\n\t}"
	cfgs := []*tpConfig{
		// The baseline, from both binaries: they share every dependency
		// but the limiter, so any difference between them is noise.
		{Key: "baseline", Impl: "no limiter: Caddy `respond`", Keys: tpKeys, spec: caddySpec{bin: e.caddyBin, site: `respond "ok"`}},
		{Key: "baseline-peer", Impl: "no limiter, caddy-peer binary", Keys: tpKeys, spec: caddySpec{bin: e.peerBin, site: `respond "ok"`}},
		{Key: "local-allowed", Impl: "rate_limit local", Path: "allowed", Keys: tpKeys, spec: caddySpec{bin: e.caddyBin, site: ours("1000000r/s", 1000000, "")}},
		{Key: "local-headers-off", Impl: "rate_limit local, `headers off`", Path: "allowed", Keys: tpKeys, spec: caddySpec{bin: e.caddyBin, site: ours("1000000r/s", 1000000, "\n\theaders off")}},
		// The floor of the headers: no limiter, and Caddy's own `header`
		// handler adds five fields as long as ours, so the row's cost is
		// what five more fields cost Caddy and net/http to set, copy and
		// write.
		{Key: "static-headers", Impl: "no limiter, Caddy's `header` adds five fields like ours", Path: "floor", Keys: tpKeys, spec: caddySpec{bin: e.caddyBin, site: staticHeaders}},
		{Key: "redis-allowed", Impl: "rate_limit redis", Path: "allowed", Keys: tpKeys, redis: true, spec: caddySpec{bin: e.caddyBin, site: ours("1000000r/s", 1000000, redisStore)}},
		// The same zone with `sync 100ms`: decided from the instance's
		// copies, reconciled with Redis every 100 ms.
		{Key: "redis-sync", Impl: "rate_limit redis, `sync 100ms`", Path: "allowed", Keys: tpKeys, redis: true, spec: caddySpec{bin: e.caddyBin, site: zone("1000000r/s", 1000000, "\n\t\tsync 100ms", redisStore)}},
		// The same zone with `share 1s`: a busy key decided from shares of
		// its tokens that Redis grants in advance, a key used rarely by
		// Redis; and ten busy keys on the local store, with share and
		// exact (docs/share.md).
		{Key: "redis-share", Impl: "rate_limit redis, `share 1s`", Path: "allowed", Keys: tpKeys, redis: true, spec: caddySpec{bin: e.caddyBin, site: zone("1000000r/s", 1000000, "\n\t\tshare 1s", redisStore)}},
		{Key: "local-ten-keys", Impl: "rate_limit local, ten keys", Path: "allowed", Keys: 10, spec: caddySpec{bin: e.caddyBin, site: ours("100000r/s", 100000, "")}},
		{Key: "redis-share-ten-keys", Impl: "rate_limit redis, `share 1s`, ten keys", Path: "allowed", Keys: 10, redis: true, spec: caddySpec{bin: e.caddyBin, site: zone("100000r/s", 100000, "\n\t\tshare 1s", redisStore)}},
		{Key: "redis-ten-keys", Impl: "rate_limit redis, ten keys", Path: "allowed", Keys: 10, redis: true, spec: caddySpec{bin: e.caddyBin, site: ours("100000r/s", 100000, redisStore)}},
		// Not events 1000000 per 1s: caddy-ratelimit allocates a ring of
		// `events` timestamps per key, and 24 MB of live heap would make
		// the GC run less often, so that the limiter seemed to cost less
		// than nothing. 200 per 100ms is never reached by one of 10,000
		// keys at these rates.
		{Key: "peer-allowed", Impl: "caddy-ratelimit v0.1.0", Path: "allowed", Keys: tpKeys, spec: caddySpec{bin: e.peerBin, site: peer(200, "100ms")}},
		// The floor of any limiter that waits for a server: each request
		// waits for another goroutine, which answers those queued together
		// (bench/peer/wait.go), with no network and no decision.
		{Key: "wait", Impl: "no limiter, each request waits for a goroutine (`bench_wait`)", Path: "waits", Keys: tpKeys, spec: caddySpec{bin: e.peerBin, site: "bench_wait\nrespond \"ok\""}},
		// The floor of any limiter that asks Redis through go-redis: each
		// request waits for a PING, batched as the Redis store batches.
		{Key: "wait-redis", Impl: "no limiter, each request waits for a PING of Redis (`bench_wait redis`)", Path: "waits", Keys: tpKeys, pings: true,
			spec: caddySpec{bin: e.peerBin, site: "bench_wait redis " + e.redis.addr + "\nrespond \"ok\""}},
		{Key: "redis-one-key", Impl: "rate_limit redis, one key", Path: "allowed", Keys: 1, redis: true, spec: caddySpec{bin: e.caddyBin, site: ours("1000000r/s", 1000000, redisStore)}},
		{Key: "local-denied", Impl: "rate_limit local", Path: "denied", Keys: 1, spec: caddySpec{bin: e.caddyBin, site: ours("1r/m", 1, "")}},
		{Key: "redis-denied", Impl: "rate_limit redis", Path: "denied", Keys: 1, redis: true, spec: caddySpec{bin: e.caddyBin, site: ours("1r/m", 1, redisStore)}},
		{Key: "peer-denied", Impl: "caddy-ratelimit v0.1.0", Path: "denied", Keys: 1, spec: caddySpec{bin: e.peerBin, site: peer(1, "1m")}},
	}
	if e.rows != nil {
		cfgs = slices.DeleteFunc(cfgs, func(c *tpConfig) bool {
			return !strings.HasPrefix(c.Key, "baseline") && !slices.Contains(e.rows, c.Key)
		})
	}
	for _, c := range cfgs {
		c.spec.name = "tp-" + c.Key
		// Zone names differ per config, so that no two share buckets in Redis.
		if strings.Contains(c.spec.site, "%s") {
			c.spec.site = fmt.Sprintf(c.spec.site, strings.ReplaceAll(c.Key, "-", "_"))
		}
	}
	return cfgs
}

// staticHeaders is a site without a limiter that sends the five header
// fields an allowed request of a zone of rate 1000000r/s gets, as fixed
// values of the same lengths.
const staticHeaders = `header {
	X-Ratelimit-Limit 1000000
	X-Ratelimit-Remaining 999999
	X-Ratelimit-Reset 1796233036
	Ratelimit-Policy "\"local_allowed\";q=1000000;w=1"
	Ratelimit "\"local_allowed\";r=999999;t=1"
}
respond "ok"`

// tpWrk runs wrk against c with c's keys.
func (e *env) tpWrk(name string, c *tpConfig, dur time.Duration) (wrkResult, error) {
	script := filepath.Join(e.tmp, "random-keys.lua")
	if _, err := os.Stat(script); err != nil {
		if err := os.WriteFile(script, []byte(randomKeysLua), 0o644); err != nil {
			return wrkResult{}, err
		}
	}
	return e.runWrk(name, c.inst.url, dur, script, strconv.Itoa(c.Keys))
}

func (e *env) runThroughput() ([]*tpResult, *rrResult, noise, error) {
	p := e.p
	cfgs := e.tpConfigs()
	for _, c := range cfgs {
		inst, err := e.startCaddy(c.spec)
		if err != nil {
			return nil, nil, noise{}, err
		}
		c.inst = inst
		defer inst.stop()
	}
	// redis_rate takes a turn in each round when Redis rows are measured,
	// so that their script time has a reference from the same Redis and
	// the same minutes.
	var rr *redisRate
	if slices.ContainsFunc(cfgs, func(c *tpConfig) bool { return c.redis }) {
		rr = newRedisRate(e.redis.addr)
		defer rr.close()
	}
	// Check each answers as it should, then warm each up.
	for _, c := range cfgs {
		key := map[string]string{"X-Key": "key-1"}
		switch c.Path {
		case "denied":
			_, _ = get(c.inst.url, key)
			if err := expect(c.inst, key, 429); err != nil {
				return nil, nil, noise{}, err
			}
		default:
			if err := expect(c.inst, key, 200); err != nil {
				return nil, nil, noise{}, err
			}
		}
		if _, err := e.tpWrk(c.Key+"-warmup", c, p.wrkWarm); err != nil {
			return nil, nil, noise{}, err
		}
	}
	if rr != nil {
		if _, _, err := rr.allow(p.wrkWarm); err != nil {
			return nil, nil, noise{}, err
		}
	}
	m := meter()
	runs := make(map[string][]tpRun)
	var rrRuns []rrRun
	turns := len(cfgs)
	if rr != nil {
		turns++ // the last turn is redis_rate's
	}
	for round := range p.rounds {
		// Rotate the order, so that no configuration always runs first.
		for i := range turns {
			time.Sleep(p.gap)
			j := (i + round) % turns
			if j == len(cfgs) {
				run, err := e.redisRateRun(rr, p.wrkDur)
				if err != nil {
					return nil, nil, noise{}, err
				}
				log.Printf("  round %d %-14s %8.0f decisions/s  Redis script %.1f µs, CPU %.1f µs per decision",
					round+1, "redis_rate", run.PerSec, float64(run.ScriptPerDecision)/1e3, float64(run.RedisCPUPerDecision)/1e3)
				rrRuns = append(rrRuns, run)
				continue
			}
			c := cfgs[j]
			cpu0, err := procCPU(c.inst.proc.pid())
			if err != nil {
				return nil, nil, noise{}, err
			}
			r0, err := e.redis.use()
			if err != nil {
				return nil, nil, noise{}, err
			}
			w, err := e.tpWrk(fmt.Sprintf("%s-%d", c.Key, round+1), c, p.wrkDur)
			if err != nil {
				return nil, nil, noise{}, err
			}
			cpu1, err := procCPU(c.inst.proc.pid())
			if err != nil {
				return nil, nil, noise{}, fmt.Errorf("%s: %w (%v)", c.Key, err, c.inst.proc.exited())
			}
			r1, err := e.redis.use()
			if err != nil {
				return nil, nil, noise{}, err
			}
			run := tpRun{wrkResult: w, RedisPerReq: num(nan)}
			if n := w.Requests; n > 0 {
				run.CPUPerReq = (cpu1 - cpu0) / time.Duration(n)
				if c.redis {
					run.RedisPerReq = num(float64(r1.calls-r0.calls) / float64(n))
					run.ScriptPerReq = (r1.script - r0.script) / time.Duration(n)
				}
				if c.redis || c.pings {
					run.RedisCPUPerReq = (r1.cpu - r0.cpu) / time.Duration(n)
				}
			}
			log.Printf("  round %d %-14s %8.0f req/s  p50 %-8s p99 %-8s non-2xx %5.1f%%  Caddy CPU %.1f µs/req",
				round+1, c.Key, w.RPS, ms(w.P50), ms(w.P99), 100*float64(w.Non2xx)/float64(max(w.Requests, 1)), float64(run.CPUPerReq)/1e3)
			runs[c.Key] = append(runs[c.Key], run)
		}
	}
	nz := m.since()

	var out []*tpResult
	for _, c := range cfgs {
		rs := runs[c.Key]
		r := &tpResult{Key: c.Key, Impl: c.Impl, Path: c.Path, Keys: c.Keys, Runs: rs}
		var rps, p50, p99, cpu, rcpu, redis, script []float64
		var non2xx, total int64
		for _, x := range rs {
			rps = append(rps, x.RPS)
			p50 = append(p50, float64(x.P50))
			p99 = append(p99, float64(x.P99))
			cpu = append(cpu, float64(x.CPUPerReq))
			rcpu = append(rcpu, float64(x.RedisCPUPerReq))
			redis = append(redis, float64(x.RedisPerReq))
			script = append(script, float64(x.ScriptPerReq))
			non2xx += x.Non2xx
			total += x.Requests
		}
		r.RPS, r.P50, r.P99 = benchkit.Median(rps), time.Duration(benchkit.Median(p50)), time.Duration(benchkit.Median(p99))
		r.CPUPerReq, r.RedisPerReq = time.Duration(benchkit.Median(cpu)), num(benchkit.Median(redis))
		r.RedisCPUPerReq = time.Duration(benchkit.Median(rcpu))
		r.ScriptPerReq = time.Duration(benchkit.Median(script))
		r.Non2xx = float64(non2xx) / float64(max(total, 1))
		out = append(out, r)
	}
	// The baseline is every run of `respond` without a limiter, from both
	// binaries: they differ only in the limiter they carry, and twice the
	// samples make a steadier median.
	var rps, p50, p99, cpu []float64
	for _, r := range out {
		if r.Path != "" {
			continue
		}
		for _, x := range r.Runs {
			rps = append(rps, x.RPS)
			p50 = append(p50, float64(x.P50))
			p99 = append(p99, float64(x.P99))
			cpu = append(cpu, float64(x.CPUPerReq))
		}
	}
	baseRPS, baseP50, baseP99, baseCPU := benchkit.Median(rps), benchkit.Median(p50), benchkit.Median(p99), benchkit.Median(cpu)
	for _, r := range out {
		r.RatioRPS = r.RPS / baseRPS
		r.RatioP50 = float64(r.P50) / baseP50
		r.RatioP99 = float64(r.P99) / baseP99
		r.RatioCPU = float64(r.CPUPerReq) / baseCPU
	}
	return out, rrMedians(rrRuns), nz, nil
}
