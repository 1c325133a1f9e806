// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"debug/buildinfo"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"
)

// num is a float that is null in JSON when it is not a number.
type num float64

func (n num) MarshalJSON() ([]byte, error) {
	f := float64(n)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return []byte("null"), nil
	}
	return json.Marshal(f)
}

type machine struct {
	Cores      int
	CPU        string
	MemGiB     float64
	OS, Kernel string
	Go         string // the toolchain that built Caddy
	Caddy      string
	Plugin     string // this repository's commit
	Peer       string // github.com/mholt/caddy-ratelimit
	Redis      string
	Wrk        string
	Vegeta     string
	RedisRate  string // github.com/go-redis/redis_rate, built into the harness
	LoadBefore string
	LoadAfter  string
}

type report struct {
	Mode    string
	Note    string
	Began   time.Time
	Seconds float64
	Params  params `json:"-"`
	Machine machine
	Noise   noise // over the whole run

	Backend      backendStats
	Noisy        []*noisyResult
	NoisySeconds float64

	Throughput        []*tpResult
	RedisRate         *rrResult // redis_rate on the same Redis, in the same rounds
	ThroughputNoise   noise
	ThroughputSeconds float64

	Memory        []*memResult
	MemoryNoise   noise
	MemorySeconds float64
}

func (e *env) machine() machine {
	m := machine{Cores: runtime.NumCPU(), LoadBefore: loadavg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if kb, err := procStatusKBFile("/proc/meminfo", "MemTotal"); err == nil {
		m.MemGiB = float64(kb) / (1 << 20)
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
				m.OS = strings.Trim(v, `"`)
			}
		}
	}
	if bi, err := buildinfo.ReadFile(e.caddyBin); err == nil {
		m.Go = bi.GoVersion
		for _, d := range bi.Deps {
			if d.Path == "github.com/caddyserver/caddy/v2" {
				m.Caddy = d.Version
			}
		}
	}
	if bi, err := buildinfo.ReadFile(e.peerBin); err == nil {
		for _, d := range bi.Deps {
			if d.Path == "github.com/mholt/caddy-ratelimit" {
				m.Peer = d.Version
			}
		}
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			switch d.Path {
			case "github.com/tsenart/vegeta/v12":
				m.Vegeta = d.Version
			case "github.com/go-redis/redis_rate/v10":
				m.RedisRate = d.Version
			}
		}
	}
	if out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		m.Plugin = strings.TrimSpace(string(out))
		// Uncommitted changes outside bench/ change what is measured.
		if st, err := exec.Command("git", "status", "--porcelain", "--", "..", ":!../bench").Output(); err == nil && len(st) > 0 {
			m.Plugin += " (with uncommitted changes)"
		}
	}
	if out, _ := exec.Command("wrk", "-v").CombinedOutput(); len(out) > 0 {
		line, _, _ := strings.Cut(string(out), "\n")
		if f := strings.Fields(line); len(f) > 1 {
			m.Wrk = f[1]
		}
	}
	return m
}

