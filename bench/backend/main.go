// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command backend is the API behind Caddy in the noisy-neighbour
// benchmark: every request costs a fixed amount of CPU work, like a real
// handler, and at most -workers requests are worked on at once; the
// others wait in line (first come, first served), as in a server with a
// worker pool. A request whose client has gone while it waited is
// dropped without work.
//
// GET /_stats (asked directly, not through Caddy) returns the counters and
// the process's CPU time as JSON.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"
)

var (
	served    atomic.Int64
	abandoned atomic.Int64
	inflight  atomic.Int64
	sink      atomic.Uint64
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8090", "listen address")
	work := flag.Duration("work", 2*time.Millisecond, "CPU work per request, on an idle core")
	workers := flag.Int("workers", 2*runtime.NumCPU(), "requests worked on at once")
	flag.Parse()

	perIter := calibrate()
	iters := int(float64(*work) / perIter)
	log.Printf("backend: %v of work = %d iterations of %.2f ns; %d workers", *work, iters, perIter, *workers)

	sem := make(chan struct{}, *workers)
	mux := http.NewServeMux()
	mux.HandleFunc("/_stats", func(w http.ResponseWriter, r *http.Request) {
		var ru syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"served":     served.Load(),
			"abandoned":  abandoned.Load(),
			"inflight":   inflight.Load(),
			"cpu_ns":     ru.Utime.Nano() + ru.Stime.Nano(),
			"iterations": iters,
			"iter_ns":    perIter,
			"workers":    *workers,
		})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		inflight.Add(1)
		defer inflight.Add(-1)
		select {
		case sem <- struct{}{}:
		case <-r.Context().Done():
			abandoned.Add(1)
			return
		}
		sink.Add(burn(iters))
		<-sem
		served.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, "{\"user\":%q,\"ok\":true}\n", r.Header.Get("X-Api-Key"))
	})
	srv := &http.Server{Addr: *addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		log.Print(err)
		os.Exit(1)
	}
}

// burn does n rounds of integer mixing that the compiler cannot skip.
func burn(n int) uint64 {
	x := uint64(0x9e3779b97f4a7c15)
	for i := 0; i < n; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		x *= 0xbf58476d1ce4e5b9
	}
	return x
}

// calibrate measures the nanoseconds of one iteration of burn: the
// fastest of several tries, which is the closest to an idle core.
func calibrate() float64 {
	const n = 200_000
	best := time.Duration(1<<63 - 1)
	for range 15 {
		t := time.Now()
		sink.Add(burn(n))
		best = min(best, time.Since(t))
	}
	return max(float64(best)/n, 0.01)
}
