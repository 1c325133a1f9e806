// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"errors"

	"github.com/redis/go-redis/v9"
)

var (
	// ErrBadReply is a script reply that cannot be read: Redis answered,
	// so it says nothing of Redis's health.
	ErrBadReply = errors.New("redis script: bad reply")

	// ErrDown is returned while the circuit breaker is open.
	ErrDown = errors.New("redis is unavailable")
)

// A Kind is what a failed call says of Redis.
type Kind uint8

const (
	Outage   Kind = iota // Redis is unreachable, slow, or cannot serve
	Answered             // Redis answered, with an error about this call's keys
	Unknown              // the call never reached Redis: the client was closed, or its pool full
)

// outageReplies are the error replies that say Redis cannot serve at all:
// loading, failing over, read-only after a failover, out of memory, or
// refusing this client's credentials. Any other error reply belongs to
// the keys of one call (a wrong type, a slot error) and says that Redis
// is up.
var outageReplies = []string{
	"LOADING", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS",
	"OOM", "NOAUTH", "WRONGPASS", "NOPERM", "MISCONF",
}

// Classify says what kind of failure err is.
func Classify(err error) Kind {
	if errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return Unknown
	}
	if errors.Is(err, ErrBadReply) || errors.Is(err, ErrWindow) {
		return Answered
	}
	if reply, ok := errors.AsType[redis.Error](err); ok {
		for _, prefix := range outageReplies {
			if redis.HasErrorPrefix(reply, prefix) {
				return Outage
			}
		}
		return Answered
	}
	return Outage // dial errors, timeouts, resets
}
