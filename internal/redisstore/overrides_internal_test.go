// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// countsNone reports whether the store's count of a zone's overrides is
// none, and fresh enough for a decision to skip reading them.
func countsNone(s *Store, zone int) bool {
	c := s.zones[zone].overridden.Load()
	return c.n == 0 && time.Since(processStart).Nanoseconds()-c.at <= int64(overridePoll)
}

// An instance that was idle while another set a key's own limit decides
// the key's next request by it: the count of the zone's overrides it
// had, none, is too old to skip reading it. A zone with requests all the
// time keeps its count fresh, and its decisions read no override.
func TestOverrideReachesIdleInstance(t *testing.T) {
	r := redistest.Start(t)
	l := PerMinute(2)
	zones := []store.ZoneSpec{Bucket("ov-idle", l)}
	idle := Open(t, OpenClient(t, r.Addr()), zones, Options{KeyPrefix: "t:", CallTimeout: 2 * time.Second})
	other := Open(t, OpenClient(t, r.Addr()), zones, Options{KeyPrefix: "t:"})
	// countedNone waits until s's count is in: none. Its requests ask
	// Redis, each for a key of its own.
	countedNone := func(s *Store) {
		t.Helper()
		for i, start := 0, time.Now(); !countsNone(s, 0); i++ {
			takeKey(t, s, "203.0.113."+strconv.Itoa(i%250), l)
			if time.Since(start) > time.Second {
				t.Fatal("the zone's count of overrides is not in after a second")
			}
			time.Sleep(time.Millisecond)
		}
	}
	const ip = "198.51.100.50"
	for i, want := range []bool{true, true, false} {
		if got := takeKey(t, idle, ip, l); got != want {
			t.Fatalf("request %d: allowed %v, want %v", i, got, want)
		}
	}
	countedNone(idle)
	if err := other.SetOverride(context.Background(), time.Now(), 0, store.Key{Text: ip}, store.Override{TokenTime: time.Minute, Burst: 10, Rate: "1r/m"}); err != nil {
		t.Fatal(err)
	}
	// Past what its over-limit cache and its count of overrides are
	// trusted for, the idle instance's first request is decided by the
	// key's own limit.
	time.Sleep(overLimitTrust + overridePoll)
	d := TakeOf(0, ip, l)
	if ok, err := idle.Take(context.Background(), time.Now(), d); !ok || err != nil || d.Buckets[0].Limit.Burst != 10 {
		t.Fatalf("the idle instance's first request after the key's burst was raised to 10: %v, %v, burst %d; want allowed, 10",
			ok, err, d.Buckets[0].Limit.Burst)
	}

	// A zone with requests all the time and no override: once counted,
	// its count stays fresh, and no decision reads an override.
	fast := gcra.NewLimit(1000, 10000)
	busy := Open(t, OpenClient(t, r.Addr()), []store.ZoneSpec{Bucket("ov-busy", fast)}, Options{KeyPrefix: "t:"})
	countedNone(busy)
	for start := time.Now(); time.Since(start) < 4*overridePoll; time.Sleep(5 * time.Millisecond) {
		if !countsNone(busy, 0) {
			t.Fatalf("%v into a zone's requests, a decision would read an override: its count is stale", time.Since(start))
		}
		if !takeKey(t, busy, "198.51.100.51", fast) {
			t.Fatal("a request of the busy zone: refused")
		}
	}
}
