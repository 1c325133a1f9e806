// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The breaker opens after TripAfter outages in a row, an outage of an
// earlier call changes nothing once it is open, and any answer closes it.
func TestBreaker(t *testing.T) {
	var b Breaker
	for i := range TripAfter {
		if opened := b.Outage(); opened != (i == TripAfter-1) {
			t.Fatalf("outage %d: opened %t", i+1, opened)
		}
	}
	if !b.Open() || b.Outage() {
		t.Fatal("an open breaker opened again")
	}
	if !b.Success() || b.Open() {
		t.Fatal("an answer did not close the breaker")
	}
	if b.Success() {
		t.Fatal("a closed breaker closed again")
	}
	// Outages in a row: an answer between them starts the count again.
	b.Outage()
	b.Outage()
	b.Success()
	if b.Outage() || b.Open() {
		t.Fatal("outages with an answer between them opened the breaker")
	}
}

// A Redis that is back is noticed with no request: the client probes it
// while the breaker is open, and closes the breaker within a backoff.
func TestClientProbesInTheBackground(t *testing.T) {
	r := redistest.Start(t)
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}, MaxRetries: -1,
		DialTimeout: 50 * time.Millisecond, ReadTimeout: 50 * time.Millisecond}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Destruct()
	r.Kill()
	for range TripAfter {
		c.Failed(zap.NewNop(), "local", redis.ErrClosed)
	}
	if c.Up() {
		t.Fatal("the breaker is closed after three outages")
	}
	time.Sleep(3 * MaxBackoff)
	if c.Up() {
		t.Fatal("Redis is down, and the breaker closed")
	}
	r.Start()
	back := time.Now()
	for !c.Up() {
		if time.Since(back) > MaxBackoff+500*time.Millisecond {
			t.Fatalf("Redis has been back %v, and the breaker is still open", time.Since(back))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("closed %v after Redis was back", time.Since(back))
}
