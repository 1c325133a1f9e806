// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command luacost measures what a decision costs Redis in the script
// alone: flights of plain decisions of the plugin's script, of a given
// size, on random keys, and go-redis/redis_rate's script one decision a
// call, on the same Redis, one after the other; and adjustments of many
// buckets in one call (a zone with sync reconciles so), plain and in
// sections. It reports the script
// time per decision from INFO commandstats. Run it against a redis-server
// under `valgrind --tool=callgrind` to count instructions instead.
//
//	go run ./luacost -addr 127.0.0.1:6379 -flight 1,8,40 -adjust 64   # from bench/
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "the Redis to measure on (it is written to under lc:)")
	flights := flag.String("flight", "1,8,40", "flight sizes, comma-separated")
	decisions := flag.Int("decisions", 40000, "decisions of each kind")
	keys := flag.Int("keys", 10000, "random keys")
	before := flag.Bool("before", false, "the script speaks the protocol before flights (../internal/redisstore/testdata/scripts/token_bucket_before_flights.lua): one decision a call")
	rr := flag.Bool("redis_rate", true, "measure redis_rate too")
	adjust := flag.Int("adjust", 0, "buckets of an adjustment to measure, plain and in sections (0: none)")
	file := flag.String("script", "", "a decision script to measure instead of the plugin's (lua.Decide), such as an older version's")
	flag.Parse()
	src := []byte(lua.Decide)
	if *file != "" {
		var err error
		if src, err = os.ReadFile(*file); err != nil {
			log.Fatal(err)
		}
	}
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: 4})
	defer c.Close()
	script := redis.NewScript(string(src))
	if err := script.Load(ctx, c).Err(); err != nil {
		log.Fatal(err)
	}
	// A plain shape: 1000000 r/s, burst 1000000 (never refuses), a token
	// a µs: full 1s, cost 1µs, token 1µs, in ns.
	const full, cost, token = 1_000_000_000, 1000, 1000
	for _, f := range strings.FieldsFunc(*flights, func(r rune) bool { return r == ',' }) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			log.Fatalf("flight size %q", f)
		}
		if *before && n != 1 {
			log.Fatal("-before: flights of 1 only")
		}
		usec := measure(c, func() int {
			if *before {
				k := rand.IntN(*keys)
				h := fmt.Sprintf("lc:{%04x}", k%16384)
				field := fmt.Sprintf("z:abcd:10.0.%d.%d", k>>8, k&255)
				if err := script.EvalSha(ctx, c, []string{h, h}, "take", "", 1, 0, 0, field, full, cost, 0, 0, 0, 0, token).Err(); err != nil {
					log.Fatal(err)
				}
				return 1
			}
			keysArg := make([]string, n)
			args := []any{"", 0, 1, full, cost, token} // clock, no decision but plain takes, one shape
			for i := range n {
				k := rand.IntN(*keys)
				keysArg[i] = fmt.Sprintf("lc:{%04x}", k%16384)
				args = append(args, 1, 1, fmt.Sprintf("z:abcd:10.0.%d.%d", k>>8, k&255))
			}
			if err := script.EvalSha(ctx, c, keysArg, args...).Err(); err != nil {
				log.Fatal(err)
			}
			return n
		}, *decisions)
		fmt.Printf("tokenbucket flight of %-3d %6.2f µs a decision\n", n, usec)
	}
	if *adjust > 0 {
		// A shape that may owe 20 s beyond its bucket, as a sync zone's.
		for _, sections := range []bool{false, true} {
			usec := measure(c, func() int {
				var keysArg []string
				args := []any{"", 1, 1, full, cost, token, "+", *adjust, 1, 20 * full} // a plain adjustment is not a plain take (ARGV[2])
				if sections {
					args = []any{"", 1, 0, "adjust", *adjust, 0, 0}
				}
				for range *adjust {
					k := rand.IntN(*keys)
					h := fmt.Sprintf("lc:{%04x}", k%16384)
					field := fmt.Sprintf("z:abcd:10.0.%d.%d", k>>8, k&255)
					keysArg = append(keysArg, h)
					if sections {
						keysArg = append(keysArg, h) // no override read
						args = append(args, field, full, cost, 0, 20*full, 0, 0, token, 0)
					} else {
						args = append(args, field, cost)
					}
				}
				if err := script.EvalSha(ctx, c, keysArg, args...).Err(); err != nil {
					log.Fatal(err)
				}
				return *adjust
			}, *decisions)
			how := "plain"
			if sections {
				how = "in sections"
			}
			fmt.Printf("adjustment of %d, %-11s %6.2f µs a bucket\n", *adjust, how, usec)
		}
	}
	if !*rr {
		return
	}
	lim := redis_rate.NewLimiter(c)
	limit := redis_rate.Limit{Rate: 1_000_000, Burst: 1_000_000, Period: time.Second}
	usec := measure(c, func() int {
		if _, err := lim.Allow(ctx, fmt.Sprint("lc:rr:", rand.IntN(*keys)), limit); err != nil {
			log.Fatal(err)
		}
		return 1
	}, *decisions)
	fmt.Printf("redis_rate                %6.2f µs a decision\n", usec)
}

// measure runs call until it has made the given decisions, and returns
// Redis's script time per decision.
func measure(c *redis.Client, call func() int, decisions int) float64 {
	u0 := scriptUsec(c)
	n := 0
	for n < decisions {
		n += call()
	}
	return float64(scriptUsec(c)-u0) / float64(n)
}

// scriptUsec is the time Redis has spent in EVALSHA and EVAL.
func scriptUsec(c *redis.Client) int64 {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		log.Fatal(err)
	}
	var usec int64
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd); ok {
				for _, kv := range strings.Split(rest, ",") {
					if v, ok := strings.CutPrefix(kv, "usec="); ok {
						n, _ := strconv.ParseInt(v, 10, 64)
						usec += n
					}
				}
			}
		}
	}
	return usec
}
