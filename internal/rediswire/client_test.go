// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
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

// clusterClient is a client of the cluster of nodes, with the store's
// timeouts and retries, closed when the test ends.
func clusterClient(t *testing.T, nodes []*redistest.Server) *Client {
	t.Helper()
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.Addr())
	}
	c, err := NewClient(&redis.UniversalOptions{Addrs: addrs, MaxRetries: -1, ContextTimeoutEnabled: true,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Destruct() })
	return c
}

// masterOf is the address of the master of key's slot, as the client
// knows it.
func masterOf(t *testing.T, c *Client, key string) string {
	t.Helper()
	m, err := c.UniversalClient.(*redis.ClusterClient).MasterForKey(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	return m.Options().Addr
}

// When a master of a cluster dies and its replica takes over, the
// client sends the master's slots to the replica as soon as a call that
// went to the dead master has failed: go-redis by itself would ask for
// the slots again only a minute later, as a dead master sends no MOVED.
func TestClusterFollowsFailover(t *testing.T) {
	masters, replicas := redistest.StartReplicatedCluster(t)
	c := clusterClient(t, append(slices.Clone(masters), replicas...))
	ctx := context.Background()
	victim, heir := masters[0], replicas[0]
	var key string
	for i := 0; key == ""; i++ {
		if k := fmt.Sprintf("k%d", i); masterOf(t, c, k) == victim.Addr() {
			key = k
		}
	}
	victim.Kill()
	deadline := time.Now().Add(20 * time.Second)
	for strings.Fields(heir.CLI("ROLE"))[0] != "master" || !masters[1].ClusterOK() || !masters[2].ClusterOK() {
		if time.Now().After(deadline) {
			t.Fatal("the replica did not take over")
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The store's call fails, and it tells the client so.
	if err := c.PExpire(ctx, key, time.Millisecond).Err(); err != nil {
		c.Failed(zap.NewNop(), err)
	}
	took := time.Now()
	for {
		err := c.PExpire(ctx, key, time.Millisecond).Err()
		if err == nil {
			break
		}
		if time.Since(took) > 2*time.Second {
			t.Fatalf("the replica took over, and %v later a call of its slots still fails: %v", time.Since(took), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if m := masterOf(t, c, key); m != heir.Addr() {
		t.Fatalf("the slot's master is %s, want the replica that took over, %s", m, heir.Addr())
	}
	t.Logf("the replica's slots answered %v after a call failed", time.Since(took))
}

// Stores that share a client and differ in fail_mode are each told what
// they do while Redis is down: the outage is said once for each
// fail_mode, naming its zones; a store that joins while it stands, with
// a fail_mode not named yet, has it said for its own, and one with a
// fail_mode named has nothing said. A store that left is not named.
func TestOutageSaidForEachFailMode(t *testing.T) {
	r := redistest.Start(t)
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}, MaxRetries: -1,
		DialTimeout: 50 * time.Millisecond, ReadTimeout: 50 * time.Millisecond}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Destruct()
	core, logs := observer.New(zapcore.InfoLevel)
	logger := zap.New(core)
	c.Join(logger, "local", []string{"a", "b"})
	leave := c.Join(logger, "closed", []string{"c"})
	c.Join(logger, "local", []string{"b", "d"})
	said := func() string {
		var out []string
		for _, e := range logs.TakeAll() {
			m := e.ContextMap()
			out = append(out, fmt.Sprint(strings.Join(strings.Fields(e.Message)[:3], " "), " ", m["fail_mode"], " ", m["zones"]))
		}
		return strings.Join(out, "; ")
	}
	r.Kill()
	for range tripAfter {
		c.Failed(logger, redis.ErrClosed)
	}
	if got, want := said(), "redis store unavailable: local [a b d]; redis store unavailable: closed [c]"; got != want {
		t.Fatalf("the outage said %q, want %q", got, want)
	}
	c.Join(logger, "open", []string{"e"})
	c.Join(logger, "closed", []string{"f"})
	if got, want := said(), "redis store unavailable: open [e]"; got != want {
		t.Fatalf("joining during the outage said %q, want %q", got, want)
	}
	r.Start()
	waitUp(t, c)
	if got, want := said(), "redis store available <nil> <nil>"; got != want {
		t.Fatalf("Redis back: said %q, want %q", got, want)
	}
	// A store that left is not named: a refusal of the scripts, then.
	leave()
	r.CLI("ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-eval", "-evalsha")
	limited := redis.NewClient(&redis.Options{Addr: r.Addr(), Username: "limited", Password: "pw"})
	defer limited.Close()
	c.Refuse(logger, limited.Eval(context.Background(), "return 0", nil).Err())
	if got, want := said(), "redis refuses this local [a b d]; redis refuses this open [e]; redis refuses this closed [f]"; got != want {
		t.Fatalf("the refusal said %q, want %q", got, want)
	}
}

// waitUp waits for c's breaker to close: a probe found Redis.
func waitUp(t *testing.T, c *Client) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !c.Up(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the breaker did not close with Redis back")
		}
	}
}
