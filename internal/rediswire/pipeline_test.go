// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// testScripts are the store's scripts, from the module's lua/.
func testScripts(t *testing.T) *Scripts {
	t.Helper()
	return NewScripts(lua.Decide, lua.Peek)
}

// taker is a take of a token from a bucket of 10 of a key, through a
// client of r with a pool of 4 (two flights).
func taker(t *testing.T, r *redistest.Server) func(key string) (Reply, error) {
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}, PoolSize: 4}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	shape := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false) // burst 10, a token a second
	keys := Keys{Prefix: "pl:"}
	return func(key string) (Reply, error) {
		call := NewCall(Take, time.Now().Add(5*time.Second))
		hash, field, limit := keys.BucketLimit(ZoneField("z"), key)
		call.Bucket(hash, field, limit, shape, false, false)
		return c.Run(context.Background(), call)
	}
}

// Concurrent calls share flights, each with its own reply: 64 callers
// of distinct buckets each get the debt of their own bucket's takes, and
// takes of one bucket in one flight are decided one after another, in
// fewer script calls than takes.
func TestPipelineKeepsEachReply(t *testing.T) {
	r := redistest.Start(t)
	takeOf := taker(t, r)
	take := func(key string) (bool, time.Duration) {
		reply, err := takeOf(key)
		if err != nil {
			t.Error(err)
			return false, 0
		}
		debt, _ := reply.Bucket(0)
		return reply.Allowed(), debt
	}
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			key := fmt.Sprint("k", i)
			for n := 1; n <= 3; n++ {
				ok, debt := take(key)
				// Redis's clock moves between calls: the debt is a whole
				// number of tokens, less what refilled meanwhile.
				if want := time.Duration(n) * time.Second; !ok || debt > want || debt < want-time.Second/2 {
					t.Errorf("%s, take %d: allowed %t, owes %v; want allowed, about %v", key, n, ok, debt, want)
				}
			}
		})
	}
	wg.Wait()

	// 12 takes of one bucket of burst 10 at once.
	calls := r.Calls()
	var mu sync.Mutex
	allowed := 0
	for range 12 {
		wg.Go(func() {
			if ok, _ := take("twin"); ok {
				mu.Lock()
				allowed++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if allowed != 10 {
		t.Fatalf("%d of 12 takes of a bucket of 10 allowed", allowed)
	}
	if n := r.Calls() - calls; n >= 12 {
		t.Fatalf("%d script calls for 12 takes at once: they did not share flights", n)
	}
}

// A Redis that lost its scripts (SCRIPT FLUSH, a restart) is sent them
// again, by a call alone and by a flight, with takes of one bucket among
// them: each still gets its own bucket's reply.
func TestPipelineAfterScriptFlush(t *testing.T) {
	r := redistest.Start(t)
	takeOf := taker(t, r)
	take := func(key string) (bool, error) {
		reply, err := takeOf(key)
		if err != nil {
			return false, err
		}
		return reply.Allowed(), nil
	}
	if ok, err := take("alone"); !ok || err != nil {
		t.Fatalf("first take: %t, %v", ok, err)
	}
	for round := range 3 {
		r.CLI("SCRIPT", "FLUSH")
		var wg sync.WaitGroup
		var mu sync.Mutex
		allowed := map[string]int{}
		for i := range 48 {
			key := fmt.Sprint(round, "k", i%24) // two takes of each, often in one flight
			if i >= 36 {
				key = fmt.Sprint(round, "twin") // 12 takes of a bucket of 10
			}
			wg.Go(func() {
				ok, err := take(key)
				if err != nil {
					t.Errorf("%s: %v", key, err)
				}
				if ok {
					mu.Lock()
					allowed[key]++
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if n := allowed[fmt.Sprint(round, "twin")]; n != 10 {
			t.Errorf("round %d: %d of 12 takes of a bucket of 10 allowed", round, n)
		}
		for i := range 24 {
			if k, want := fmt.Sprint(round, "k", i), 1+btoi(i < 12); allowed[k] != want {
				t.Errorf("%s: %d of %d takes allowed", k, allowed[k], want)
			}
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
