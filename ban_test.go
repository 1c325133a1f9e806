// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// banZone is the JSON of a zone that bans for an hour: 5/h (a token every
// 720s), burst 2. A denial's Retry-After is then 4320s: the ban and a
// token.
func banZone(name string) string {
	return `{"name":"` + name + `","rate":"5/h","burst":2,"ban":"1h"}`
}

// A reset made through another instance lifts a ban here within one
// refill of a token, when that is shorter than a second: the over-limit
// cache trusts what Redis said of a banned bucket no longer. The other
// instance's admin API deletes the bucket in Redis (RedisStore.reset),
// as this test does. What the test asks of each request follows from
// when Redis's denial was decided, which lies between its sending and
// its answer: on a machine that other tests load, those may be far
// apart, and a request late.
func TestResetWithinARefill(t *testing.T) {
	r := startRedis(t)
	// A timeout shorter than a token's refill: a request that finds the
	// bucket short cannot wait for the token within it (the over-limit
	// cache would send it to Redis once the token is there, see
	// redisstore's look), so Redis refuses it and starts the ban.
	h := newTestHandler(t, `{"zones":[{"name":"quick-reset","rate":"2r/s","burst":1,"ban":"5m"}],
		"store":{"backend":"redis","addresses":["`+r.Addr()+`"],"timeout":"400ms"}}`)
	const ip = "198.51.100.40"
	const refill = 500 * time.Millisecond // a token of 2r/s
	// Requests, four at once, until one is refused: at burst 1 three of
	// the first four, however slowly a loaded machine answers each (one
	// at a time, a request answered a token's refill after the last
	// would find a token again). Redis's denial starts the ban; the cache
	// learns it, and refuses the next by it.
	var sent, answered time.Time
	code, hdr := 200, http.Header(nil)
	for i := 0; code == 200; i++ {
		if i == 10 {
			t.Fatal("10 times 4 requests at once, none refused")
		}
		var codes [4]int
		var hdrs [4]http.Header
		var wg sync.WaitGroup
		sent = time.Now()
		for j := range codes {
			wg.Go(func() { codes[j], hdrs[j] = serve(h, ip) })
		}
		wg.Wait()
		answered = time.Now()
		for j := range codes {
			if codes[j] != 200 {
				code, hdr = codes[j], hdrs[j]
				break
			}
		}
	}
	for i := range 3 {
		if i > 0 {
			code, hdr = serve(h, ip)
		}
		if code != 429 || hdr.Get("Retry-After") != "301" {
			t.Fatalf("%d, Retry-After %q; want 429 and 301 (the ban and a token)", code, hdr.Get("Retry-After"))
		}
	}
	hash, field := bucketOf(h, 0, ip)
	if n := r.CLI("HDEL", hash, field); n != "1" {
		t.Fatalf("HDEL %s %s: %s", hash, field, n)
	}
	// Decided within a token's refill of the denial, a request is
	// refused by the cache; one answered later may have asked Redis.
	if code, _ := serve(h, ip); time.Now().Before(sent.Add(refill)) && code != 429 {
		t.Fatalf("%d within a token's refill of the ban, want 429 from the cache", code)
	}
	// Past a token's refill, Redis is asked, and the bucket is gone.
	time.Sleep(time.Until(answered.Add(refill + time.Millisecond)))
	if code, _ := serve(h, ip); code != 200 {
		t.Fatalf("%d a token's refill after the reset, want 200", code)
	}
}

// A ban survives a config reload: the local store keeps a zone's buckets
// across configs by its name, Redis keeps them anyway.
func TestBanSurvivesReload(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", storeJSON()},
		{"redis", storeJSON(r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "reload-ban-" + tc.name
			config := func(zones, body string) string {
				return jsonServer(`{"handler":"rate_limit","zones":[` + zones + `],"store":` + tc.store + `},
					{"handler":"static_response","body":"` + body + `"}`)
			}
			loadJSON(t, config(banZone(zone), "one"))
			c := &http.Client{Timeout: 10 * time.Second}
			const ip = "198.51.100.20"
			for i := range 2 {
				if code, body, _ := hit(t, c, "/", ip); code != 200 || body != "one" {
					t.Fatalf("request %d: %d %q", i, code, body)
				}
			}
			if code, _, retry := hit(t, c, "/", ip); code != 429 || retry != 4320 {
				t.Fatalf("the denial that bans: %d, Retry-After %d; want 429, 4320", code, retry)
			}

			// A new config, with another zone before the one that banned.
			loadJSON(t, config(`{"name":"`+zone+`-other","rate":"100r/m"},`+banZone(zone), "two"))
			if code, body, _ := hit(t, c, "/", "198.51.100.21"); code != 200 || body != "two" {
				t.Fatalf("another client after the reload: %d %q, want 200 from the new config", code, body)
			}
			if code, _, retry := hit(t, c, "/", ip); code != 429 || retry < 4318 || retry > 4320 {
				t.Fatalf("after the reload: %d, Retry-After %d; want 429 and the ban's time left", code, retry)
			}
		})
	}
}

