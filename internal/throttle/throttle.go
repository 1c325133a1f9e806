// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package throttle keeps repeated log lines to one per period: a store
// that fails, or a client that sends bad values, must not flood the logs.
package throttle

import (
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// start anchors the throttles' monotonic instants.
var start = time.Now()

// A Throttle lets through at most one event per period, and counts the
// events it holds back. The zero value is ready to use.
type Throttle struct {
	last atomic.Int64 // monotonic nanoseconds of the last event let through
	held atomic.Int64
}

// Allow reports whether an event may pass now, and how many were held
// back since the last that did.
func (t *Throttle) Allow(period time.Duration) (int64, bool) {
	held := t.held.Add(1)
	now, last := int64(time.Since(start)), t.last.Load()
	if last != 0 && now-last < int64(period) || !t.last.CompareAndSwap(last, now) {
		return 0, false
	}
	t.held.Add(-held)
	return held - 1, true
}

// Warn logs at WARN at most once a minute.
func (t *Throttle) Warn(logger *zap.Logger, msg string, err error) {
	if held, ok := t.Allow(time.Minute); ok {
		logger.Warn(msg, zap.Error(err), zap.Int64("more_since_last", held))
	}
}
