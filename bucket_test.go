// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Named instants, as in golang.org/x/time/rate's tests.
var (
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1 = t0.Add(100 * time.Millisecond)
	t2 = t0.Add(200 * time.Millisecond)
	t3 = t0.Add(300 * time.Millisecond)
	t4 = t0.Add(400 * time.Millisecond)
	t5 = t0.Add(500 * time.Millisecond)
	t9 = t0.Add(900 * time.Millisecond)
)

// A step is one request against a bucket and what it must get.
type step struct {
	t         time.Time
	n         int64   // tokens asked for
	ok        bool    // allowed?
	remaining float64 // tokens left after the decision
	wait      time.Duration
}

// runSteps replays steps against one bucket of shape l, starting full.
func runSteps(t *testing.T, l limit, steps []step) {
	t.Helper()
	var f time.Duration
	for i, s := range steps {
		now := s.t.Sub(t0)
		cost := l.costTime(s.n)
		nf, ok := l.take(f, now, cost)
		if ok != s.ok {
			t.Fatalf("step %d: ok = %v, want %v", i, ok, s.ok)
		}
		if !ok && nf != l.clamp(f, now) {
			t.Fatalf("step %d: a denied request moved the bucket from %d to %d", i, f, nf)
		}
		f = nf
		debt := l.debt(f, now)
		if got := l.tokens(debt); math.Abs(got-s.remaining) > 1e-6 {
			t.Fatalf("step %d: remaining = %v, want %v", i, got, s.remaining)
		}
		if !ok {
			if got := l.wait(debt, cost); got != s.wait {
				t.Fatalf("step %d: wait = %v, want %v", i, got, s.wait)
			}
		}
	}
}

func TestBucketMath(t *testing.T) {
	tests := []struct {
		name  string
		rate  float64 // tokens per second
		burst int64
		steps []step
	}{
		{"burst exhaustion", 10, 3, []step{
			{t: t0, n: 1, ok: true, remaining: 2},
			{t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
		}},
		{"refill", 10, 2, []step{
			{t: t0, n: 2, ok: true, remaining: 0},
			{t: t1, n: 1, ok: true, remaining: 0},
			{t: t1, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t3, n: 1, ok: true, remaining: 1},
			{t: t9, n: 1, ok: true, remaining: 1}, // capped at burst before taking
		}},
		// A clock that went back leaves the bucket owing a whole bucket
		// at most, from the instant it was seen.
		{"clock going backwards", 10, 2, []step{
			{t: t5, n: 2, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t2, n: 1, ok: true, remaining: 1},
		}},
		{"fractional rate", 0.5, 1, []step{
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t9, n: 1, ok: false, remaining: 0.45, wait: 1100 * time.Millisecond},
			{t: t0.Add(2 * time.Second), n: 1, ok: true, remaining: 0},
		}},
		{"cost above 1", 10, 5, []step{
			{t: t0, n: 3, ok: true, remaining: 2},
			{t: t0, n: 3, ok: false, remaining: 2, wait: 100 * time.Millisecond},
			{t: t1, n: 3, ok: true, remaining: 0},
		}},
		{"long idle", 1, 10, []step{
			{t: t0, n: 10, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 1, ok: true, remaining: 9},
		}},
		{"huge values", 1e-6, 1000, []step{ // a token per 11.6 days; 31.7 years to refill
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 4, ok: false, remaining: 3.6, wait: 400000 * time.Second},
		}},
		{"whole burst at a rate of odd token time", 7, 7, []step{
			{t: t0, n: 1, ok: true, remaining: 6}, {t: t0, n: 1, ok: true, remaining: 5},
			{t: t0, n: 1, ok: true, remaining: 4}, {t: t0, n: 1, ok: true, remaining: 3},
			{t: t0, n: 1, ok: true, remaining: 2}, {t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 142857143},
		}},
		{"fast rate", 1e9, 1000, []step{
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(time.Microsecond), n: 1000, ok: true, remaining: 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runSteps(t, newLimit(tt.rate, tt.burst), tt.steps)
		})
	}
}

// A long run at the limit must allow exactly burst + rate·elapsed, with no
// drift from the rounding of fractional token intervals.
func TestBucketNoDrift(t *testing.T) {
	for _, rate := range []float64{3, 7, 1.0 / 3, 1000.0 / 7} {
		l := newLimit(rate, 5)
		cost := l.costTime(1)
		var f time.Duration
		allowed := 0
		const elapsed = 1000 * time.Second
		step := time.Duration(float64(time.Second) / rate / 10) // 10 tries per token
		for now := time.Duration(0); now <= elapsed; now += step {
			var ok bool
			if f, ok = l.take(f, now, cost); ok {
				allowed++
			}
		}
		want := 5 + rate*elapsed.Seconds()
		if math.Abs(float64(allowed)-want) > 1 {
			t.Errorf("rate %v: allowed %d in %v, want %.1f ± 1", rate, allowed, elapsed, want)
		}
	}
}

