// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// topKeys finds the keys a zone denies most, in fixed memory: the
// Space-Saving algorithm (Metwally et al., 2005). Any key denied more than
// 1/size of all denials is sure to be in it; each count is an upper bound,
// too high by at most its err.
type topKeys struct {
	mu    sync.Mutex
	slots []topKey
	index map[bucketKey]int // key → its slot
}

type topKey struct {
	key   bucketKey
	count uint64
	err   uint64
}

// topKeyMax bounds the bytes of a key the sketch keeps: a longer key is
// kept as its first bytes and a hash of the whole.
const topKeyMax = 128

func newTopKeys(size int) *topKeys {
	return &topKeys{slots: make([]topKey, 0, size), index: make(map[bucketKey]int, size)}
}

func (t *topKeys) add(k bucketKey) {
	if len(k.s) > topKeyMax {
		h := fnv.New64a()
		h.Write([]byte(k.s))
		k.s = k.s[:topKeyMax-20] + "…" + strconv.FormatUint(h.Sum64(), 16)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if i, ok := t.index[k]; ok {
		t.slots[i].count++
		return
	}
	k.s = strings.Clone(k.s) // don't keep a request's memory alive
	if len(t.slots) < cap(t.slots) {
		t.index[k] = len(t.slots)
		t.slots = append(t.slots, topKey{key: k, count: 1})
		return
	}
	// Replace the least counted key; the newcomer may have had its count.
	least := 0
	for i := range t.slots {
		if t.slots[i].count < t.slots[least].count {
			least = i
		}
	}
	old := t.slots[least]
	delete(t.index, old.key)
	t.index[k] = least
	t.slots[least] = topKey{key: k, count: old.count + 1, err: old.count}
}

// list returns the tracked keys, most denied first.
func (t *topKeys) list() []topKey {
	t.mu.Lock()
	out := append([]topKey(nil), t.slots...)
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b topKey) int { return cmp.Compare(b.count, a.count) })
	return out
}
