// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// testScripts are the store's scripts, read from the module's lua/.
func testScripts(t *testing.T) *Scripts {
	t.Helper()
	decide, err := os.ReadFile("../../lua/token_bucket.lua")
	if err != nil {
		t.Fatal(err)
	}
	peek, err := os.ReadFile("../../lua/peek.lua")
	if err != nil {
		t.Fatal(err)
	}
	return NewScripts(string(decide), string(peek))
}

// Concurrent calls share batches, each with its own reply: 64 callers
// of distinct buckets each get the debt of their own bucket's takes, and
// identical takes (twins) are decided in one script call as one after
// another would be.
func TestPipelineKeepsEachReply(t *testing.T) {
	r := redistest.Start(t)
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}, PoolSize: 4}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	shape := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false) // burst 10, a token a second
	keys := Keys{Prefix: "pl:"}
	take := func(key string) (bool, time.Duration) {
		call := NewCall(Take, time.Now().Add(5*time.Second))
		hash, field, limit := keys.BucketLimit(ZoneField("z"), key)
		call.Bucket(hash, field, limit, shape, false)
		reply, err := c.Run(context.Background(), call)
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

	// Twins: 12 takes of one bucket of burst 10 at once.
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
		t.Fatalf("%d script calls for 12 identical takes: twins were not decided together", n)
	}
}