func TestNewLimitMaxBurstTime(t *testing.T) {
	// The largest bucket the configuration accepts must not overflow.
	l := newLimit(1.0/86400, 36500) // one a day, burst of 100 years
	if l.burstTime <= 0 || l.burstTime > maxBurstTime {
		t.Fatalf("burstTime = %v", l.burstTime)
	}
	f, ok := l.take(0, math.MaxInt64/4, l.costTime(36500))
	if !ok || f <= 0 {
		t.Fatalf("take at a far instant: f = %d, ok = %v", f, ok)
	}
}

// A bucket keeps its instant when its key's plan changes: under a smaller
// limit it owes at most that limit's whole bucket, from the change on,
// and refills at the new rate; under a larger one it keeps its debt, in
// time.
func TestBucketPlanChange(t *testing.T) {
	free, pro := newLimit(1, 2), newLimit(60, 5) // full in 2s; in 83.3ms
	var f time.Duration
	take := func(l limit, now time.Duration, want bool) {
		t.Helper()
		var ok bool
		if f, ok = l.take(f, now, l.costTime(1)); ok != want {
			t.Fatalf("at %v: ok = %v, want %v", now, ok, want)
		}
	}
	take(free, 0, true)
	take(free, 0, true)
	take(free, 0, false) // free is empty: full at 2s
	// Now pro: clamped to pro's whole bucket, from now on.
	take(pro, 0, false)
	if f != pro.burstTime {
		t.Fatalf("after the change the bucket is full at %v, want %v", f, pro.burstTime)
	}
	take(pro, pro.tokenTime-1, false)
	take(pro, pro.tokenTime, true) // a token at pro's rate, not after free's 2s
	if d := pro.debt(f, pro.tokenTime); d != pro.burstTime {
		t.Fatalf("debt %v, want a whole pro bucket", d)
	}
	// Back to free: the debt carries over as is (83.3ms of 2s: 1.9 tokens).
	if got := free.wholeTokens(free.debt(f, pro.tokenTime)); got != 1 {
		t.Fatalf("free has %d whole tokens after the change, want 1", got)
	}
	take(free, pro.tokenTime, true)
	take(free, pro.tokenTime, false)
}

