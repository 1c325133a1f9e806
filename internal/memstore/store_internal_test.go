// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package memstore

import (
	"testing"
	"time"

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
