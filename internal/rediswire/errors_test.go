// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Only errors that say Redis cannot serve count toward the breaker; an
// error reply about one call's keys says Redis is up.
func TestClassifyRedisErrors(t *testing.T) {
	r := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	ctx := context.Background()
	reply := func(msg string) error {
		return c.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, msg).Err()
	}
	c.HSet(ctx, "h", "x", "1")
	closed := redis.NewClient(&redis.Options{Addr: r.Addr()})
	closed.Close()
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer down.Close()
	for _, tc := range []struct {
		name string
		err  error
		want Kind
	}{
		{"WRONGTYPE", c.Get(ctx, "h").Err(), Answered},
		{"CROSSSLOT", reply("CROSSSLOT Keys in request don't hash to the same slot"), Answered},
		{"script error", c.Eval(ctx, "return redis.call('NOPE')", nil).Err(), Answered},
		{"bad reply", fmt.Errorf("%w: x", ErrBadReply), Answered},
		{"LOADING", reply("LOADING Redis is loading the dataset in memory"), Outage},
		{"MASTERDOWN", reply("MASTERDOWN Link with MASTER is down"), Outage},
		{"READONLY", reply("READONLY You can't write against a read only replica."), Outage},
		{"OOM", reply("OOM command not allowed when used memory > 'maxmemory'."), Outage},
		{"WRONGPASS", reply("WRONGPASS invalid username-password pair"), Outage},
		{"dial", down.Ping(ctx).Err(), Outage},
		{"timeout", context.DeadlineExceeded, Outage},
		{"closed client", closed.Ping(ctx).Err(), Unknown},
		{"pool timeout", fmt.Errorf("wrapped: %w", redis.ErrPoolTimeout), Unknown},
	} {
		if tc.err == nil {
			t.Fatalf("%s: no error to classify", tc.name)
		}
		if got := Classify(tc.err); got != tc.want {
			t.Errorf("%s (%v): kind %d, want %d", tc.name, tc.err, got, tc.want)
		}
	}
}
