// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/store/storetest"
)

// The Redis engine decides the conformance suite's steps as every store
// must: on one Redis without its over-limit cache (and with the steps of
// each instant sent as one flight, one script call), with it, and on a
// Redis Cluster of three masters, where a request's keys share a slot.
func TestConformance(t *testing.T) {
	r := redistest.Start(t)
	t.Run("no cache", func(t *testing.T) {
		storetest.Run(t, storesOn([]string{r.Addr()}, false), storetest.Flights(func(s store.Store, ds []*store.Demands) ([]bool, []error) {
			return s.(*redisstore.Store).RunAll(rediswire.Take, ds)
		}))
	})
	t.Run("over-limit cache", func(t *testing.T) {
		storetest.Run(t, storesOn([]string{r.Addr()}, true))
	})
	t.Run("cluster", func(t *testing.T) {
		nodes := redistest.StartCluster(t)
		storetest.Run(t, storesOn([]string{nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()}, false))
	})
}

// storesOn makes stores on the Redis at addrs (several: a cluster), with
// or without the over-limit cache, as the module makes them (its client's
// options, the scripts), on the suite's clock and under a key prefix of
// the test's own.
func storesOn(addrs []string, cache bool) storetest.NewStore {
	return func(t *testing.T, zones []store.ZoneSpec, clock func() time.Time) store.Store {
		// No zone of the suite has sync: the store makes no copies.
		return redisstore.Open(t, redisstore.OpenClient(t, addrs...), zones,
			redisstore.Options{FailMode: "local", DisableOverLimitCache: !cache, Clock: clock})
	}
}

// Clients that go away cancel their requests' contexts: that says nothing
// of Redis, and must not open the circuit breaker.
func TestCancelledRequestsKeepBreakerClosed(t *testing.T) {
	r := redistest.Start(t)
	l := gcra.NewLimit(1.0/60, 100)
	s := redisstore.Open(t, redisstore.OpenClient(t, r.Addr()), []store.ZoneSpec{redisstore.Bucket("cancel", l)}, redisstore.Options{})
	for range 6 { // twice the outages in a row that open it
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := s.Take(ctx, time.Now(), redisstore.TakeOf(0, "gone", l)); err == nil {
			t.Fatal("a cancelled request reached a decision")
		}
	}
	if s.Stats(0).Unavailable {
		t.Fatal("cancelled requests opened the circuit breaker")
	}
	if ok, err := s.Take(context.Background(), time.Now(), redisstore.TakeOf(0, "next", l)); !ok || err != nil {
		t.Fatalf("the next request: %v, %v", ok, err)
	}
	hash, field := s.BucketName(0, store.Key{Text: "next"})
	if r.CLI("HEXISTS", hash, field) != "1" {
		t.Fatal("the next request was not decided by Redis")
	}
}
