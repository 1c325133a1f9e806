// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command adaptive is the load scenario of `concurrency adaptive`: a test
// upstream that works on a few requests at once and queues the others,
// behind a Caddy built from this repository, driven by closed-loop
// clients; with the adaptive zone, without a limiter, and with a fixed
// concurrency. It writes bench/results/adaptive.md, adaptive.json and a
// plot per scenario. bench/adaptive/run.sh (make bench-adaptive) builds
// and runs it; docs/adaptive.md says what it shows.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// A scenario is an upstream, a load, and the limiters to compare.
type scenario struct {
	ID, Title string
	Workers   int
	Service   time.Duration
	Limiters  []string
	load      load
	Warm      time.Duration // measured from then on
	// SlowAt: the upstream's service time becomes SlowTo then (0: never).
	SlowAt, SlowTo time.Duration
}

func (s scenario) capacity() float64 { return float64(s.Workers) / s.Service.Seconds() }

func scenarios(backoff time.Duration) []scenario {
	ms := time.Millisecond
	return []scenario{
		{ID: "8-workers", Title: "8 workers of 20 ms (400/s), 64 clients", Workers: 8, Service: 20 * ms,
			Limiters: []string{"no limiter", "adaptive"}, load: load{clients: 64, length: 20 * time.Second, backoff: backoff}, Warm: 3 * time.Second},
		{ID: "32-workers", Title: "32 workers of 20 ms (1600/s), 64 clients", Workers: 32, Service: 20 * ms,
			Limiters: []string{"no limiter", "adaptive", "concurrency 8"}, load: load{clients: 64, length: 20 * time.Second, backoff: backoff}, Warm: 3 * time.Second},
		{ID: "load-falls", Title: "8 workers of 20 ms, 64 clients, then 4 from 10 s", Workers: 8, Service: 20 * ms,
			Limiters: []string{"adaptive"}, load: load{clients: 64, length: 25 * time.Second, fallAt: 10 * time.Second, fallTo: 4, backoff: backoff}, Warm: 3 * time.Second},
		{ID: "upstream-slows", Title: "8 workers, 20 ms then 60 ms from 10 s, 64 clients", Workers: 8, Service: 20 * ms,
			Limiters: []string{"no limiter", "adaptive"}, load: load{clients: 64, length: 25 * time.Second, backoff: backoff}, Warm: 3 * time.Second,
			SlowAt: 10 * time.Second, SlowTo: 60 * ms},
		{ID: "priority", Title: "8 workers of 20 ms, 64 clients of the lowest class and 4 critical ones 60 ms apart", Workers: 8, Service: 20 * ms,
			Limiters: []string{"adaptive", "adaptive, reserve critical 25%"},
			load:     load{clients: 64, length: 20 * time.Second, backoff: backoff, critical: 4, think: 60 * ms}, Warm: 3 * time.Second},
	}
}

func main() {
	bin := flag.String("caddy", "bin/caddy", "the Caddy built from this repository")
	out := flag.String("out", "results", "where to write the results")
	name := flag.String("name", "adaptive", "the results' name: <name>.md, <name>.json, <name>_<scenario>.png")
	rounds := flag.Int("rounds", 3, "rounds of every run; the results give medians")
	only := flag.String("only", "", "scenarios to run, comma-separated (default: all)")
	backoff := flag.Duration("backoff", 0, "how long a refused client waits before its next request")
	note := flag.String("note", "", "a note on the run for the results")
	flag.Parse()
	log.SetFlags(log.Ltime)
	tmp, err := os.MkdirTemp("", "adaptive-bench-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	rep := &report{Name: *name, Began: time.Now().UTC(), Rounds: *rounds, Backoff: *backoff, Note: *note, Machine: machine()}
	for _, s := range scenarios(*backoff) {
		if *only == "" || strings.Contains(","+*only+",", ","+s.ID+",") {
			rep.Scenarios = append(rep.Scenarios, &scenarioResult{scenario: s})
		}
	}
	for round := range *rounds {
		for _, sr := range rep.Scenarios {
			for _, lim := range sr.Limiters {
				log.Printf("round %d: %s, %s", round+1, sr.ID, lim)
				r, err := run(*bin, filepath.Join(tmp, fmt.Sprintf("%s-%s-%d", sr.ID, benchkit.Slug(lim), round)), sr.scenario, lim)
				if err != nil {
					log.Fatalf("%s, %s: %v", sr.ID, lim, err)
				}
				sr.add(lim, r)
			}
		}
	}
	rep.Seconds = time.Since(rep.Began).Seconds()
	rep.Machine.LoadAfter = loadavg()
	if err := rep.write(*out); err != nil {
		log.Fatal(err)
	}
	log.Printf("done in %.0fs: %s", rep.Seconds, filepath.Join(*out, *name+".md"))
}

// run is one run of a scenario behind one limiter.
func run(bin, dir string, s scenario, limiter string) (*runResult, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	up, err := startUpstream(s.Workers, s.Service)
	if err != nil {
		return nil, err
	}
	defer up.stop()
	c, err := startCaddy(bin, dir, limiter, up.addr)
	if err != nil {
		return nil, err
	}
	defer c.stop()
	start := time.Now()
	stop := make(chan struct{})
	samples := make(chan []sample, 1)
	go func() { samples <- watch(c.admin, start, 100*time.Millisecond, stop) }()
	if s.SlowAt > 0 {
		t := time.AfterFunc(s.SlowAt-time.Since(start), func() { up.setService(s.SlowTo) })
		defer t.Stop()
	}
	reqs := drive(c.url, s.load, start)
	close(stop)
	r := &runResult{start: start, reqs: reqs, samples: <-samples, work: up.done()}
	r.measure(s)
	return r, nil
}