// A change of a key's own limit keeps the tokens it had spent: the
// examples of the docs, a change of rate alone, and a ban's excess.
func TestBucketRetune(t *testing.T) {
	tokens := func(l limit, fullAt time.Duration) float64 { return l.tokens(l.debt(fullAt, 0)) }
	two, ten := newLimit(1, 2), newLimit(1, 10)
	// Emptied at burst 2, raised to 10: 8 tokens at once.
	if got := tokens(ten, ten.retune(two.burstTime, 0, two)); got != 8 {
		t.Fatalf("burst 2 emptied, then 10: %v tokens, want 8", got)
	}
	// Back to 2 from 10 owing 8: it held 2, up to the burst of 2.
	if got := tokens(two, two.retune(8*time.Second, 0, ten)); got != 2 {
		t.Fatalf("burst 10 holding 2, then 2: %v tokens, want 2", got)
	}
	// 50 of 100 left, lowered to 10: 10 (the tokens it had, up to its burst).
	hundred, ten10 := newLimit(10, 100), newLimit(10, 10)
	if got := tokens(ten10, ten10.retune(5*time.Second, 0, hundred)); got != 10 {
		t.Fatalf("burst 100 holding 50, then 10: %v tokens, want 10", got)
	}
	// 95 spent of 100, lowered to 10: 5 tokens.
	if got := tokens(ten10, ten10.retune(9500*time.Millisecond, 0, hundred)); got != 5 {
		t.Fatalf("burst 100 holding 5, then 10: %v tokens, want 5", got)
	}
	// A change of rate alone keeps the tokens: 4 of 10 at 1r/s are 4 of
	// 10 at 10r/s, and back.
	fast := newLimit(10, 10)
	if got := tokens(fast, fast.retune(6*time.Second, 0, ten)); got != 4 {
		t.Fatalf("4 tokens at 1r/s, then 10r/s: %v tokens, want 4", got)
	}
	if got := tokens(ten, ten.retune(600*time.Millisecond, 0, fast)); got != 4 {
		t.Fatalf("4 tokens at 10r/s, then 1r/s: %v tokens, want 4", got)
	}
	// What a bucket owed beyond its whole bucket (a ban) is owed as it was.
	banned := two
	banned.ban = time.Hour
	if got := ten.retune(two.burstTime+time.Hour, 0, banned); got != 2*time.Second+time.Hour {
		t.Fatalf("banned, then burst 10: full at %v, want the ban and 2 tokens", got)
	}
	// The same limit, and a full bucket, change nothing.
	if got := ten.retune(3*time.Second, 0, ten); got != 3*time.Second {
		t.Fatalf("same limit: %v", got)
	}
	if got := ten.retune(-time.Second, 0, two); got != -time.Second {
		t.Fatalf("a full bucket: %v", got)
	}
}

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
// as this test does.
func TestResetWithinARefill(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, `{"zones":[{"name":"quick-reset","rate":"4r/s","burst":1,"ban":"5m"}],"store":`+storeJSON(r.Addr())+`}`)
	const ip = "198.51.100.40"
	if code, _ := serve(h, ip); code != 200 {
		t.Fatalf("first request: %d", code)
	}
	for range 3 { // banned, and the over-limit cache knows it
		if code, hdr := serve(h, ip); code != 429 || hdr.Get("Retry-After") != "301" {
			t.Fatalf("%d, Retry-After %q; want 429 and 301 (the ban and a token)", code, hdr.Get("Retry-After"))
		}
	}
	hash, field := bucketOf(h, 0, ip)
	if n := r.CLI("HDEL", hash, field); n != "1" {
		t.Fatalf("HDEL %s %s: %s", hash, field, n)
	}
	reset := time.Now()
	for {
		if code, _ := serve(h, ip); code == 200 {
			break
		}
		if time.Since(reset) > 2*time.Second {
			t.Fatal("still refused 2s after the reset")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A token of 4r/s refills in 250ms; a second is the cap.
	if back := time.Since(reset); back > 600*time.Millisecond {
		t.Fatalf("the reset was honoured after %v, want within a token's refill (250ms)", back)
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
				strings.Replace(storeJSON(addrs...), "}", `,"timeout":"2s"}`, 1)+`}`)
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

// The longest ban after the longest refill, 100 years each: a banned
// bucket owes 200 years, and a take of a whole bucket on it, 300 years,
// passes the 292 years a time.Duration holds. It is refused all the same,
// with the wait of the ban and the refill, and a charge on it leaves it
// owing what it owed, never full.
func TestBucketLongestBan(t *testing.T) {
	l := newLimit(1/maxBurstTime.Seconds(), 1)
	l.ban = maxBurstTime
	cost := l.costTime(1)
	f, ok := l.take(0, 0, cost)
	if !ok {
		t.Fatal("the first take was refused")
	}
	if f, ok = l.take(f, time.Second, cost); ok || f != time.Second+2*maxBurstTime {
		t.Fatalf("the take that bans: %v, full at %v; want refused, full at %v", ok, f, time.Second+2*maxBurstTime)
	}
	for _, now := range []time.Duration{time.Second, time.Hour, maxBurstTime} { // banned throughout
		nf, ok := l.take(f, now, cost)
		if ok || nf != f {
			t.Fatalf("at %v: %v, full at %v; want refused, the bucket as it was (%v)", now, ok, nf, f)
		}
		debt := l.debt(f, now)
		if w, next := l.wait(debt, cost), l.nextToken(debt); w != f-now || next != f-now {
			t.Fatalf("at %v: wait %v, next token in %v; want both %v", now, w, next, f-now)
		}
	}
	if got := l.adjust(f, time.Second, cost); got != f {
		t.Fatalf("a charge on the banned bucket leaves it full at %v, want %v: it owes all it may", got, f)
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

// When a request gives up waiting for the calls in flight for its bucket,
// the floor that fail_mode local decides it by counts their tokens, up to
// what the bucket may owe: for the longest ban, the calls' costs on top
// of it would pass a time.Duration.
func TestLongestBanFloor(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, `{"zones":[{"name":"longest-floor","key":"static","rate":"1/876000h","burst":1,"ban":"876000h"}],"store":`+storeJSON(r.Addr())+`}`)
	for i, want := range []int{http.StatusOK, http.StatusTooManyRequests} { // the second bans
		if code, _ := serve(h, "192.0.2.1"); code != want {
			t.Fatalf("request %d: %d, want %d", i, code, want)
		}
	}
	rs, z := h.store.(*RedisStore), h.Zones[0]
	b := bucketReq(z, bucketKey{s: "static"})
	k := flightKey{z.index, rs.zones[z.index].cache.hash(b.key)}
	rs.flights.join(k, 10)
	rs.flights.join(k, 10)
	if got, most := rs.known(time.Now(), &b, errNoAnswer), z.limit.most(); got != most {
		t.Fatalf("floor %v, want %v: all the bucket may owe", got, most)
	}
}

// A sum of durations past what a time.Duration holds is the longest one,
// in whole seconds, and rounds up to seconds without wrapping around.
func TestAddSat(t *testing.T) {
	for _, tc := range []struct{ a, b, want time.Duration }{
		{time.Second, time.Second, 2 * time.Second},
		{time.Second, -2 * time.Second, -time.Second},
		{2 * maxBurstTime, maxBurstTime, maxDuration},
		{maxDuration, 1, maxDuration},
		{math.MaxInt64, math.MaxInt64, maxDuration},
	} {
		if got := addSat(tc.a, tc.b); got != tc.want {
			t.Errorf("addSat(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
	if got := ceilSeconds(maxDuration - 1); got != int64(maxDuration/time.Second) {
		t.Errorf("ceilSeconds(maxDuration-1) = %d, want %d", got, maxDuration/time.Second)
	}
}
