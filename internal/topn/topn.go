// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package topn finds the keys seen most often in a stream, in fixed
// memory. It knows nothing of what the keys are.
package topn

import (
	"cmp"
	"slices"
	"sync"
)

// A Sketch finds the keys added most, in fixed memory: the Space-Saving
// algorithm (Metwally et al., 2005). Any key added more than 1/size of
// all additions is sure to be in it; each count is an upper bound, too
// high by at most its Err. It is safe for concurrent use.
type Sketch[K comparable] struct {
	mu    sync.Mutex
	slots []Counted[K]
	index map[K]int // key → its slot
	keep  func(K) K
}

// A Counted is a key in the sketch, with its count.
type Counted[K comparable] struct {
	Key   K
	Count uint64
	Err   uint64
}

// New is an empty sketch of size keys. keep, if not nil, makes the copy
// of a key that the sketch keeps when the key enters it (so that it does
// not keep a caller's memory alive).
func New[K comparable](size int, keep func(K) K) *Sketch[K] {
	return &Sketch[K]{slots: make([]Counted[K], 0, size), index: make(map[K]int, size), keep: keep}
}

// Add counts one more of k.
func (t *Sketch[K]) Add(k K) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if i, ok := t.index[k]; ok {
		t.slots[i].Count++
		return
	}
	if t.keep != nil {
		k = t.keep(k)
	}
	if len(t.slots) < cap(t.slots) {
		t.index[k] = len(t.slots)
		t.slots = append(t.slots, Counted[K]{Key: k, Count: 1})
		return
	}
	// Replace the least counted key; the newcomer may have had its count.
	least := 0
	for i := range t.slots {
		if t.slots[i].Count < t.slots[least].Count {
			least = i
		}
	}
	old := t.slots[least]
	delete(t.index, old.Key)
	t.index[k] = least
	t.slots[least] = Counted[K]{Key: k, Count: old.Count + 1, Err: old.Count}
}

// List returns the tracked keys, most counted first.
func (t *Sketch[K]) List() []Counted[K] {
	t.mu.Lock()
	out := append([]Counted[K](nil), t.slots...)
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b Counted[K]) int { return cmp.Compare(b.Count, a.Count) })
	return out
}
