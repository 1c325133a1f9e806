// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The breaker opens after tripAfter outages in a row, an outage of an
// earlier call changes nothing once it is open, and any answer closes it.
func TestBreaker(t *testing.T) {
	var b breaker
	for i := range tripAfter {
		if opened := b.outage(); opened != (i == tripAfter-1) {
			t.Fatalf("outage %d: opened %t", i+1, opened)
		}
	}
	if !b.open() || b.outage() {
		t.Fatal("an open breaker opened again")
	}
	if !b.success() || b.open() {
		t.Fatal("an answer did not close the breaker")
	}
	if b.success() {
		t.Fatal("a closed breaker closed again")
	}
	// Outages in a row: an answer between them starts the count again.
	b.outage()
	b.outage()
	b.success()
	if b.outage() || b.open() {
		t.Fatal("outages with an answer between them opened the breaker")
	}
	// One master of several answering ends a run of outages alike, but
	// closes no open breaker.
	b.answered()
	b.outage()
	b.outage()
	b.answered()
	if b.outage() || b.open() {
		t.Fatal("outages with a master's answer between them opened the breaker")
	}
	b.outage()
	if b.outage(); !b.open() {
		t.Fatal("three outages in a row did not open the breaker")
	}
	if b.answered(); !b.open() {
		t.Fatal("a master's answer closed the breaker")
	}
}

// A Redis that is back is noticed with no request: the client probes it
// while the breaker is open, and closes the breaker within a backoff.
func TestClientProbesInTheBackground(t *testing.T) {
	r := redistest.Start(t)
	c := trippedClient(t, r)
	if c.Up() {
		t.Fatal("the breaker is closed after three outages")
	}
	time.Sleep(3 * maxBackoff)
	if c.Up() {
		t.Fatal("Redis is down, and the breaker closed")
	}
	r.Start()
	back := time.Now()
	for !c.Up() {
		if time.Since(back) > maxBackoff+500*time.Millisecond {
			t.Fatalf("Redis has been back %v, and the breaker is still open", time.Since(back))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("closed %v after Redis was back", time.Since(back))
}

// On a cluster the breaker is the store's: once open, it stays open
// while a master is down, though the others answer the probes and the
// calls made before it opened, and it closes when a probe finds every
// master answering again (here, with a cluster that serves the slots of
// the masters that are up, cluster-require-full-coverage no).
func TestClusterBreakerWaitsForEveryMaster(t *testing.T) {
	nodes := redistest.StartClusterWith(t, 0, "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no")
	c := clusterClient(t, nodes)
	// Not the master of the probe's key, whose answer alone would keep
	// the breaker open.
	victim := nodes[0]
	if masterOf(t, c, probeKey) == victim.Addr() {
		victim = nodes[1]
	}
	victim.Kill()
	for range tripAfter {
		c.Failed(zap.NewNop(), redis.ErrClosed)
	}
	c.Answered(zap.NewNop()) // a call that another master answered
	for start := time.Now(); time.Since(start) < 3*maxBackoff; time.Sleep(10 * time.Millisecond) {
		if c.Up() {
			t.Fatalf("a master is down, and the breaker closed %v after it opened", time.Since(start))
		}
	}
	victim.Start() // with its slots, from its cluster config
	back := time.Now()
	for !c.Up() {
		if time.Since(back) > maxBackoff+time.Second {
			t.Fatalf("every master has been back %v, and the breaker is still open", time.Since(back))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("closed %v after the master was back", time.Since(back))
}

// A probe is the client's, never a request's: requests whose clients
// give up, their calls cancelled while the breaker is open, leave the
// probes alone, and the breaker closes within a backoff of Redis being
// back, whatever they do.
func TestCancelledCallsLeaveTheProbes(t *testing.T) {
	r := redistest.Start(t)
	c := trippedClient(t, r)
	r.Start()
	back := time.Now()
	shape := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false)
	for !c.Up() {
		if time.Since(back) > maxBackoff+500*time.Millisecond {
			t.Fatalf("Redis has been back %v, and the breaker is still open", time.Since(back))
		}
		// Past a backoff, a call whose client has given up.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		call := NewCall(Take, time.Now().Add(time.Second))
		hash, field, limit := Keys{Prefix: "probe:"}.BucketLimit(ZoneField("z"), "impatient")
		call.Bucket(hash, field, limit, shape, false, false)
		if _, err := c.Run(ctx, call); err == nil {
			t.Fatal("a cancelled call was answered")
		}
		time.Sleep(minBackoff / 4)
	}
	t.Logf("closed %v after Redis was back", time.Since(back))
}

// trippedClient is a client of r, which it kills, with its breaker opened
// by outages in a row; the client closes when the test ends.
func trippedClient(t *testing.T, r *redistest.Server) *Client {
	t.Helper()
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}, MaxRetries: -1, ContextTimeoutEnabled: true,
		DialTimeout: 50 * time.Millisecond, ReadTimeout: 50 * time.Millisecond}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Destruct() })
	r.Kill()
	for range tripAfter {
		c.Failed(zap.NewNop(), redis.ErrClosed)
	}
	return c
}
