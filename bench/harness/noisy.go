// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
	vegeta "github.com/tsenart/vegeta/v12/lib"
)

// The noisy-neighbour scenario: well-behaved users call an API through
// Caddy's reverse_proxy; after a while one runaway client floods it.

// backendInst is the running backend.
type backendInst struct {
	proc *proc
	addr string
}

type backendStats struct {
	Served     int64   `json:"served"`
	Abandoned  int64   `json:"abandoned"`
	Inflight   int64   `json:"inflight"`
	CPUns      int64   `json:"cpu_ns"`
	Iterations int64   `json:"iterations"`
	IterNs     float64 `json:"iter_ns"`
	Workers    int     `json:"workers"`
}

func (e *env) startBackend() (*backendInst, error) {
	port, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p, err := start("backend", filepath.Join(e.tmp, "backend.log"), nil, filepath.Join(e.bin, "backend"),
		"-addr", addr, "-work", e.p.work.String())
	if err != nil {
		return nil, err
	}
	b := &backendInst{proc: p, addr: addr}
	return b, waitListening(p, addr, 10*time.Second)
}

func (b *backendInst) stats() (backendStats, error) {
	var s backendStats
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + b.addr + "/_stats")
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// waitIdle waits until the backend has no request in progress or queued.
func (b *backendInst) waitIdle(timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if s, err := b.stats(); err == nil && s.Inflight == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// hit is one request's outcome, relative to the start of the run.
type hit struct {
	at   time.Duration // when it was sent
	lat  time.Duration // until the answer, or until the client gave up
	code uint16        // 0 when it failed (timeout, connection error)
}

// noisyRun is the outcome of one configuration.
type noisyRun struct {
	Name, Config string

	UsersBefore latStats // before the flood starts
	Users       latStats // while it lasts
	UsersOK     float64  // share of users' requests answered 2xx during the flood
	UsersSent   int

	FloodSent  int
	FloodRate  float64 // requests sent per second
	Flood2xx   float64 // shares of the flooder's requests
	Flood429   float64
	FloodOther float64 // other statuses
	FloodFail  float64 // timeouts and connection errors
	Flood429L  latStats

	BackendCores float64 // backend CPU during the flood, in cores
	BackendRPS   float64 // requests the backend served per second during the flood
	CaddyCores   float64
	LoadGenCores float64 // the harness's CPU (vegeta), in cores
	RedisPerReq  num     // EVALSHA/EVAL calls per request during the flood; NaN without Redis
	Noise        noise

	users, flood []hit
}

type noisyConfig struct {
	name, config string
	site         string
	redis        bool
	peer         bool // github.com/mholt/caddy-ratelimit's binary
}

func (e *env) noisyConfigs() []noisyConfig {
	proxy := "reverse_proxy " + e.backend.addr
	zone := `rate_limit {
	zone api {
		key {http.request.header.X-API-Key}
		rate 10r/s
		burst 20
	}%s
}
` + proxy
	return []noisyConfig{
		{name: "no limiter", config: "`reverse_proxy` only", site: proxy},
		{name: "rate_limit local", config: "10 r/s, burst 20 per X-API-Key, in memory", site: fmt.Sprintf(zone, "")},
		{name: "rate_limit redis", config: "same, buckets in Redis",
			site:  fmt.Sprintf(zone, "\n\tstore redis {\n\t\taddress "+e.redis.addr+"\n\t}"),
			redis: true},
		// caddy-ratelimit's nearest: 20 events per 2s, a sliding window.
		{name: "caddy-ratelimit", config: "caddy-ratelimit v0.1.0: 20 events per 2s per X-API-Key",
			site: "rate_limit {\n\tzone api {\n\t\tkey {http.request.header.X-API-Key}\n\t\tevents 20\n\t\twindow 2s\n\t}\n}\n" + proxy,
			peer: true},
	}
}

// noisyResult is a configuration's medians over the rounds.
type noisyResult struct {
	noisyRun             // each number the median of the rounds' (UsersBefore: only P95)
	Rounds   []*noisyRun `json:"-"`
	// Typical is the round whose users' p95 during the flood is the
	// median: the one the plots show.
	Typical int
}

func (e *env) runNoisy() ([]*noisyResult, error) {
	cfgs := e.noisyConfigs()
	rounds := make([][]*noisyRun, len(cfgs))
	for round := range e.p.noisyRounds {
		for i := range cfgs {
			// Rotate the order, so that no configuration always runs first.
			k := (i + round) % len(cfgs)
			if round > 0 || i > 0 {
				time.Sleep(e.p.pause)
			}
			r, err := e.noisyOnce(cfgs[k])
			if err != nil {
				return nil, err
			}
			log.Printf("  round %d %-17s users p50 %v p95 %v p99 %v ok %s | flood 429 %s (p50 %v p99 %v) | backend %.2f cores | others %s",
				round+1, r.Name, ms(r.Users.P50), ms(r.Users.P95), ms(r.Users.P99), pct(r.UsersOK),
				pct(r.Flood429), ms(r.Flood429L.P50), ms(r.Flood429L.P99), r.BackendCores, pct(r.Noise.Others))
			rounds[k] = append(rounds[k], r)
		}
	}
	var out []*noisyResult
	for i, rs := range rounds {
		res := &noisyResult{Rounds: rs}
		res.Name, res.Config = cfgs[i].name, cfgs[i].config
		med := func(f func(r *noisyRun) float64) float64 {
			xs := make([]float64, len(rs))
			for j, r := range rs {
				xs[j] = f(r)
			}
			return benchkit.Median(xs)
		}
		dur := func(f func(r *noisyRun) time.Duration) time.Duration {
			return time.Duration(med(func(r *noisyRun) float64 { return float64(f(r)) }))
		}
		m := &res.noisyRun
		m.UsersBefore.P95 = dur(func(r *noisyRun) time.Duration { return r.UsersBefore.P95 })
		m.Users.P50 = dur(func(r *noisyRun) time.Duration { return r.Users.P50 })
		m.Users.P95 = dur(func(r *noisyRun) time.Duration { return r.Users.P95 })
		m.Users.P99 = dur(func(r *noisyRun) time.Duration { return r.Users.P99 })
		m.UsersOK = med(func(r *noisyRun) float64 { return r.UsersOK })
		m.FloodRate = med(func(r *noisyRun) float64 { return r.FloodRate })
		m.Flood2xx = med(func(r *noisyRun) float64 { return r.Flood2xx })
		m.Flood429 = med(func(r *noisyRun) float64 { return r.Flood429 })
		m.FloodFail = med(func(r *noisyRun) float64 { return r.FloodFail + r.FloodOther })
		m.Flood429L.N = int(med(func(r *noisyRun) float64 { return float64(r.Flood429L.N) }))
		m.Flood429L.P50 = dur(func(r *noisyRun) time.Duration { return r.Flood429L.P50 })
		m.Flood429L.P99 = dur(func(r *noisyRun) time.Duration { return r.Flood429L.P99 })
		m.BackendCores = med(func(r *noisyRun) float64 { return r.BackendCores })
		m.BackendRPS = med(func(r *noisyRun) float64 { return r.BackendRPS })
		m.CaddyCores = med(func(r *noisyRun) float64 { return r.CaddyCores })
		m.LoadGenCores = med(func(r *noisyRun) float64 { return r.LoadGenCores })
		m.RedisPerReq = num(med(func(r *noisyRun) float64 { return float64(r.RedisPerReq) }))
		m.Noise.Others = med(func(r *noisyRun) float64 { return r.Noise.Others })
		// The typical round: nearest to the median users' p95.
		best := time.Duration(1<<63 - 1)
		for j, r := range rs {
			if d := (r.Users.P95 - m.Users.P95).Abs(); d < best {
				best, res.Typical = d, j
			}
		}
		out = append(out, res)
	}
	return out, nil
}

// snapshot is the counters at one instant.
type snapshot struct {
	at      time.Time
	self    time.Duration
	backend backendStats
	caddy   time.Duration
	redis   int64
}

func (e *env) snap(c *caddyInst) (snapshot, error) {
	s := snapshot{at: time.Now(), self: selfCPU()}
	var err error
	if s.backend, err = e.backend.stats(); err != nil {
		return s, fmt.Errorf("backend stats: %w", err)
	}
	if s.caddy, err = procCPU(c.proc.pid()); err != nil {
		return s, fmt.Errorf("caddy cpu: %w", err)
	}
	if s.redis, _, err = e.redis.scriptCalls(); err != nil {
		return s, fmt.Errorf("redis stats: %w", err)
	}
	return s, nil
}

func (e *env) noisyOnce(nc noisyConfig) (*noisyRun, error) {
	p := e.p
	bin := e.caddyBin
	if nc.peer {
		bin = e.peerBin
	}
	c, err := e.startCaddy(caddySpec{name: "noisy-" + benchkit.Slug(nc.name), bin: bin, site: nc.site})
	if err != nil {
		return nil, err
	}
	defer c.stop()
	if err := expect(c, map[string]string{"X-API-Key": "check"}, 200); err != nil {
		return nil, err
	}
	m := meter()

	url := c.url + "api/items"
	keys := make([]string, p.users)
	for i := range keys {
		keys[i] = fmt.Sprintf("user-%03d", i+1)
	}
	var next atomic.Uint64
	usersTarget := func(t *vegeta.Target) error {
		n := next.Add(1)
		t.Method, t.URL = "GET", url
		t.Header = http.Header{"X-Api-Key": {keys[n%uint64(len(keys))]}}
		return nil
	}
	floodTarget := func(t *vegeta.Target) error {
		t.Method, t.URL = "GET", url
		t.Header = http.Header{"X-Api-Key": {"runaway-script"}}
		return nil
	}
	usersAtk := vegeta.NewAttacker(vegeta.Timeout(p.timeout), vegeta.MaxBody(0))
	floodAtk := vegeta.NewAttacker(vegeta.Timeout(p.timeout), vegeta.MaxBody(0),
		vegeta.MaxConnections(p.floodConns), vegeta.Connections(p.floodConns))

	r := &noisyRun{Name: nc.name, Config: nc.config}
	var wg sync.WaitGroup
	var s0, s1 snapshot
	var snapErr error
	t0 := time.Now()
	collect := func(wg *sync.WaitGroup, ch <-chan *vegeta.Result, out *[]hit) {
		defer wg.Done()
		for res := range ch {
			*out = append(*out, hit{at: res.Timestamp.Sub(t0), lat: res.Latency, code: res.Code})
		}
	}
	wg.Add(2)
	go collect(&wg, usersAtk.Attack(usersTarget, vegeta.Rate{Freq: p.users * p.userRate, Per: time.Second},
		p.warm+p.flood, "users"), &r.users)
	go func() {
		defer wg.Done()
		time.Sleep(time.Until(t0.Add(p.warm)))
		s0, snapErr = e.snap(c)
		var fwg sync.WaitGroup
		fwg.Add(1)
		go collect(&fwg, floodAtk.Attack(floodTarget, vegeta.Rate{Freq: p.floodRate, Per: time.Second}, p.flood, "flood"), &r.flood)
		time.Sleep(time.Until(t0.Add(p.warm + p.flood)))
		var err error
		if s1, err = e.snap(c); snapErr == nil {
			snapErr = err
		}
		fwg.Wait()
	}()
	wg.Wait()
	if snapErr != nil {
		return nil, snapErr
	}
	r.Noise = m.since()
	e.dumpHits(nc.name, r)
	if err := c.proc.exited(); err != nil {
		return nil, err
	}

	// Users: before the flood, and during it.
	var before, during []time.Duration
	ok := 0
	for _, h := range r.users {
		switch {
		case h.at < time.Second:
			// connections being opened
		case h.at < p.warm:
			before = append(before, h.lat)
		case h.at < p.warm+p.flood:
			during = append(during, h.lat)
			if h.code >= 200 && h.code < 300 {
				ok++
			}
		}
	}
	r.UsersSent = len(r.users)
	r.UsersBefore, r.Users = summarize(before), summarize(during)
	if len(during) > 0 {
		r.UsersOK = float64(ok) / float64(len(during))
	}

	// The flooder.
	var lat429 []time.Duration
	var n2xx, n429, nOther, nFail int
	var first, last time.Duration
	for i, h := range r.flood {
		if i == 0 || h.at < first {
			first = h.at
		}
		last = max(last, h.at)
		switch {
		case h.code == 429:
			n429++
			lat429 = append(lat429, h.lat)
		case h.code >= 200 && h.code < 300:
			n2xx++
		case h.code == 0:
			nFail++
		default:
			nOther++
		}
	}
	if n := len(r.flood); n > 0 {
		f := float64(n)
		r.FloodSent = n
		r.FloodRate = f / p.flood.Seconds()
		r.Flood2xx, r.Flood429, r.FloodOther, r.FloodFail = float64(n2xx)/f, float64(n429)/f, float64(nOther)/f, float64(nFail)/f
	}
	r.Flood429L = summarize(lat429)

	// Counters during the flood.
	d := s1.at.Sub(s0.at).Seconds()
	r.BackendCores = float64(s1.backend.CPUns-s0.backend.CPUns) / 1e9 / d
	r.BackendRPS = float64(s1.backend.Served-s0.backend.Served) / d
	r.CaddyCores = (s1.caddy - s0.caddy).Seconds() / d
	r.LoadGenCores = (s1.self - s0.self).Seconds() / d
	r.RedisPerReq = num(nan)
	if nc.redis {
		sent := 0
		for _, hs := range [][]hit{r.users, r.flood} {
			for _, h := range hs {
				if h.at >= p.warm && h.at < p.warm+p.flood {
					sent++
				}
			}
		}
		if sent > 0 {
			r.RedisPerReq = num(float64(s1.redis-s0.redis) / float64(sent))
		}
	}
	e.backend.waitIdle(10 * time.Second)
	return r, nil
}

func ms(d time.Duration) string {
	f := float64(d) / 1e6
	switch {
	case f >= 100:
		return strconv.FormatFloat(f, 'f', 0, 64) + " ms"
	case f >= 10:
		return strconv.FormatFloat(f, 'f', 1, 64) + " ms"
	default:
		return strconv.FormatFloat(f, 'f', 2, 64) + " ms"
	}
}

// usersBefore is the users' latencies before the flood, after the first
// second (when connections are being opened).
func (r *noisyRun) usersBefore(p params) []time.Duration {
	var ds []time.Duration
	for _, h := range r.users {
		if h.at >= time.Second && h.at < p.warm {
			ds = append(ds, h.lat)
		}
	}
	return ds
}

// usersDuring is the users' latencies during the flood.
func (r *noisyRun) usersDuring(p params) []time.Duration {
	var ds []time.Duration
	for _, h := range r.users {
		if h.at >= p.warm && h.at < p.warm+p.flood {
			ds = append(ds, h.lat)
		}
	}
	return ds
}

// dumpHits writes the raw outcomes to the temporary directory, for -keep.
func (e *env) dumpHits(name string, r *noisyRun) {
	f, err := os.Create(filepath.Join(e.tmp, "hits-"+benchkit.Slug(name)+".csv"))
	if err != nil {
		return
	}
	defer f.Close()
	w := bufio.NewWriter(f)
	defer w.Flush()
	fmt.Fprintln(w, "who,sent_ms,latency_ms,code")
	for _, h := range r.users {
		fmt.Fprintf(w, "user,%.3f,%.3f,%d\n", msf(h.at), msf(h.lat), h.code)
	}
	for _, h := range r.flood {
		fmt.Fprintf(w, "flood,%.3f,%.3f,%d\n", msf(h.at), msf(h.lat), h.code)
	}
}