// A ban holds across instances that share a Redis: a key banned through
// one is refused by the other, with the Retry-After of the ban's time
// left, and the other's denials start no ban of their own. The instances
// are a Caddy and a handler with a connection pool of its own (another
// timeout) and an over-limit cache of its own.
func TestBanAcrossInstances(t *testing.T) {
	for _, tc := range []struct {
		name  string
		addrs func(t *testing.T) []string
	}{
		{"redis", func(t *testing.T) []string { return []string{startRedis(t).Addr()} }},
		{"cluster", func(t *testing.T) []string {
			var addrs []string
			for _, n := range startCluster(t) {
				addrs = append(addrs, n.Addr())
			}
			return addrs
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addrs := tc.addrs(t)
			zone := "shared-ban-" + tc.name
			loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[`+banZone(zone)+`],"store":`+storeJSON(addrs...)+`},
				{"handler":"static_response","body":"ok"}`))
			other := newTestHandler(t, `{"zones":[`+banZone(zone)+`],"store":`+
				strings.Replace(storeJSON(addrs...), testTimeout, `"timeout":"2s"`, 1)+`}`)
			bans := &other.Zones[0].state.bans // both instances' zone (one process)
			c := &http.Client{Timeout: 10 * time.Second}

			// Banned through Caddy, refused by the other instance.
			const ip = "198.51.100.30"
			hit(t, c, "/", ip)
			hit(t, c, "/", ip)
			if code, _, retry := hit(t, c, "/", ip); code != 429 || retry != 4320 {
				t.Fatalf("the denial that bans: %d, Retry-After %d; want 429, 4320", code, retry)
			}
			time.Sleep(2 * time.Second)
			for i := range 3 {
				code, hdr := serve(other, ip)
				if retry, _ := strconv.Atoi(hdr.Get("Retry-After")); code != 429 || retry < 4317 || retry > 4318 {
					t.Fatalf("other instance, request %d: %d, Retry-After %q; want 429 and 4318: the ban's time left", i, code, hdr.Get("Retry-After"))
				}
			}
			if code, _, retry := hit(t, c, "/", ip); code != 429 || retry < 4317 || retry > 4318 {
				t.Fatalf("Caddy after the other's denials: %d, Retry-After %d; want 429 and 4318: they did not lengthen the ban", code, retry)
			}
			if n := bans.Load(); n != 1 {
				t.Fatalf("%d bans started, want 1", n)
			}

			// And the other way round.
			const ip2 = "198.51.100.31"
			for i, want := range []int{200, 200, 429} {
				if code, _ := serve(other, ip2); code != want {
					t.Fatalf("other instance, request %d: %d, want %d", i, code, want)
				}
			}
			if code, _, retry := hit(t, c, "/", ip2); code != 429 || retry < 4319 || retry > 4320 {
				t.Fatalf("Caddy, for a key the other banned: %d, Retry-After %d; want 429 and 4320", code, retry)
			}
			if n := bans.Load(); n != 2 {
				t.Fatalf("%d bans started, want 2", n)
			}

			// A reset made elsewhere (another instance's admin API
			// deletes the bucket in Redis) is honoured by both within a
			// second, though each had learnt the ban.
			rc := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: addrs})
			defer rc.Close()
			hash, field := bucketOf(other, 0, ip)
			if n, err := rc.HDel(context.Background(), hash, field).Result(); err != nil || n != 1 {
				t.Fatalf("HDEL %s %s: %d, %v", hash, field, n, err)
			}
			reset := time.Now()
			var caddyBack, otherBack time.Duration
			for caddyBack == 0 || otherBack == 0 {
				if time.Since(reset) > 2*time.Second {
					t.Fatalf("2s after the reset: Caddy back after %v, the other instance after %v (0: not yet)", caddyBack, otherBack)
				}
				// Each instance asks until it is served once: the
				// bucket's burst of 2 serves both, and one that asked
				// on would empty it, and ban the key again, before the
				// other has learnt of the reset.
				if caddyBack == 0 {
					if code, _, _ := hit(t, c, "/", ip); code == 200 {
						caddyBack = time.Since(reset)
					}
				}
				if otherBack == 0 {
					if code, _ := serve(other, ip); code == 200 {
						otherBack = time.Since(reset)
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
			if caddyBack > 1100*time.Millisecond || otherBack > 1100*time.Millisecond {
				t.Fatalf("the reset was honoured after %v by Caddy and %v by the other instance, want within a second", caddyBack, otherBack)
			}
		})
	}
}

// A key banned for the longest ban after the longest refill is refused
// every time, through a real Caddy, on both stores, with and without
// jitter (whose extra wait, up to another refill, passes time.Duration's
// 292 years): Retry-After is never earlier than RateLimit's t, and a gRPC
// refusal's pushback is as long as Retry-After, never negative.
func TestLongestBanRefuses(t *testing.T) {
	r := startRedis(t)
	cases := []struct{ name, store, jitter string }{
		{"local", storeJSON(), ""},
		{"local-jitter", storeJSON(), `,"jitter":5`},
		{"redis", storeJSON(r.Addr()), ""},
		{"redis-jitter", storeJSON(r.Addr()), `,"jitter":5`},
	}
	var routes []string
	for _, tc := range cases {
		routes = append(routes, `{"match":[{"path":["/`+tc.name+`"]}],"handle":[{"handler":"rate_limit","zones":[{"name":"longest-ban-`+tc.name+
			`","rate":"1/876000h","burst":1,"ban":"876000h"}],"store":`+tc.store+tc.jitter+`},{"handler":"static_response","body":"ok"}]}`)
	}
	loadJSON(t, jsonServerH2C(`{"handler":"subroute","routes":[`+strings.Join(routes, ",")+`]}`))
	h1, h2c := &http.Client{Timeout: 10 * time.Second}, h2cClient()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := "/" + tc.name
			sendExpect(t, h1, http.MethodGet, path, http.StatusOK)
			for i := range 8 {
				if i%2 == 0 {
					checkLongWait(t, i, sendExpect(t, h1, http.MethodGet, path, http.StatusTooManyRequests))
					continue
				}
				hdr := sendExpect(t, h2c, http.MethodPost, path, http.StatusOK, "Content-Type", "application/grpc")
				if hdr.Get("Grpc-Status") != "8" {
					t.Fatalf("gRPC request %d: grpc-status %q, want RESOURCE_EXHAUSTED", i, hdr.Get("Grpc-Status"))
				}
				checkLongWait(t, i, hdr)
			}
		})
	}
}

// checkLongWait checks a refusal's Retry-After against its RateLimit t,
// and its gRPC pushback, if any, against its Retry-After.
func checkLongWait(t *testing.T, i int, hdr http.Header) {
	t.Helper()
	rl := hdr.Get("Ratelimit")
	secs, err := strconv.ParseInt(rl[strings.LastIndex(rl, "t=")+2:], 10, 64)
	if err != nil {
		t.Fatalf("request %d: RateLimit %q: %v", i, rl, err)
	}
	retry, err := strconv.ParseInt(hdr.Get("Retry-After"), 10, 64)
	if err != nil || retry < secs || secs < 6307200000 {
		t.Fatalf("request %d: Retry-After %q, RateLimit %q; want t of at least 200 years, Retry-After no earlier", i, hdr.Get("Retry-After"), rl)
	}
	if p := hdr.Get("Grpc-Retry-Pushback-Ms"); p != "" {
		if ms, err := strconv.ParseInt(p, 10, 64); err != nil || ms <= (retry-1)*1000 || ms > retry*1000 {
			t.Fatalf("request %d: pushback %q ms, Retry-After %d s; want the same wait", i, p, retry)
		}
	}
}
