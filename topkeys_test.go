// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
)

// The sketch finds the keys denied most under a skewed load, and its
// memory does not grow with the number of distinct keys.
func TestTopKeys(t *testing.T) {
	top := newTopKeys(topKeysSize)
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
			case i%10 < 3: // 30% of denials from three keys
				top.add(bucketKey{s: heavy[i%10]})
			default: // the rest from 100k others, rarely the same twice
				top.add(bucketKey{s: fmt.Sprintf("light-%d-%d", round, r.IntN(100_000))})
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		if round > 0 {
			least = min(least, after.HeapAlloc-min(before.HeapAlloc, after.HeapAlloc))
		}
	}
	if least > 64<<10 {
		t.Fatalf("the sketch grew by %d bytes on 200k more denials", least)
	}
	list := top.list()
	if len(list) != topKeysSize {
		t.Fatalf("tracking %d keys, want %d", len(list), topKeysSize)
	}
	for i, want := range heavy {
		got := list[i]
		if !strings.HasPrefix(got.key.s, "heavy-") || got.count-got.err < 4*20_000-1000 {
			t.Fatalf("rank %d: %s with %d (±%d), want %s near 80000", i, got.key.s, got.count, got.err, want)
		}
	}

	// Long keys are kept short, and stay distinct.
	long := strings.Repeat("x", 1<<20)
	top = newTopKeys(4)
	top.add(bucketKey{s: long + "a"})
	top.add(bucketKey{s: long + "b"})
	top.add(bucketKey{s: long + "a"})
	list = top.list()
	if len(list) != 2 || list[0].count != 2 || len(list[0].key.s) > topKeyMax+8 {
		t.Fatalf("long keys: %d entries, first %d long with %d", len(list), len(list[0].key.s), list[0].count)
	}
}
