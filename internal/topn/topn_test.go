// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package topn_test

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/topn"
)

// The sketch finds the keys added most under a skewed load, and its
// memory does not grow with the number of distinct keys.
func TestSketch(t *testing.T) {
	const size = 64
	top := topn.New[string](size, strings.Clone)
	r := rand.New(rand.NewPCG(1, 2))
	heavy := []string{"heavy-1", "heavy-2", "heavy-3"}
	// The heap is the process's: what earlier tests left running
	// (servers shutting down, stores' background work) may grow it while
	// a round runs. A sketch that grows does so in every round after the
	// first, so the least growth of three rounds is the sketch's.
	var before, after runtime.MemStats
	least := ^uint64(0)
	for round := range 4 {
		runtime.GC()
		runtime.ReadMemStats(&before)
		for i := range 200_000 {
			switch {
			case i%10 < 3: // 30% of additions from three keys
				top.Add(heavy[i%10])
			default: // the rest from 100k others, rarely the same twice
				top.Add(fmt.Sprintf("light-%d-%d", round, r.IntN(100_000)))
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		if round > 0 {
			least = min(least, after.HeapAlloc-min(before.HeapAlloc, after.HeapAlloc))
		}
	}
	if least > 64<<10 {
		t.Fatalf("the sketch grew by %d bytes on 200k more additions", least)
	}
	list := top.List()
	if len(list) != size {
		t.Fatalf("tracking %d keys, want %d", len(list), size)
	}
	for i, want := range heavy {
		got := list[i]
		if !strings.HasPrefix(got.Key, "heavy-") || got.Count-got.Err < 4*20_000-1000 {
			t.Fatalf("rank %d: %s with %d (±%d), want %s near 80000", i, got.Key, got.Count, got.Err, want)
		}
	}
}
