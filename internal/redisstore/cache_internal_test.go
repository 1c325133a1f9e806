// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// When a request gives up waiting for the calls in flight for its bucket,
// the floor that fail_mode local decides it by counts their tokens, up to
// what the bucket may owe: for the longest ban, the calls' costs on top
// of it would pass a time.Duration.
func TestLongestBanFloor(t *testing.T) {
	r := redistest.Start(t)
	l := gcra.NewLimit(1/(876000*time.Hour).Seconds(), 1)
	l.Ban = 876000 * time.Hour
	s := Open(t, OpenClient(t, r.Addr()), []store.ZoneSpec{Bucket("longest-floor", l)}, Options{})
	for i, want := range []bool{true, false} { // the second bans
		if got := takeKey(t, s, "static", l); got != want {
			t.Fatalf("request %d: allowed %v, want %v", i, got, want)
		}
	}
	b := TakeOf(0, "static", l).Buckets[0]
	k := flightKey{zone: 0, hash: s.zones[0].cache.Hash(b.Key)}
	s.flights.join(k, 10)
	s.flights.join(k, 10)
	if got, most := s.Known(time.Now(), &b, errNoAnswer), l.Most(); got != most {
		t.Fatalf("floor %v, want %v: all the bucket may owe", got, most)
	}
}

// Calls in flight for a bucket: no more than it may let through at once
// join, the others wait until one lands; and a request that gave up
// waiting counts their costs, as they may yet take their tokens.
func TestFlights(t *testing.T) {
	fs := &flights{m: make(map[flightKey]flight)}
	k := flightKey{zone: 1, hash: 7}
	if fs.join(k, 2) != nil || fs.join(k, 2) != nil {
		t.Fatal("a call of two that may fly waits")
	}
	landed := fs.join(k, 2)
	if landed == nil || !fs.waited(k) || fs.calls(k) != 2 {
		t.Fatalf("a third call of two joined: %d in flight", fs.calls(k))
	}
	fs.land(k)
	select {
	case <-landed:
	default:
		t.Fatal("a landing did not wake the call that waited")
	}
	if fs.waited(k) || fs.calls(k) != 1 {
		t.Fatalf("after a landing: waited %v, %d in flight", fs.waited(k), fs.calls(k))
	}
	fs.land(k)
	fs.land(noFlight) // a request without a bucket flies for none
	if len(fs.m) != 0 {
		t.Fatalf("%d buckets in flight after every call landed", len(fs.m))
	}
}
