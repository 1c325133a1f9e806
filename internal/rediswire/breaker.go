// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"sync/atomic"
	"time"
)

// Breaker stops a store from waiting on a Redis that is down: after
// TripAfter outages in a row it opens, and requests are decided by
// fail_mode at once. Once the backoff has passed, one request at a time
// probes Redis; the first success closes it.
//
// A call that Allow lets through is either an ordinary call (the breaker
// is closed) or the probe. Every way out of a call reports to the
// breaker: success, outage, or done (the call ended without saying
// anything of Redis: the client went away, or the error was the key's).
// A probe that is not reported would leave the breaker open for good.
type Breaker struct {
	failures  atomic.Int32 // outages in a row, while closed
	openUntil atomic.Int64 // monotonic nanoseconds; 0 while closed
	backoff   atomic.Int64
	probing   atomic.Bool
}

// The breaker opens after TripAfter outages in a row, and probes after a
// backoff that doubles from MinBackoff to MaxBackoff.
const (
	TripAfter  = 3
	MinBackoff = 100 * time.Millisecond
	MaxBackoff = time.Second
)

// start anchors the breaker's monotonic instants.
var start = time.Now()

// Allow reports whether a call may go to Redis, and whether that call is
// the probe of an open breaker.
func (b *Breaker) Allow(now time.Time) (ok, probe bool) {
	until := b.openUntil.Load()
	if until == 0 {
		return true, false
	}
	if int64(now.Sub(start)) < until {
		return false, false
	}
	if b.probing.CompareAndSwap(false, true) {
		return true, true
	}
	return false, false
}

// Success records that Redis answered. It reports whether that closed
// the breaker. Any answer closes it, a call's that started before the
// breaker opened too: it came back after, so Redis answers now (after a
// DEBUG SLEEP, say, the calls queued in Redis answer at once, where the
// next probe might be a backoff away).
func (b *Breaker) Success(probe bool) bool {
	b.failures.Store(0)
	if b.openUntil.Load() == 0 {
		return false
	}
	closed := b.openUntil.Swap(0) != 0
	b.backoff.Store(0)
	if probe || closed {
		b.probing.Store(false)
	}
	return closed
}

// Outage records that Redis did not answer, or answered that it cannot
// serve. It reports whether that opened the breaker.
func (b *Breaker) Outage(now time.Time, probe bool) bool {
	mono := int64(now.Sub(start))
	if b.openUntil.Load() != 0 {
		if probe {
			// The probe failed: wait longer before the next.
			d := min(max(2*b.backoff.Load(), int64(MinBackoff)), int64(MaxBackoff))
			b.backoff.Store(d)
			b.openUntil.Store(mono + d)
			b.probing.Store(false)
		}
		return false // else a call from before the breaker opened
	}
	b.Done(probe)
	if b.failures.Add(1) < TripAfter {
		return false
	}
	b.backoff.Store(int64(MinBackoff))
	return b.openUntil.CompareAndSwap(0, mono+int64(MinBackoff))
}

// Done ends a call that says nothing of Redis's health: a probe's turn
// passes to the next request.
func (b *Breaker) Done(probe bool) {
	if probe {
		b.probing.Store(false)
	}
}

// Open reports whether the breaker is open.
func (b *Breaker) Open() bool { return b.openUntil.Load() != 0 }
