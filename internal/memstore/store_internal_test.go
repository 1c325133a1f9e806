// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/store/storetest"
)

// The in-memory engine decides the conformance suite's steps as every
// store must, on tables made as the local store module makes them. It
// decides by the instants it is given: the suite's clock is not its.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T, zones []store.ZoneSpec, _ func() time.Time) store.Store {
		ts := new(testTables)
		t.Cleanup(func() {
			if err := ts.Cleanup(); err != nil {
				t.Error(err)
			}
		})
		s, err := New(zones, ts)
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// A full quota table drops counters of ended windows first, then the
// smallest counts among those sampled, and keeps within max_keys.
func TestQuotaTable(t *testing.T) {
	ts := &testTables{maxKeys: 50}
	t.Cleanup(func() {
		if err := ts.Cleanup(); err != nil {
			t.Error(err)
		}
	})
	s, err := New([]store.ZoneSpec{{Name: "quota-table", Quota: "day@UTC"}}, ts)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	days := &calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}
	take := func(key string, n int) {
		for range n {
			reqs := &store.Demands{Counters: []store.CounterDemand{{Key: keyOf(key), Limit: 100, Cost: 1, Window: days.Window(now)}}}
			if ok, _ := s.Take(context.Background(), now, reqs); !ok {
				t.Fatalf("key %s refused", key)
			}
		}
	}
	take("heavy", 50)
	for i := range 200 {
		take(fmt.Sprint("once-", i), 1)
	}
	qt := s.zones[0].counters
	if n := qt.size(); n > 50 {
		t.Fatalf("%d counters kept, max_keys 50", n)
	}
	if used, _ := CountAt(qt, keyOf("heavy"), qt.Instant(now)); used != 50 {
		t.Fatalf("the heaviest counter was evicted: used %d", used)
	}
	// A counter of a window that has ended carries nothing.
	later := now.Add(25 * time.Hour)
	if used, _ := CountAt(qt, keyOf("heavy"), qt.Instant(later)); used != 0 {
		t.Fatalf("used %d in the next window", used)
	}
	qt.sweepAll(later)
	if n := qt.size(); n != 0 {
		t.Fatalf("%d counters left after their windows ended", n)
	}
}
