// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"sync"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

func TestSlotTable(t *testing.T) {
	tb := NewSlotTable(2)
	a, b, c := store.Key{Text: "a"}, store.Key{Text: "b"}, store.Key{Text: "c"}
	for i, want := range []int64{1, 0} {
		free, ok := tb.acquire(a, 2)
		if !ok || free != want {
			t.Fatalf("acquire %d: free %d ok %v, want %d true", i, free, ok, want)
		}
	}
	if _, ok := tb.acquire(a, 2); ok {
		t.Fatal("third slot of two taken")
	}
	if _, ok := tb.acquire(b, 2); !ok {
		t.Fatal("key b refused")
	}
	// Two keys are in flight: a third key is refused (max_keys 2).
	if _, ok := tb.acquire(c, 2); ok {
		t.Fatal("key c taken beyond max_keys 2")
	}
	if got := tb.Len(); got != 2 {
		t.Fatalf("len %d, want 2", got)
	}
	tb.release(b)
	if got := tb.Len(); got != 1 {
		t.Fatalf("after b's only slot came back: len %d, want 1 (the entry is deleted)", got)
	}
	if _, ok := tb.acquire(c, 2); !ok {
		t.Fatal("key c refused with room in the table")
	}
	tb.release(a)
	if got := tb.free(a, 2); got != 1 {
		t.Fatalf("free %d, want 1", got)
	}
	tb.release(a)
	tb.release(a) // one release too many changes nothing
	tb.release(c)
	if got := tb.Len(); got != 0 {
		t.Fatalf("len %d, want 0 with nothing in flight", got)
	}
}

// TestSlotTableConcurrent never lets more than n of many goroutines hold
// a slot of one key.
func TestSlotTableConcurrent(t *testing.T) {
	tb := NewSlotTable(10)
	k := store.Key{Text: "k"}
	const n = 3
	var mu sync.Mutex
	in, most := 0, 0
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 500 {
				if _, ok := tb.acquire(k, n); !ok {
					continue
				}
				mu.Lock()
				in++
				most = max(most, in)
				mu.Unlock()
				mu.Lock()
				in--
				mu.Unlock()
				tb.release(k)
			}
		})
	}
	wg.Wait()
	if most > n || most == 0 {
		t.Fatalf("at most %d in flight, want 1 to %d", most, n)
	}
	if tb.Len() != 0 {
		t.Fatalf("len %d after all returned", tb.Len())
	}
}
