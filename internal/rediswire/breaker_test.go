// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"testing"
	"time"
)

// Every way out of a call reports to the breaker, and every way out of
// the probe hands the next probe on: success closes the breaker, an
// outage backs off, and a call that says nothing of Redis (its client
// went away) lets the next request probe at once.
func TestBreakerProbeAlwaysEnds(t *testing.T) {
	var b Breaker
	now := time.Now()
	for i := range TripAfter {
		if ok, probe := b.Allow(now); !ok || probe {
			t.Fatalf("closed breaker, call %d: ok %t, probe %t; want an ordinary call", i, ok, probe)
		}
		if opened := b.Outage(now, false); opened != (i == TripAfter-1) {
			t.Fatalf("outage %d: opened %t", i+1, opened)
		}
	}
	if ok, _ := b.Allow(now); ok {
		t.Fatal("open breaker let a call through before its backoff")
	}
	// An outage from a call made before the breaker opened changes nothing.
	b.Outage(now, false)
	later := now.Add(MinBackoff)
	ok, probe := b.Allow(later)
	if !ok || !probe {
		t.Fatalf("after the backoff: ok %t, probe %t; want the probe", ok, probe)
	}
	if ok, _ := b.Allow(later); ok {
		t.Fatal("a second probe while the first is out")
	}
	// The probe's client went away: the next request probes.
	b.Done(true)
	if ok, probe := b.Allow(later); !ok || !probe {
		t.Fatalf("after an abandoned probe: ok %t, probe %t; want a new probe", ok, probe)
	}
	// The probe finds Redis down: the next probe waits twice as long.
	b.Outage(later, true)
	if ok, _ := b.Allow(later.Add(2*MinBackoff - time.Millisecond)); ok {
		t.Fatal("probe before the doubled backoff")
	}
	ok, probe = b.Allow(later.Add(2 * MinBackoff))
	if !ok || !probe {
		t.Fatal("no probe after the doubled backoff")
	}
	if closed := b.Success(true); !closed || b.Open() {
		t.Fatalf("successful probe: closed %t, open %t", closed, b.Open())
	}
	if ok, probe := b.Allow(later); !ok || probe {
		t.Fatalf("closed again: ok %t, probe %t; want an ordinary call", ok, probe)
	}
}