func procStatusKBFile(file, field string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in %s", field, file)
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func (rep *report) write(out string) error {
	plots, err := writePlots(rep, out)
	if err != nil {
		return err
	}
	j, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "results.json"), append(j, '\n'), 0o644); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(out, "README.md"))
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	rep.markdown(w, plots)
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (rep *report) markdown(w *bufio.Writer, plots []string) {
	p := rep.Params
	m := rep.Machine
	pf := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	has := func(name string) bool {
		for _, f := range plots {
			if f == name {
				return true
			}
		}
		return false
	}

	pf("# Benchmark results\n\n")
	pf("Written by `bench/run.sh %s` on %s (%s mode, %.0f s). ", rep.Mode, rep.Began.Format("2006-01-02 15:04 UTC"), rep.Mode, rep.Seconds)
	pf("See [../README.md](../README.md) for what is measured and how. ")
	target := "bench"
	if rep.Mode != "full" {
		target = "bench-" + rep.Mode
	}
	pf("To reproduce: `make %s` at the repository root, or `bench/run.sh %s` (needs Go, `redis-server` and `wrk`: `apt-get install redis-server wrk`).\n\n", target, rep.Mode)
	if rep.Note != "" {
		pf("> **Note:** %s\n\n", rep.Note)
	}
	if rep.Noise.Others > 0.05 {
		pf("> **The machine was shared:** processes outside the benchmark used %s of its CPU during the run "+
			"(per phase below), so these numbers are noisier than on an idle machine.\n\n", pct(rep.Noise.Others))
	}
	pf("| machine | |\n|---|---|\n")
	pf("| CPU | %d cores, %s |\n", m.Cores, m.CPU)
	pf("| memory | %.1f GiB |\n", m.MemGiB)
	pf("| OS | %s, Linux %s |\n", m.OS, m.Kernel)
	pf("| Go | %s |\n", m.Go)
	pf("| Caddy | %s |\n", m.Caddy)
	pf("| rate_limit (this repository) | commit %s |\n", m.Plugin)
	pf("| github.com/mholt/caddy-ratelimit | %s |\n", m.Peer)
	pf("| Redis | %s |\n", m.Redis)
	pf("| wrk | %s |\n", m.Wrk)
	pf("| vegeta | %s |\n", m.Vegeta)
	pf("| load average before / after | %s / %s |\n", m.LoadBefore, m.LoadAfter)
	pf("| CPU used by processes outside the benchmark | %s of the machine over the run (busy in all: %s) |\n\n",
		pct(rep.Noise.Others), pct(rep.Noise.Busy))
	pf("Everything runs on this one machine: the load generators (vegeta in the harness, wrk), Caddy, the backend and Redis share the %d cores, "+
		"so absolute numbers are lower than on a dedicated server. Compare within a table, not across machines.\n\n", m.Cores)

	if len(rep.Noisy) > 0 {
		rep.noisyMarkdown(pf, has)
	}
	if len(rep.Throughput) > 0 {
		rep.throughputMarkdown(pf, has)
	}
	if len(rep.Memory) > 0 {
		pf("## Memory: 1 request each from %s distinct keys\n\n", humanCount(float64(p.keys)))
		pf("`wrk -t1 -c50` with a Lua script sending `X-Key: key-1`, `key-2`, … one key per request; zone key `{http.request.header.X-Key}`. "+
			"Memory is read from `/proc/<pid>/status` after a forced GC (Caddy's admin API `/debug/pprof/heap?gc=1`, twice, 1 s apart). "+
			"Go heap is `memstats.HeapInuse` from `/debug/vars`. Phase: %.0f s; others' CPU %s.\n\n", rep.MemorySeconds, pct(rep.MemoryNoise.Others))
		pf("| implementation | zone | keys | RSS idle | RSS after | RSS growth per key | Go heap growth per key | peak RSS (VmHWM) |\n")
		pf("|---|---|---:|---:|---:|---:|---:|---:|\n")
		for _, r := range rep.Memory {
			pf("| %s | %s | %s | %.0f MiB | %.0f MiB | %.0f B | %.0f B | %.0f MiB |\n", r.Impl, r.Config, humanCount(float64(r.Keys)),
				float64(r.RSSIdle)/1024, float64(r.RSSAfter)/1024, r.perKey(), r.heapPerKey(), float64(r.HWM)/1024)
		}
		pf("\nOur local store keeps one 8-byte hash and one 8-byte instant per bucket, whatever the key's length, and drops buckets once they are full again " +
			"(here 0.1 s after the key's one request), when a shard needs room or on its once-a-minute sweep. " +
			"caddy-ratelimit keeps the key string and a ring of `events` timestamps per key until its sweep (every minute by default).\n\n")
		if has("memory.png") {
			pf("![Caddy RSS before and after the keys](memory.png)\n\n")
		}
	}

	pf("## Durations\n\n| phase | seconds |\n|---|---:|\n")
	if len(rep.Noisy) > 0 {
		pf("| noisy neighbour | %.0f |\n", rep.NoisySeconds)
	}
	if len(rep.Throughput) > 0 {
		pf("| throughput | %.0f |\n", rep.ThroughputSeconds)
	}
	if len(rep.Memory) > 0 {
		pf("| memory | %.0f |\n", rep.MemorySeconds)
	}
	pf("| whole run (without building) | %.0f |\n\n", rep.Seconds)
	pf("Raw numbers: [results.json](results.json).\n")
}

