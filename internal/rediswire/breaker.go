// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"sync/atomic"
	"time"
)

// A breaker stops a store from waiting on a Redis that is down: after
// tripAfter outages in a row it opens, and requests are decided by
// fail_mode at once, none of them sent to Redis. While it is open, the
// client probes Redis in the background (see (*Client).probe), and the
// first probe that Redis answers closes it: a recovered Redis is noticed
// without a request paying for it, and no request is decided by the
// fallback from then on. On a Redis Cluster there is one for all the
// masters: outages of any count, and a probe answers for the cluster
// only when every master answers.
type breaker struct {
	failures atomic.Int32 // outages in a row, while closed
	opened   atomic.Bool
}

// The breaker opens after tripAfter outages in a row; the probes of an
// open breaker come after a backoff that doubles from minBackoff to
// maxBackoff.
const (
	tripAfter  = 3
	minBackoff = 100 * time.Millisecond
	maxBackoff = 500 * time.Millisecond
)

// open reports whether the breaker is open.
func (b *breaker) open() bool { return b.opened.Load() }

// success records that Redis answered. It reports whether that closed the
// breaker. Any answer closes it, a call's that started before the breaker
// opened too: it came back after, so Redis answers now.
func (b *breaker) success() bool {
	b.failures.Store(0)
	return b.opened.Load() && b.opened.CompareAndSwap(true, false)
}

// answered records that one of several Redis servers answered (a
// master of a cluster): outages are no longer in a row, but an open
// breaker stays open, as another may still be down.
func (b *breaker) answered() { b.failures.Store(0) }

// trip opens the breaker at once: Redis answered that no call can
// succeed. It reports whether that opened it.
func (b *breaker) trip() bool { return b.opened.CompareAndSwap(false, true) }

// outage records that Redis did not answer, or answered that it cannot
// serve. It reports whether that opened the breaker. An outage of a call
// made before the breaker opened changes nothing once it is open.
func (b *breaker) outage() bool {
	if b.opened.Load() {
		return false
	}
	if b.failures.Add(1) < tripAfter {
		return false
	}
	return b.opened.CompareAndSwap(false, true)
}
