// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"hash/maphash"
	"sync"
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// SlotTable counts the requests in flight of each key of a zone with
// concurrency. A key is in it only while it has requests in flight, so
// its size is the number of keys with requests running, and it holds at
// most maxKeys of them: a key that would be one more is refused.
type SlotTable struct {
	seed    maphash.Seed
	keys    atomic.Int64 // keys in the table
	maxKeys atomic.Int64
	shards  [slotShards]slotShard
}

const slotShards = 64

type slotShard struct {
	mu sync.Mutex
	m  map[store.Key]int64
	_  [40]byte // keep shards on separate cache lines
}

func NewSlotTable(maxKeys int64) *SlotTable {
	t := &SlotTable{seed: maphash.MakeSeed()}
	t.maxKeys.Store(maxKeys)
	for i := range t.shards {
		t.shards[i].m = make(map[store.Key]int64)
	}
	return t
}

func (t *SlotTable) shard(k store.Key) *slotShard {
	return &t.shards[maphash.Comparable(t.seed, k)%slotShards]
}

// acquire takes one of n slots of key k. It reports whether it did, and
// how many slots are free after the decision.
func (t *SlotTable) acquire(k store.Key, n int64) (free int64, ok bool) {
	s := t.shard(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	c, held := s.m[k]
	if c >= n {
		return 0, false
	}
	if !held {
		if t.keys.Add(1) > t.maxKeys.Load() {
			t.keys.Add(-1)
			return 0, false
		}
	}
	s.m[k] = c + 1
	return n - c - 1, true
}

// free is how many of n slots of key k are free, changing nothing.
func (t *SlotTable) free(k store.Key, n int64) int64 {
	s := t.shard(k)
	s.mu.Lock()
	c := s.m[k]
	s.mu.Unlock()
	return max(n-c, 0)
}

// release gives back a slot of key k that acquire took.
func (t *SlotTable) release(k store.Key) {
	s := t.shard(k)
	s.mu.Lock()
	defer s.mu.Unlock()
	switch c := s.m[k]; {
	case c > 1:
		s.m[k] = c - 1
	case c == 1:
		delete(s.m, k)
		t.keys.Add(-1)
	}
}

// Len is the number of keys with requests in flight.
func (t *SlotTable) Len() int64 { return t.keys.Load() }

// Destruct is called when no config has the zone any more: a slot table
// holds nothing to close.
func (*SlotTable) Destruct() error { return nil }

// SetMaxKeys sets the most keys the table keeps.
func (t *SlotTable) SetMaxKeys(n int64) { t.maxKeys.Store(n) }
