// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Options that go-redis refuses with a panic give an error instead: a
// panic there would leave the client pool's entry locked, and every later
// config load waiting on it.
func TestNewClientDoesNotPanic(t *testing.T) {
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{"127.0.0.1:1"}, PoolSize: 1 << 40}, NewScripts("", ""))
	if err == nil {
		c.Close()
		t.Fatal("a pool of 2^40 connections was accepted")
	}
}

// go-redis's own log lines go to the store's logger at DEBUG, at most
// one a second, instead of to stderr.
func TestGoRedisLogLines(t *testing.T) {
	prev := goRedisLog.logger.Load()
	defer goRedisLog.logger.Store(prev)
	for _, level := range []zapcore.Level{zapcore.DebugLevel, zapcore.InfoLevel} {
		core, logs := observer.New(level)
		goRedisLog.logger.Store(zap.New(core))
		goRedisLog.lines = throttle.Throttle{}
		for range 10 {
			redis.SetLogger(goRedisLog) // as init does
			goRedisLog.Printf(context.Background(), "redis: failed to dial %s", "127.0.0.1:1")
		}
		want := 0
		if level == zapcore.DebugLevel {
			want = 1
		}
		if n := logs.Len(); n != want {
			t.Fatalf("logger at %s: %d lines for 10 go-redis lines in a burst, want %d", level, n, want)
		}
		if want == 1 && logs.All()[0].ContextMap()["message"] != "redis: failed to dial 127.0.0.1:1" {
			t.Fatalf("line %v", logs.All()[0])
		}
	}
}
