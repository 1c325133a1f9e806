// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore_test

import (
	"testing"

	"github.com/redis/go-redis/v9"
)

// newRedisClient is a plain client, for what a test reads and writes in
// Redis behind the store's back.
func newRedisClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return c
}
