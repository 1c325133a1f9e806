// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package adaptive

import (
	"testing"
	"time"
)

// Classes on simulated latencies (see adaptive_internal_test.go for the
// simulation): what a reserve keeps for its class under a flood, and what
// an unused reserve must not do to the limit.

// TestAdaptiveClassesAdmit: a class is admitted while the requests in
// flight, whatever their class, are fewer than its part of the limit,
// rounded down and at least one; each class's requests in flight are
// counted, and given back with their tickets.
func TestAdaptiveClassesAdmit(t *testing.T) {
	t.Parallel()                             // state of its own, on virtual time
	tb := NewTable[string](10, 10, 0.2, 0.3) // parts: 10, 8, 5
	k := tb.Key("a", time.Unix(0, 0))
	now := time.Unix(1, 0)
	var tks []Ticket
	admit := func(class, want int) {
		t.Helper()
		n := 0
		for {
			tk, ok := k.Admit(now, class)
			if !ok {
				break
			}
			tks = append(tks, tk)
			n++
		}
		if n != want {
			t.Fatalf("class %d: %d admitted, want %d", class, n, want)
		}
	}
	admit(2, 5) // the lowest, and a class beyond the table's is the lowest
	admit(7, 0)
	admit(1, 3)
	admit(0, 2)
	if got := k.InFlightByClass(nil); len(got) != 3 || got[0] != 2 || got[1] != 3 || got[2] != 5 {
		t.Errorf("in flight by class %v, want [2 3 5]", got)
	}
	k.Forget()
	for _, tk := range tks[:4] { // four of the lowest class
		k.Release(now, tk, SampleNone, 0)
	}
	if got, st := k.InFlightByClass(nil), k.State(); got[2] != 1 || st.InFlight != 6 {
		t.Errorf("after four of the lowest class came back: %v, %d in flight; want [2 3 1], 6", got, st.InFlight)
	}
	if got := NewTable[string](4, 4).Key("a", now).InFlightByClass(nil); got != nil {
		t.Errorf("without classes: %v, want nil", got)
	}
	// Rounding down, but at least one: 4 less 80% is 0.8 of a request.
	k = NewTable[string](4, 4, 0.8).Key("a", now)
	if _, ok := k.Admit(now, 1); !ok {
		t.Error("the lowest class refused with nothing in flight")
	}
	if _, ok := k.Admit(now, 1); ok {
		t.Error("the lowest class admitted beyond one request, its part of 4 less 80%")
	}
}

// classFlood is the scenario: 64 closed-loop clients of the
// lowest class flood 8 workers of 20ms (400/s), while 4 clients of the
// highest class each send a request 60ms after the last answer.
func classFlood(reserves ...float64) simConfig {
	return simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(64), length: time.Minute,
		reserves: reserves, groups: []simGroup{{clients: 4, class: 0, think: 60 * simMs}}}
}

// TestAdaptiveClassesKeepTheReserve: under the flood, a reserve of 25%
// for the highest class keeps its requests from being shed (at most 5%)
// and their p95 under 100ms, while the upstream stays busy; without
// classes, the same clients are shed like the rest.
func TestAdaptiveClassesKeepTheReserve(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	const from, to = 5 * time.Second, time.Minute
	measure := func(r simResult, critical int) (shed, floodShed float64, p95 time.Duration, goodput float64) {
		lat, n := r.ofClass(0, from, to)
		flat, fn := r.ofClass(critical, from, to)
		return float64(n) / float64(n+len(lat)), float64(fn) / float64(fn+len(flat)), simQuantile(lat, .95),
			float64(len(lat)+len(flat)) / (to - from).Seconds() / 400
	}
	for seed := range uint64(3) {
		cfg := classFlood(0.25)
		cfg.seed = seed
		r := simulate(cfg)
		shed, floodShed, p95, goodput := measure(r, 1)
		lo, hi := r.limitRange(from, to)
		t.Logf("seed %d, reserve 25%%: critical shed %.1f%%, p95 %v; the flood shed %.1f%%; goodput %.2f; limit %d-%d",
			seed, 100*shed, p95, 100*floodShed, goodput, lo, hi)
		if shed > 0.05 || p95 > 100*simMs || goodput < 0.9 {
			t.Errorf("seed %d: critical shed %.1f%% (want ≤ 5%%), p95 %v (< 100ms), goodput %.2f (≥ 0.9)", seed, 100*shed, p95, goodput)
		}

		cfg = classFlood()
		cfg.seed = seed
		shed, floodShed, _, _ = measure(simulate(cfg), 0)
		t.Logf("seed %d, without classes: the same clients shed %.1f%%, the flood %.1f%%", seed, 100*shed, 100*floodShed)
		if shed < 0.5 {
			t.Errorf("seed %d: without classes, the critical clients shed %.1f%%: want them shed like the flood (%.1f%%)", seed, 100*shed, 100*floodShed)
		}
	}
}

