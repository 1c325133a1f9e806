// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"slices"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// latStats summarizes latencies.
type latStats struct {
	N                  int
	P50, P95, P99, Max time.Duration
}

func summarize(ds []time.Duration) latStats {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return latStats{}
	}
	return latStats{N: len(s), P50: benchkit.Quantile(s, .50), P95: benchkit.Quantile(s, .95), P99: benchkit.Quantile(s, .99), Max: s[len(s)-1]}
}

// cpuMeter tells how much CPU the machine spent, and how much of it went
// to anything but the harness and its processes: the noise from others.
type cpuMeter struct {
	at          time.Time
	busy, total time.Duration
	ours        time.Duration
}

func meter() cpuMeter {
	busy, total := machineCPU()
	return cpuMeter{at: time.Now(), busy: busy, total: total, ours: childCPU() + selfCPU()}
}

// noise is what others used since m, as a share of the machine's CPU, and
// how busy the machine was as a whole.
type noise struct {
	Others float64 // share of all cores used by processes outside the benchmark
	Busy   float64 // share of all cores busy
}

func (m cpuMeter) since() noise {
	now := meter()
	total := float64(now.total - m.total)
	if total <= 0 {
		return noise{}
	}
	busy := float64(now.busy - m.busy)
	others := busy - float64(now.ours-m.ours)
	return noise{Others: max(others, 0) / total, Busy: busy / total}
}
