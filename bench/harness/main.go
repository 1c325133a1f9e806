// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command harness runs the rate_limit benchmark suite: the noisy-neighbour
// scenario, the throughput comparison with wrk, and the memory comparison,
// then writes Markdown and PNG results. bench/run.sh builds what it needs
// and runs it; see bench/README.md.
package main

import (
	"flag"
	"fmt"
	"log"
	"math"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
)

var nan = math.NaN()

// params bound every phase's duration.
type params struct {
	// noisy neighbour
	work        time.Duration // backend CPU per request
	users       int           // well-behaved users (API keys)
	userRate    int           // requests per second per user
	floodRate   int           // the runaway client's requests per second
	floodConns  int           // connections the runaway client may open
	timeout     time.Duration // clients give up after this
	noisyRounds int
	warm        time.Duration // users only
	flood       time.Duration // users and the flood
	bucket      time.Duration // timeline resolution

	// throughput
	rounds  int
	wrkDur  time.Duration
	wrkWarm time.Duration
	gap     time.Duration

	// memory
	keys     int
	memBound time.Duration

	pause time.Duration // between runs
}

var modes = map[string]params{
	"quick": {
		work: 2 * time.Millisecond, users: 100, userRate: 2, floodRate: 2000, floodConns: 1000,
		timeout: 2 * time.Second, noisyRounds: 1, warm: 4 * time.Second, flood: 8 * time.Second, bucket: 500 * time.Millisecond,
		rounds: 1, wrkDur: 3 * time.Second, wrkWarm: 1 * time.Second, gap: 500 * time.Millisecond,
		keys: 100_000, memBound: 60 * time.Second,
		pause: time.Second,
	},
	"full": {
		work: 2 * time.Millisecond, users: 100, userRate: 2, floodRate: 2000, floodConns: 1000,
		timeout: 2 * time.Second, noisyRounds: 5, warm: 5 * time.Second, flood: 12 * time.Second, bucket: time.Second,
		rounds: 5, wrkDur: 5 * time.Second, wrkWarm: 2 * time.Second, gap: time.Second,
		keys: 1_000_000, memBound: 180 * time.Second,
		pause: 2 * time.Second,
	},
}

type env struct {
	mode     string
	p        params
	tmp      string
	bin      string
	out      string
	caddyBin string
	peerBin  string
	redis    *redisServer
	backend  *backendInst
	rows     []string // the throughput configurations to run; nil for all
}

func main() {
	mode := flag.String("mode", "quick", "quick (under 2 minutes) or full (under 10)")
	bin := flag.String("bin", "bin", "directory with caddy, caddy-peer and backend")
	out := flag.String("out", "results", "where to write README.md, results.json and the PNGs")
	only := flag.String("only", "noisy,throughput,memory", "phases to run, comma-separated")
	note := flag.String("note", "", "a note on the run for the results (e.g. that the machine was shared)")
	keep := flag.Bool("keep", false, "keep the temporary directory (configs, logs, raw latencies) for debugging")
	rows := flag.String("rows", "", "throughput: only these configurations (comma-separated keys, e.g. local-ten-keys,redis-share-ten-keys), besides the baselines")
	flag.Parse()
	log.SetFlags(log.Ltime)

	p, ok := modes[*mode]
	if !ok {
		log.Fatalf("unknown mode %q: expected quick or full", *mode)
	}
	e := &env{mode: *mode, p: p, bin: *bin, out: *out,
		caddyBin: filepath.Join(*bin, "caddy"), peerBin: filepath.Join(*bin, "caddy-peer")}
	if *rows != "" {
		e.rows = strings.Split(*rows, ",")
	}

	code := 0
	defer func() { os.Exit(code) }()

	var err error
	if e.tmp, err = os.MkdirTemp("", "rate-limit-bench-"); err != nil {
		log.Print(err)
		code = 1
		return
	}
	cleanup := func() {
		stopAll()
		if *keep {
			log.Printf("kept %s", e.tmp)
		} else {
			os.RemoveAll(e.tmp)
		}
	}
	defer cleanup()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	go func() {
		s := <-sig
		log.Printf("%v: stopping everything the benchmark started", s)
		cleanup()
		os.Exit(130)
	}()

	if err := e.run(strings.Split(*only, ","), *note); err != nil {
		log.Printf("FAILED: %v", err)
		code = 1
	}
}

func (e *env) run(phases []string, note string) error {
	for _, f := range []string{e.caddyBin, e.peerBin, filepath.Join(e.bin, "backend")} {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("%v (run bench/run.sh, which builds it)", err)
		}
	}
	for _, tool := range []string{redistest.ServerBin(), "wrk"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found: apt-get install redis-server wrk", tool)
		}
	}
	if err := mkdir(e.out); err != nil {
		return err
	}
	began := time.Now()
	rep := &report{Mode: e.mode, Note: note, Began: began.UTC(), Params: e.p}
	rep.Machine = e.machine()
	log.Printf("%s run on %d cores (%s), load average %s", e.mode, rep.Machine.Cores, rep.Machine.CPU, rep.Machine.LoadBefore)

	var err error
	if e.redis, err = startRedis(e.tmp); err != nil {
		return err
	}
	rep.Machine.Redis = e.redis.version
	total := meter()

	want := func(phase string) bool {
		for _, p := range phases {
			if strings.TrimSpace(p) == phase {
				return true
			}
		}
		return false
	}
	if want("noisy") {
		log.Printf("noisy neighbour: %d users x %d r/s, flood %d r/s from %v for %v; backend %v CPU per request",
			e.p.users, e.p.userRate, e.p.floodRate, e.p.warm, e.p.flood, e.p.work)
		if e.backend, err = e.startBackend(); err != nil {
			return err
		}
		if bs, err := e.backend.stats(); err == nil {
			rep.Backend = bs
		}
		t := time.Now()
		if rep.Noisy, err = e.runNoisy(); err != nil {
			return err
		}
		rep.NoisySeconds = time.Since(t).Seconds()
		e.backend.proc.stop(3 * time.Second)
	}
	if want("throughput") {
		log.Printf("throughput: wrk -t1 -c50 -d%v, %d round(s)", e.p.wrkDur, e.p.rounds)
		t := time.Now()
		if rep.Throughput, rep.RedisRate, rep.ThroughputNoise, err = e.runThroughput(); err != nil {
			return err
		}
		rep.ThroughputSeconds = time.Since(t).Seconds()
	}
	if want("memory") {
		log.Printf("memory: %d distinct keys", e.p.keys)
		t := time.Now()
		if rep.Memory, rep.MemoryNoise, err = e.runMemory(); err != nil {
			return err
		}
		rep.MemorySeconds = time.Since(t).Seconds()
	}
	rep.Noise = total.since()
	rep.Machine.LoadAfter = loadavg()
	rep.Seconds = time.Since(began).Seconds()

	if err := rep.write(e.out); err != nil {
		return err
	}
	log.Printf("done in %.0fs: %s", rep.Seconds, filepath.Join(e.out, "README.md"))
	return nil
}

func mkdir(dir string) error { return os.MkdirAll(dir, 0o755) }