// TestAdaptiveClassesUnusedReserve: a reserve that no request uses must
// not hold the limit down. Counted against the whole limit, "at least
// half of it in use" is never true of a lowest class that may use 40% of
// it: the limit stayed at min, and the upstream nearly idle. Counted
// against the part of the lowest class present, the lowest class alone
// keeps the upstream as busy as a zone without classes does, and so it
// does beside a class that uses little of its large reserve. Idle
// traffic still does not inflate the limit beyond twice what it uses, in
// the lowest class's part.
func TestAdaptiveClassesUnusedReserve(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	const from, to = 5 * time.Second, time.Minute
	measure := func(r simResult) (goodput float64, p50 time.Duration) {
		lat := r.between(from, to)
		return float64(len(lat)) / (to - from).Seconds() / 400, simQuantile(lat, .5)
	}
	base := simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(64), length: to}
	goodput, p50 := measure(simulate(base))
	for _, tc := range []struct {
		name     string
		reserves []float64
		clients  int // of the lowest class
		groups   []simGroup
	}{
		{"the lowest class alone, 60% reserved", []float64{0.2, 0.4}, 64, nil},
		{"the lowest class alone, 90% reserved", []float64{0.9}, 64, nil},
		{"beside a class that uses little of its 80%", []float64{0.8}, 64, []simGroup{{clients: 1, class: 0, think: 200 * simMs}}},
		{"the highest class floods, the lowest trickles", []float64{0.5}, 1, []simGroup{{clients: 64, class: 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			cfg.reserves, cfg.clients, cfg.groups = tc.reserves, constClients(tc.clients), tc.groups
			r := simulate(cfg)
			g, p := measure(r)
			lo, hi := r.limitRange(from, to)
			t.Logf("goodput %.2f, p50 %v (%.2f, %v without classes); limit %d-%d", g, p, goodput, p50, lo, hi)
			if g < 0.9 || g < goodput-0.05 || p > p50*5/4 {
				t.Errorf("goodput %.2f, p50 %v: want ≥ 0.9 and within 0.05 of a zone without classes (%.2f), p50 at most a quarter above its %v",
					g, p, goodput, p50)
			}
		})
	}
	t.Run("idle traffic", func(t *testing.T) {
		// 4 clients of the lowest class, each waiting 100ms after an
		// answer: never more than 4 in flight, of a class that may use
		// half of the limit. Its part rises as a limit without classes
		// does under the same clients; the limit, to twice that.
		idle := simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(0), length: to,
			groups: []simGroup{{clients: 4, class: 0, think: 100 * simMs}}}
		_, plain := simulate(idle).limitRange(from, to)
		idle.reserves, idle.groups[0].class = []float64{0.5}, 1
		_, hi := simulate(idle).limitRange(from, to)
		t.Logf("limit up to %d, %d without classes", hi, plain)
		if hi > 2*(plain+1) {
			t.Errorf("limit up to %d with 4 clients of a class that may use half of it: want at most twice that without classes, %d, and a step", hi, plain)
		}
	})
}

// TestAdaptiveClassesProbe: a probe halves what the requests in flight
// used, in each class's part: the lowest class alone, which may use half
// the limit, is held to half of what it had in flight, not to half of
// half (the half of its mean in flight, taken as a limit, and then its
// part of that).
func TestAdaptiveClassesProbe(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	c := newController(4, 40, NewTable[int](4, 40, 0.5).shares)
	now := time.Unix(0, 0)
	last := 0
	for range 10_000 {
		tks := admitAll(&c, now, 1)
		if c.probing {
			t.Logf("%d admitted in the probe, %d before; limit %v", len(tks), last, c.limit)
			if last < 8 || 2*len(tks) < last || 2*len(tks) > last+1 {
				t.Errorf("%d admitted in the probe, %d before: want half as many (and 8 before at least)", len(tks), last)
			}
			return
		}
		last = len(tks)
		now = now.Add(20 * simMs)
		for _, tk := range tks {
			c.done(now, tk, SampleOK, 20*simMs)
		}
	}
	t.Fatal("no probe")
}