func (rep *report) noisyMarkdown(pf func(string, ...any), has func(string) bool) {
	p := rep.Params
	b := rep.Backend
	pf("## Noisy neighbour\n\n")
	pf("An API behind Caddy's `reverse_proxy`: a Go backend that burns %v of CPU per request (%d rounds of integer mixing, calibrated at start) "+
		"with %d workers and a first-come-first-served queue. "+
		"**Users**: %d API keys (`X-API-Key`), %d req/s each, %d req/s in all, open loop (vegeta), from t = 0 for %v. "+
		"**Flooder**: one key at %d req/s, open loop, from t = %v for %v, with up to %d connections. "+
		"Every client gives up after %v (a failure, counted with that latency). "+
		"Limiter: `rate 10r/s`, `burst 20` per `X-API-Key`. "+
		"%s Phase: %.0f s.\n\n",
		p.work, b.Iterations, b.Workers, p.users, p.userRate, p.users*p.userRate, p.warm+p.flood,
		p.floodRate, p.warm, p.flood, p.floodConns, p.timeout, roundsText(p.noisyRounds, "three runs"), rep.NoisySeconds)

	pf("**Well-behaved users during the flood** (requests sent between t = %v and %v):\n\n", p.warm, p.warm+p.flood)
	pf("| run | p50 | p95 | p99 | success (2xx) | p95 before the flood | p95 per round |\n|---|---:|---:|---:|---:|---:|---|\n")
	for _, r := range rep.Noisy {
		var per []string
		for _, x := range r.Rounds {
			per = append(per, ms(x.Users.P95))
		}
		pf("| %s | %s | %s | %s | %s | %s | %s |\n", r.Name, ms(r.Users.P50), ms(r.Users.P95), ms(r.Users.P99), pct(r.UsersOK),
			ms(r.UsersBefore.P95), strings.Join(per, ", "))
	}
	pf("\n**The flooder, and what the flood cost** (during the flood):\n\n")
	pf("| run | flood sent | 2xx | 429 | failed | 429 latency p50 | 429 latency p99 | backend CPU | backend served | Caddy CPU | vegeta CPU | Redis calls per request | others' CPU |\n")
	pf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rep.Noisy {
		l429p50, l429p99 := "–", "–"
		if r.Flood429L.N > 0 {
			l429p50, l429p99 = ms(r.Flood429L.P50), ms(r.Flood429L.P99)
		}
		redis := "–"
		if !math.IsNaN(float64(r.RedisPerReq)) {
			redis = fmt.Sprintf("%.3f", float64(r.RedisPerReq))
		}
		pf("| %s | %.0f req/s | %s | %s | %s | %s | %s | %.2f cores | %.0f req/s | %.2f cores | %.2f cores | %s | %s |\n",
			r.Name, r.FloodRate, pct(r.Flood2xx), pct(r.Flood429), pct(r.FloodFail), l429p50, l429p99,
			r.BackendCores, r.BackendRPS, r.CaddyCores, r.LoadGenCores, redis, pct(r.Noise.Others))
	}
	pf("\nCPU columns are averages over the flood, in cores (of %d): the backend, Caddy, and the harness that runs vegeta. "+
		"\"Failed\": timeouts and connection errors. "+
		"Redis calls per request: `EVALSHA`+`EVAL` calls in `INFO commandstats` over all requests (users' and flooder's) sent during the flood; "+
		"the Redis store remembers buckets that Redis found empty and denies their requests locally until tokens can have come back. "+
		"Others' CPU: the share of the machine's CPU used by processes outside the benchmark during the run (the noise).\n\n", rep.Machine.Cores)
	if has("noisy_percentiles.png") {
		pf("![Users' latency percentiles per run](noisy_percentiles.png)\n\n")
	}
	if has("noisy_timeline.png") {
		pf("![Users' p95 latency over time](noisy_timeline.png)\n\n")
	}
	if len(rep.Noisy) > 0 && len(rep.Noisy[0].Rounds) > 1 {
		pf("The plots show, for each run, the round whose users' p95 is nearest the median.\n\n")
	}
}

