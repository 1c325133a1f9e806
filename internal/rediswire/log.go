// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	redis.SetLogger(goRedisLog)
}

// goRedisLog takes go-redis's own log lines (a failed dial, a pool
// problem), which it would write to stderr outside Caddy's logs, to the
// last provisioned Redis store's logger, at DEBUG and at most one a
// second: during an outage they come once per connection attempt.
var goRedisLog = new(redisLogger)

type redisLogger struct {
	logger atomic.Pointer[zap.Logger]
	lines  throttle.Throttle
}

// SetLogger makes logger the one go-redis's lines go to.
func SetLogger(logger *zap.Logger) { goRedisLog.logger.Store(logger) }

func (l *redisLogger) Printf(_ context.Context, format string, v ...any) {
	logger := l.logger.Load()
	if logger == nil {
		return
	}
	c := logger.Check(zapcore.DebugLevel, "go-redis")
	if c == nil {
		return
	}
	if _, ok := l.lines.Allow(time.Second); ok {
		c.Write(zap.String("message", fmt.Sprintf(format, v...)))
	}
}
