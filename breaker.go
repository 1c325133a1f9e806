// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"sync/atomic"
	"time"
)

// breaker stops a store from waiting on a Redis that is down: after
// tripAfter failures in a row it opens, and requests are decided by
// fail_mode at once. Once the backoff has passed, one request at a time
// probes Redis; the first success closes it.
type breaker struct {
	failures  atomic.Int32
	openUntil atomic.Int64 // monotonic nanoseconds; 0 while closed
	backoff   atomic.Int64
	probing   atomic.Bool
}

const (
	tripAfter  = 3
	minBackoff = 100 * time.Millisecond
	maxBackoff = time.Second
)

// processStart anchors the breaker's monotonic instants.
var processStart = time.Now()

func (b *breaker) allow(now time.Time) bool {
	until := b.openUntil.Load()
	if until == 0 {
		return true
	}
	if int64(now.Sub(processStart)) < until {
		return false
	}
	return b.probing.CompareAndSwap(false, true)
}

// success reports whether it closed an open breaker.
func (b *breaker) success() bool {
	b.failures.Store(0)
	if b.openUntil.Load() == 0 {
		return false
	}
	b.backoff.Store(0)
	b.probing.Store(false)
	return b.openUntil.Swap(0) != 0
}

// failure reports whether it opened the breaker.
func (b *breaker) failure(now time.Time) bool {
	mono := int64(now.Sub(processStart))
	if b.openUntil.Load() != 0 {
		// A probe failed: wait longer before the next.
		d := min(2*b.backoff.Load(), int64(maxBackoff))
		b.backoff.Store(d)
		b.openUntil.Store(mono + d)
		b.probing.Store(false)
		return false
	}
	if b.failures.Add(1) < tripAfter {
		return false
	}
	b.backoff.Store(int64(minBackoff))
	return b.openUntil.CompareAndSwap(0, mono+int64(minBackoff))
}