func (rep *report) throughputMarkdown(pf func(string, ...any), has func(string) bool) {
	p := rep.Params
	pf("## Throughput and overhead: wrk\n\n")
	pf("`wrk -t1 -c50 -d%v --latency` against `respond \"ok\"`. %s "+
		"Each request carries one of %d keys in `X-Key`, at random (many clients, as users run it), except the rows marked one key; every zone's key is `{http.request.header.X-Key}`. "+
		"Ratios are to the baseline of this run: the median of all the runs without a limiter, from both binaries "+
		"(ours and caddy-peer share every dependency but the limiter, so the gap between their two rows is noise). wrk and Caddy share the cores. "+
		"Allowed path: a limit never reached (ours `rate 1000000r/s` `burst 1000000`; caddy-ratelimit `events 200` `window 100ms`, "+
		"as its ring of `events` timestamps per key is allocated up front and a large one would slow the GC's pace enough to make it look cheaper than no limiter). "+
		"Denied path: one key, every request after the first over the limit (ours `rate 1r/m` `burst 1`; caddy-ratelimit `events 1` `window 1m`). "+
		"The floor row is that of the headers: no limiter, and Caddy's own `header` handler adds the five fields an allowed request of ours gets (X-RateLimit-Limit, -Remaining, -Reset, RateLimit-Policy, RateLimit), fixed values of the same lengths; what it costs over the baseline is what five more fields cost Caddy and net/http to set, copy (net/http copies a response's header map when it writes the status) and write, whoever sets them. "+
		"The waits rows are floors. The first is that of a limiter that asks a server: caddy-peer's `bench_wait` handler (bench/peer/wait.go) makes each request wait for another goroutine, which answers the requests queued meanwhile together after 20 µs, with no network and no decision; what it costs is what waiting costs Caddy's process. "+
		"The second is that of a limiter that asks Redis through go-redis: `bench_wait redis` makes each request wait for a PING of this run's Redis, batched as the Redis store batches its calls (a request that finds nothing in flight goes alone at once, the others together, up to 4 flights); what it costs is waiting and the socket's writes and reads, with no script, arguments or decision. "+
		"Redis CPU per request is the redis-server process's CPU over the run, per request, for the rows that ask it: it shares the cores with Caddy and wrk. "+
		"Redis calls per request are the `EVALSHA`+`EVAL` calls in `INFO commandstats` over the run, per request: the Redis store sends the decisions queued while a flight is out in one script call. "+
		"Redis script time per request is those calls' `usec` in `INFO commandstats` over the run, per request: the time Redis spent running the scripts, the commands they call included, "+
		"but not reading the requests, parsing them or writing the replies, which Redis CPU counts. "+
		"Each configuration is its own Caddy process, with Caddy's default logging (INFO to stderr, to a file here). "+
		"Phase: %.0f s; others' CPU %s.\n\n",
		p.wrkDur, roundsText(p.rounds, "configurations"), tpKeys, rep.ThroughputSeconds, pct(rep.ThroughputNoise.Others))
	pf("| configuration | path | keys | Caddy CPU per request | ratio | req/s | ratio | p50 | ratio | p99 | ratio | Redis calls per request | Redis script time per request | Redis CPU per request | non-2xx | CPU per request, per round |\n")
	pf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range rep.Throughput {
		path := r.Path
		if path == "" {
			path = "–"
		}
		redis, script := "–", "–"
		if !math.IsNaN(float64(r.RedisPerReq)) {
			redis = fmt.Sprintf("%.3f", float64(r.RedisPerReq))
			script = fmt.Sprintf("%.2f µs", float64(r.ScriptPerReq)/1e3)
		}
		var rounds []string
		for _, x := range r.Runs {
			rounds = append(rounds, fmt.Sprintf("%.1f", float64(x.CPUPerReq)/1e3))
		}
		rcpu := "–"
		if r.RedisCPUPerReq > 0 {
			rcpu = fmt.Sprintf("%.1f µs", float64(r.RedisCPUPerReq)/1e3)
		}
		pf("| %s | %s | %s | %.1f µs | %.2f | %s | %.2f | %s | %.2f | %s | %.2f | %s | %s | %s | %s | %s |\n",
			r.Impl, path, humanCount(float64(r.Keys)), float64(r.CPUPerReq)/1e3, r.RatioCPU, humanCount(r.RPS), r.RatioRPS,
			ms(r.P50), r.RatioP50, ms(r.P99), r.RatioP99, redis, script, rcpu, pct(r.Non2xx), strings.Join(rounds, ", "))
	}
	pf("\nCaddy CPU per request is the Caddy process's user+system time over the run (from `/proc/<pid>/stat`) divided by the requests wrk completed: " +
		"the steady measure on a shared machine, where req/s swings from run to run. " +
		"It does not count time spent waiting for a core, but still varies with the scheduling (how many requests each wake-up handles).\n\n")
	if has("throughput.png") {
		pf("![Requests/s relative to the baseline](throughput.png)\n\n")
	}
	if rep.RedisRate != nil {
		rep.redisRateMarkdown(pf)
	}
}

