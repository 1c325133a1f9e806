// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// The reference for the Redis rows of the throughput phase:
// github.com/go-redis/redis_rate's Allow, one script call per decision,
// on the same redis-server in the same rounds, so that the script time
// and Redis CPU of one decision of ours can be set against its.

// rrCallers is how many goroutines call Allow at once.
const rrCallers = 16

// rrLimit never runs out: every decision is allowed, as on the Redis
// rows' allowed path.
var rrLimit = redis_rate.Limit{Rate: 1000000, Burst: 1000000, Period: time.Second}

type redisRate struct {
	client *redis.Client
	lim    *redis_rate.Limiter
	keys   []string
}

func newRedisRate(addr string) *redisRate {
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: rrCallers})
	keys := make([]string, tpKeys)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i+1)
	}
	return &redisRate{client: c, lim: redis_rate.NewLimiter(c), keys: keys}
}

func (rr *redisRate) close() { _ = rr.client.Close() }

// allow calls Allow from rrCallers goroutines, each on keys at random,
// for dur, and returns how many decisions they made and in what time.
func (rr *redisRate) allow(dur time.Duration) (int64, time.Duration, error) {
	counts := make([]int64, rrCallers)
	errs := make([]error, rrCallers)
	began := time.Now()
	end := began.Add(dur)
	var wg sync.WaitGroup
	for i := range rrCallers {
		wg.Go(func() {
			var n int64
			for time.Now().Before(end) {
				key := rr.keys[rand.IntN(len(rr.keys))]
				res, err := rr.lim.Allow(context.Background(), key, rrLimit)
				if err != nil {
					errs[i] = fmt.Errorf("redis_rate: %w", err)
					break
				}
				if res.Allowed != 1 {
					errs[i] = fmt.Errorf("redis_rate denied %s under a limit that never runs out", key)
					break
				}
				n++
			}
			counts[i] = n
		})
	}
	wg.Wait()
	took := time.Since(began)
	var n int64
	for i := range counts {
		if errs[i] != nil {
			return 0, 0, errs[i]
		}
		n += counts[i]
	}
	return n, took, nil
}

// rrRun is one run of redis_rate.
type rrRun struct {
	Decisions           int64
	PerSec              float64
	CallsPerDecision    float64
	ScriptPerDecision   time.Duration // Redis's time in script calls
	RedisCPUPerDecision time.Duration // the redis-server process's CPU
}

// redisRateRun is one run of redis_rate for dur, with what Redis did
// meanwhile.
func (e *env) redisRateRun(rr *redisRate, dur time.Duration) (rrRun, error) {
	u0, err := e.redis.use()
	if err != nil {
		return rrRun{}, err
	}
	n, took, err := rr.allow(dur)
	if err != nil {
		return rrRun{}, err
	}
	u1, err := e.redis.use()
	if err != nil {
		return rrRun{}, err
	}
	if n == 0 {
		return rrRun{}, fmt.Errorf("redis_rate made no decision in %v", dur)
	}
	return rrRun{
		Decisions:           n,
		PerSec:              float64(n) / took.Seconds(),
		CallsPerDecision:    float64(u1.calls-u0.calls) / float64(n),
		ScriptPerDecision:   (u1.script - u0.script) / time.Duration(n),
		RedisCPUPerDecision: (u1.cpu - u0.cpu) / time.Duration(n),
	}, nil
}

// rrResult is the medians of redis_rate's runs.
type rrResult struct {
	Callers, Keys                          int
	Runs                                   []rrRun
	PerSec, CallsPerDecision               float64
	ScriptPerDecision, RedisCPUPerDecision time.Duration
}

func rrMedians(runs []rrRun) *rrResult {
	if len(runs) == 0 {
		return nil
	}
	var perSec, calls, script, cpu []float64
	for _, x := range runs {
		perSec = append(perSec, x.PerSec)
		calls = append(calls, x.CallsPerDecision)
		script = append(script, float64(x.ScriptPerDecision))
		cpu = append(cpu, float64(x.RedisCPUPerDecision))
	}
	return &rrResult{
		Callers: rrCallers, Keys: tpKeys, Runs: runs,
		PerSec: benchkit.Median(perSec), CallsPerDecision: benchkit.Median(calls),
		ScriptPerDecision:   time.Duration(benchkit.Median(script)),
		RedisCPUPerDecision: time.Duration(benchkit.Median(cpu)),
	}
}