// redisRateMarkdown sets the Redis rows' allowed path against
// redis_rate's, run on the same Redis in the same rounds.
func (rep *report) redisRateMarkdown(pf func(string, ...any)) {
	rr := rep.RedisRate
	pf("### Per decision on Redis: ours and redis_rate's, same Redis, same run\n\n")
	pf("In each round, taking its turn among the configurations above, the harness itself calls github.com/go-redis/redis_rate %s's `Allow` "+
		"from %d goroutines (go-redis pool of %d) on %d keys at random, with `Rate 1000000`, `Burst 1000000` per second (every decision allowed), for %v, on this run's Redis. "+
		"It makes one script call per decision. Ours are the Redis rows of the allowed path above, where a request is one decision. "+
		"The columns are those of the table above, per decision; ratios are to redis_rate's. "+
		"Its decisions/s do not compare with the req/s above: no HTTP, and the load comes from %d goroutines in the harness rather than 50 wrk connections through Caddy.\n\n",
		rep.Machine.RedisRate, rr.Callers, rr.Callers, rr.Keys, rep.Params.wrkDur, rr.Callers)
	pf("| limiter | keys | decisions/s | Redis calls per decision | Redis script time per decision | ratio | Redis CPU per decision | ratio | script time per decision, per round |\n")
	pf("|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	row := func(name string, keys int, perSec, calls float64, script, cpu time.Duration, rounds []time.Duration) {
		var per []string
		for _, d := range rounds {
			per = append(per, fmt.Sprintf("%.2f", float64(d)/1e3))
		}
		pf("| %s | %s | %s | %.3f | %.2f µs | %.2f | %.1f µs | %.2f | %s |\n", name, humanCount(float64(keys)), humanCount(perSec), calls,
			float64(script)/1e3, float64(script)/float64(rr.ScriptPerDecision), float64(cpu)/1e3, float64(cpu)/float64(rr.RedisCPUPerDecision), strings.Join(per, ", "))
	}
	var rounds []time.Duration
	for _, x := range rr.Runs {
		rounds = append(rounds, x.ScriptPerDecision)
	}
	row("redis_rate `Allow`", rr.Keys, rr.PerSec, rr.CallsPerDecision, rr.ScriptPerDecision, rr.RedisCPUPerDecision, rounds)
	for _, r := range rep.Throughput {
		if r.Path != "allowed" || math.IsNaN(float64(r.RedisPerReq)) {
			continue
		}
		rounds = rounds[:0]
		for _, x := range r.Runs {
			rounds = append(rounds, x.ScriptPerReq)
		}
		row(r.Impl, r.Keys, r.RPS, float64(r.RedisPerReq), r.ScriptPerReq, r.RedisCPUPerReq, rounds)
	}
	pf("\n")
}

func pct(f float64) string {
	switch {
	case math.IsNaN(f):
		return "–"
	case f == 0 || f == 1 || f >= 0.1 && f <= 0.99:
		return strconv.FormatFloat(100*f, 'f', 1, 64) + "%"
	default:
		return strconv.FormatFloat(100*f, 'f', 2, 64) + "%"
	}
}

func humanCount(f float64) string {
	switch {
	case f >= 1e6:
		return strconv.FormatFloat(f/1e6, 'g', 3, 64) + "M"
	case f >= 1e3:
		return strconv.FormatFloat(f/1e3, 'g', 3, 64) + "k"
	default:
		return strconv.FormatFloat(f, 'f', 0, 64)
	}
}

func roundsText(n int, what string) string {
	if n == 1 {
		return "One round of the " + what + " (quick mode: no medians, so more noise)."
	}
	return fmt.Sprintf("%d rounds alternating the %s (order rotated each round); each number is the median of the rounds.", n, what)
}
