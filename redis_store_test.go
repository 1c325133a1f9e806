// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math"
	"math/big"
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The zones of the shared step table: a 10r/s burst 3; b 1r/s burst 2;
// c 2r/s burst 4, two tokens a request; d 7r/s burst 7; e 1r/s burst 2
// with a ban of 10s; q a quota of 3 alone; r 1r/s burst 2 with a quota
// of 3. The quotas' windows are 100s long in the steps (stepQuotaWindow),
// and a step's quota is its zone's letter in upper case: "rR" is zone
// r's bucket and quota.
const stepZones = `[
	{"name":"a","rate":"10r/s","burst":3},
	{"name":"b","rate":"1r/s","burst":2},
	{"name":"c","rate":"2r/s","burst":4,"cost":2},
	{"name":"d","rate":"7r/s","burst":7},
	{"name":"e","rate":"1r/s","burst":2,"ban":"10s"},
	{"name":"q","quota":3,"quota_period":"day"},
	{"name":"r","rate":"1r/s","burst":2,"quota":3,"quota_period":"month","timezone":"Europe/Paris"}]`

// stepQuotaWindow is the length of the quotas' windows in the steps,
// which start at a window's start.
const stepQuotaWindow = 100 * time.Second

type storeStep struct {
	at    time.Duration // since the table's start
	key   string
	zones string // which zones the request matches, e.g. "ab"
	ok    bool
	rem   []int64 // whole tokens left per zone, after the decision
	ban   string  // the zones whose ban the step started
}

var storeSteps = []storeStep{
	{0, "k", "a", true, []int64{2}, ""},
	{0, "k", "a", true, []int64{1}, ""},
	{0, "k", "a", true, []int64{0}, ""},
	{0, "k", "a", false, []int64{0}, ""},
	{100 * time.Millisecond, "k", "a", true, []int64{0}, ""},
	// a is empty: b must not be charged.
	{100 * time.Millisecond, "k", "ab", false, []int64{0, 2}, ""},
	{100 * time.Millisecond, "k", "b", true, []int64{1}, ""},
	{100 * time.Millisecond, "k", "b", true, []int64{0}, ""},
	// b is empty: a must not be charged.
	{300 * time.Millisecond, "k", "ab", false, []int64{2, 0}, ""},
	{300 * time.Millisecond, "k", "a", true, []int64{1}, ""},
	{300 * time.Millisecond, "k", "c", true, []int64{2}, ""},
	{300 * time.Millisecond, "k", "c", true, []int64{0}, ""},
	{800 * time.Millisecond, "k", "c", false, []int64{1}, ""},
	{1300 * time.Millisecond, "k", "c", true, []int64{0}, ""},
	{1300 * time.Millisecond, "j", "abc", true, []int64{2, 1, 2}, ""},
	{1300 * time.Millisecond, "j", "abc", true, []int64{1, 0, 0}, ""},
	{1300 * time.Millisecond, "j", "abc", false, []int64{1, 0, 0}, ""},
	{100 * time.Second, "k", "abc", true, []int64{2, 1, 2}, ""},
	// A whole burst at once, though a token is not a whole number of µs.
	{0, "k", "d", true, []int64{6}, ""},
	{0, "k", "d", true, []int64{5}, ""},
	{0, "k", "d", true, []int64{4}, ""},
	{0, "k", "d", true, []int64{3}, ""},
	{0, "k", "d", true, []int64{2}, ""},
	{0, "k", "d", true, []int64{1}, ""},
	{0, "k", "d", true, []int64{0}, ""},
	{0, "k", "d", false, []int64{0}, ""},
	{142 * time.Millisecond, "k", "d", false, []int64{0}, ""},
	{143 * time.Millisecond, "k", "d", true, []int64{0}, ""},
	// A denial in e bans the key for 10s; denials during the ban start no
	// other, and spend nothing in the request's other zones.
	{200 * time.Second, "b", "e", true, []int64{1}, ""},
	{200 * time.Second, "b", "e", true, []int64{0}, ""},
	{200 * time.Second, "b", "e", false, []int64{0}, "e"},
	{205 * time.Second, "b", "e", false, []int64{0}, ""},
	{205 * time.Second, "b", "ae", false, []int64{3, 0}, ""},
	{209900 * time.Millisecond, "b", "e", false, []int64{0}, ""},
	// Then the bucket refills from empty: a token a second.
	{211 * time.Second, "b", "e", true, []int64{0}, ""},
	{211 * time.Second, "b", "e", false, []int64{0}, "e"},
	// A request that another zone denies starts e's ban only if e denies
	// it too.
	{300 * time.Second, "c", "ae", true, []int64{2, 1}, ""},
	{300 * time.Second, "c", "ae", true, []int64{1, 0}, ""},
	{300 * time.Second, "c", "ae", false, []int64{1, 0}, "e"},
	{300 * time.Second, "c", "a", true, []int64{0}, ""},
	// A quota counts per window, and a request it refuses takes no
	// tokens from the request's buckets.
	{0, "q", "Q", true, []int64{2}, ""},
	{0, "q", "Q", true, []int64{1}, ""},
	{0, "q", "aQ", true, []int64{2, 0}, ""},
	{0, "q", "aQ", false, []int64{2, 0}, ""},
	{0, "q", "a", true, []int64{1}, ""},
	{99 * time.Second, "q", "Q", false, []int64{0}, ""},
	// The next window starts from 0.
	{100 * time.Second, "q", "Q", true, []int64{2}, ""},
	{150 * time.Second, "q", "Q", true, []int64{1}, ""},
	{250 * time.Second, "q", "Q", true, []int64{2}, ""},
	// A request a bucket refuses is not counted.
	{0, "p", "a", true, []int64{2}, ""},
	{0, "p", "a", true, []int64{1}, ""},
	{0, "p", "a", true, []int64{0}, ""},
	{0, "p", "aQ", false, []int64{0, 3}, ""},
	{0, "p", "Q", true, []int64{2}, ""},
	// A zone with a rate and a quota: both apply, all or nothing.
	{0, "r", "rR", true, []int64{1, 2}, ""},
	{0, "r", "rR", true, []int64{0, 1}, ""},
	{0, "r", "rR", false, []int64{0, 1}, ""},
	{time.Second, "r", "rR", true, []int64{0, 0}, ""},
	{2 * time.Second, "r", "rR", false, []int64{1, 0}, ""},
	{2 * time.Second, "r", "r", true, []int64{0}, ""},
	{3 * time.Second, "r", "rRbQ", false, []int64{1, 0, 2, 3}, ""},
	{3 * time.Second, "r", "bQ", true, []int64{1, 2}, ""},
}

// runStoreSteps replays storeSteps against h's store, with the store's
// clock replaced by the steps' instants.
func runStoreSteps(t *testing.T, h *Handler) {
	t.Helper()
	// The steps start at the start of a quota window, in the future:
	// Redis expires a quota's counter at its window's end by its own
	// clock.
	start := time.Unix(time.Now().Add(stepQuotaWindow).Unix()/100*100, 0)
	var now time.Time
	if rs, ok := h.store.(*RedisStore); ok {
		rs.testClock = func() time.Time { return now }
	}
	zones := map[byte]*Zone{}
	for _, z := range h.Zones {
		zones[z.Name[len(z.Name)-1]] = z
		if z.quota != nil {
			z.quota.every = stepQuotaWindow
		}
	}
	for i, s := range storeSteps {
		now = start.Add(s.at)
		var reqs []request
		for _, c := range []byte(s.zones) {
			if c >= 'A' && c <= 'Z' {
				z := zones[c-'A'+'a']
				reqs = append(reqs, request{zone: z, key: bucketKey{s: s.key}, win: z.quota.window(now)})
				continue
			}
			reqs = append(reqs, request{zone: zones[c], key: bucketKey{s: s.key}})
		}
		ok, err := h.store.take(context.Background(), now, reqs)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if ok != s.ok {
			t.Fatalf("step %d: allowed = %v, want %v", i, ok, s.ok)
		}
		for j := range reqs {
			q := &reqs[j]
			if got := q.remaining(); got != s.rem[j] {
				t.Fatalf("step %d: zone %s has %d tokens left, want %d", i, q.zone.Name, got, s.rem[j])
			}
			if want := strings.IndexByte(s.ban, s.zones[j]) >= 0; q.ban != want {
				t.Fatalf("step %d: zone %s started a ban: %v, want %v", i, q.zone.Name, q.ban, want)
			}
			if q.ban && q.wait() != q.zone.limit.ban+q.zone.costTime {
				t.Fatalf("step %d: zone %s: wait %v after a ban started, want the ban and a token", i, q.zone.Name, q.wait())
			}
			// A quota that counts waits for its window's end (Redis
			// counts in whole milliseconds, its over-limit cache a
			// millisecond less).
			if q.isQuota() && q.used > 0 {
				if want := q.win.end.Sub(now); q.debt > want || q.debt <= want-2*time.Millisecond {
					t.Fatalf("step %d: zone %s's quota: %v to its window's end, want %v", i, q.zone.Name, q.debt, want)
				}
			}
		}
	}
}

// One table of steps gives the same decisions on every store.
func TestStoresAgree(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		runStoreSteps(t, newTestHandler(t, `{"zones":`+strings.ReplaceAll(stepZones, `"name":"`, `"name":"agree-`)+`}`))
	})
	r := startRedis(t)
	for _, store := range []string{`,"disable_over_limit_cache":true`, ``} {
		t.Run("redis"+store, func(t *testing.T) {
			h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"key_prefix":%q%s}}`,
				stepZones, r.addr(), t.Name()+":", store))
			runStoreSteps(t, h)
		})
	}
	t.Run("cluster", func(t *testing.T) {
		nodes := startCluster(t)
		h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q,%q,%q],"disable_over_limit_cache":true}}`,
			stepZones, nodes[0].addr(), nodes[1].addr(), nodes[2].addr()))
		runStoreSteps(t, h)
	})
}

func TestRedisKeysAndTTL(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "ttl", "7r/s", 5, ""))
	if code, _ := serve(h, "192.0.2.7"); code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	c := newRedisClient(t, r.addr())
	ctx := context.Background()
	key := "t:ttl:{192.0.2.7}"
	ttl, err := c.PTTL(ctx, key).Result()
	if err != nil || ttl <= 0 || ttl > 143*time.Millisecond {
		t.Fatalf("PTTL %s = %v, %v; want about 143ms (one token's refill)", key, ttl, err)
	}
	// Fractions survive the trip through Lua: the stored instant is not
	// truncated to whole microseconds' worth of tokens.
	v, err := c.Get(ctx, key).Float64()
	if err != nil || v < 5e13 || v == math.Trunc(v) {
		t.Fatalf("stored instant %v, %v", v, err)
	}
	time.Sleep(ttl + 20*time.Millisecond)
	if n, _ := c.Exists(ctx, key).Result(); n != 0 {
		t.Fatal("key outlived its bucket's refill")
	}

	// IPv6 clients are grouped by /64, and hash_keys hides the address.
	h = newTestHandler(t, redisConfig(r.addr(), "v6", "10r/s", 5, `,"hash_keys":true`))
	serve(h, "2001:db8::1")
	keys, _ := c.Keys(ctx, "t:v6:*").Result()
	if len(keys) != 1 || strings.Contains(keys[0], "2001") || len(keys[0]) != len("t:v6:{}")+32 {
		t.Fatalf("keys %v: want one hashed key", keys)
	}
	serve(h, "2001:db8::2:3")
	if keys, _ := c.Keys(ctx, "t:v6:*").Result(); len(keys) != 1 {
		t.Fatalf("keys %v: one /64 must share one bucket", keys)
	}
}

// SCRIPT FLUSH (or a restart) empties Redis's script cache: the next
// decision loads the script again and goes on where it left off.
func TestRedisScriptFlush(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "flush", "1r/m", 4, ""))
	for i := range 2 {
		if code, hdr := serve(h, "192.0.2.1"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != fmt.Sprint(3-i) {
			t.Fatalf("request %d: %d, remaining %s", i, code, hdr.Get("X-Ratelimit-Remaining"))
		}
	}
	r.cli("SCRIPT", "FLUSH")
	if code, hdr := serve(h, "192.0.2.1"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != "1" {
		t.Fatalf("after SCRIPT FLUSH: %d, remaining %s", code, hdr.Get("X-Ratelimit-Remaining"))
	}
}

// Three handlers with their own clients, like three Caddy instances,
// hammer one key: together they get exactly the bucket's tokens.
func TestRedisSharedLimitIsExact(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := startRedis(t)
	for _, skew := range []bool{false, true} {
		t.Run(fmt.Sprintf("skewed clocks %v", skew), func(t *testing.T) {
			const rate, burst = 50.0, 20
			var handlers []*Handler
			for i := range 3 {
				// Distinct pool sizes give distinct clients.
				handlers = append(handlers, newTestHandler(t, redisConfig(r.addr(), "exact", "50r/s", burst,
					fmt.Sprintf(`,"pool_size":%d,"key_prefix":"%s:","timeout":"5s"`, 10+i, t.Name()))))
			}
			var allowed atomic.Int64
			var wg sync.WaitGroup
			start := time.Now()
			const run = 3 * time.Second
			for i, h := range handlers {
				// Each instance sees its own clock; only the over-limit
				// cache uses it, and only as a local time line.
				offset := time.Duration(0)
				if skew {
					offset = time.Duration(i-1) * time.Hour
				}
				for range 4 {
					wg.Go(func() {
						for time.Since(start) < run {
							reqs := []request{{zone: h.Zones[0], key: bucketKey{s: "hot"}}}
							ok, err := h.store.take(context.Background(), time.Now().Add(offset), reqs)
							if err != nil {
								t.Error(err)
								return
							}
							if ok {
								allowed.Add(1)
							}
						}
					})
				}
			}
			wg.Wait()
			elapsed := time.Since(start).Seconds()
			most := burst + rate*elapsed + 1
			got := float64(allowed.Load())
			t.Logf("allowed %v in %.2fs; the bucket gave at most %.0f", got, elapsed, most)
			if got > most || got < 0.9*most {
				t.Fatalf("allowed %v, want at most %.0f and not far below", got, most)
			}
		})
	}
}

// Under a flood on one key, the over-limit cache leaves Redis about one
// call per token, where without it every request is a call.
func TestRedisOverLimitCache(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := startRedis(t)
	for _, cached := range []bool{true, false} {
		t.Run(fmt.Sprintf("cache %v", cached), func(t *testing.T) {
			store := fmt.Sprintf(`,"key_prefix":"%s:"`, t.Name())
			if !cached {
				store += `,"disable_over_limit_cache":true`
			}
			h := newTestHandler(t, redisConfig(r.addr(), "flood", "10r/s", 20, store))
			before := r.calls()
			// 2000 requests a second for 2 seconds.
			var ok, denied, wrongRetry int
			tick := time.NewTicker(500 * time.Microsecond)
			defer tick.Stop()
			start := time.Now()
			for time.Since(start) < 2*time.Second {
				<-tick.C
				code, hdr := serve(h, "198.51.100.1")
				switch code {
				case http.StatusOK:
					ok++
				case http.StatusTooManyRequests:
					denied++
					if hdr.Get("Retry-After") != "1" {
						wrongRetry++
					}
				default:
					t.Fatalf("status %d", code)
				}
			}
			calls := r.calls() - before
			elapsed := time.Since(start).Seconds()
			t.Logf("%d allowed, %d denied, %d Redis calls in %.2fs", ok, denied, calls, elapsed)
			if most := 20 + 10*elapsed + 1; float64(ok) > most || float64(ok) < most-5 {
				t.Fatalf("allowed %d, want about %.0f", ok, most)
			}
			if wrongRetry > 0 {
				t.Fatalf("%d denials without Retry-After: 1", wrongRetry)
			}
			if cached && calls > 2*ok {
				t.Fatalf("%d Redis calls for %d allowed requests: the cache is not sparing Redis", calls, ok)
			}
			if !cached && calls != ok+denied {
				t.Fatalf("%d Redis calls for %d requests", calls, ok+denied)
			}
		})
	}
}

// Each fail_mode does what it promises while Redis is down or frozen, no
// request waits much longer than the timeout, and limiting goes back to
// Redis as soon as it answers again.
func TestRedisFailModes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	const timeout = 50 * time.Millisecond
	for _, mode := range []string{"local", "open", "closed"} {
		t.Run(mode, func(t *testing.T) {
			r := startRedis(t)
			h := newTestHandler(t, redisConfig(r.addr(), "fail-"+mode, "1r/m", 3,
				fmt.Sprintf(`,"fail_mode":%q,"timeout":%d`, mode, timeout)))
			ip := "203.0.113.1"
			if code, _ := serve(h, ip); code != http.StatusOK {
				t.Fatalf("with Redis up: %d", code)
			}

			for _, outage := range []string{"killed", "frozen"} {
				if outage == "killed" {
					r.kill()
				} else {
					r.pause()
				}
				var codes []int
				var slowest time.Duration
				for range 6 {
					start := time.Now()
					code, hdr := serve(h, ip)
					slowest = max(slowest, time.Since(start))
					codes = append(codes, code)
					if code == http.StatusServiceUnavailable && hdr.Get("Retry-After") == "" {
						t.Fatal("503 without Retry-After")
					}
				}
				if slowest > timeout+100*time.Millisecond {
					t.Fatalf("%s: a request waited %v with timeout %v", outage, slowest, timeout)
				}
				var want []int
				switch mode {
				case "local": // fresh local buckets of 3
					want = []int{200, 200, 200, 429, 429, 429}
				case "open":
					want = []int{200, 200, 200, 200, 200, 200}
				case "closed":
					want = []int{503, 503, 503, 503, 503, 503}
				}
				if mode == "local" && outage == "frozen" {
					want = []int{429, 429, 429, 429, 429, 429} // same local buckets
				}
				if fmt.Sprint(codes) != fmt.Sprint(want) {
					t.Fatalf("Redis %s: statuses %v, want %v", outage, codes, want)
				}
				if outage == "killed" {
					r.start()
				} else {
					r.resume()
				}
			}

			// Back: Redis decides again within the breaker's backoff.
			deadline := time.Now().Add(3 * time.Second)
			c := newRedisClient(t, r.addr())
			for {
				serve(h, "203.0.113.99")
				if n, _ := c.Exists(context.Background(), "t:fail-"+mode+":{203.0.113.99}").Result(); n == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("limiting did not return to Redis")
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// A key of another type under the store's prefix is the store's to
// repair: the next decision overwrites it, and it never trips the
// circuit breaker (before, each was a store error, and three opened the
// breaker for every client).
func TestRedisWrongTypeKeyRepaired(t *testing.T) {
	r := startRedis(t)
	c := newRedisClient(t, r.addr())
	h := newTestHandler(t, redisConfig(r.addr(), "bad", "1r/m", 1, `,"fail_mode":"closed"`))
	for i := range 2 * tripAfter {
		ip := fmt.Sprintf("192.0.2.%d", 10+i)
		c.HSet(context.Background(), "t:bad:{"+ip+"}", "x", "1")
		codes := fmt.Sprint(statusOnly(serve(h, ip)), statusOnly(serve(h, ip)))
		if codes != "200 429" {
			t.Fatalf("key %d of the wrong type: %s, want 200 429 (the bucket repaired, then empty)", i, codes)
		}
		if typ := r.cli("TYPE", "t:bad:{"+ip+"}"); typ != "string" {
			t.Fatalf("key %d: type %s after a decision, want string", i, typ)
		}
	}
	if h.store.(*RedisStore).client.breaker.open() {
		t.Fatal("keys of the wrong type opened the circuit breaker")
	}
	// A value that is not an instant is a full bucket too.
	c.Set(context.Background(), "t:bad:{192.0.2.99}", "garbage", 0)
	if codes := fmt.Sprint(statusOnly(serve(h, "192.0.2.99")), statusOnly(serve(h, "192.0.2.99"))); codes != "200 429" {
		t.Fatalf("garbage value: %s, want 200 429", codes)
	}
}

// Only errors that say Redis cannot serve count toward the breaker; an
// error reply about one call's keys says Redis is up.
func TestClassifyRedisErrors(t *testing.T) {
	r := startRedis(t)
	c := newRedisClient(t, r.addr())
	ctx := context.Background()
	reply := func(msg string) error {
		return c.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, msg).Err()
	}
	c.HSet(ctx, "h", "x", "1")
	closed := redis.NewClient(&redis.Options{Addr: r.addr()})
	closed.Close()
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer down.Close()
	for _, tc := range []struct {
		name string
		err  error
		want int
	}{
		{"WRONGTYPE", c.Get(ctx, "h").Err(), errAnswered},
		{"CROSSSLOT", reply("CROSSSLOT Keys in request don't hash to the same slot"), errAnswered},
		{"script error", c.Eval(ctx, "return redis.call('NOPE')", nil).Err(), errAnswered},
		{"bad reply", fmt.Errorf("%w: x", errBadReply), errAnswered},
		{"LOADING", reply("LOADING Redis is loading the dataset in memory"), errOutage},
		{"MASTERDOWN", reply("MASTERDOWN Link with MASTER is down"), errOutage},
		{"READONLY", reply("READONLY You can't write against a read only replica."), errOutage},
		{"OOM", reply("OOM command not allowed when used memory > 'maxmemory'."), errOutage},
		{"WRONGPASS", reply("WRONGPASS invalid username-password pair"), errOutage},
		{"dial", down.Ping(ctx).Err(), errOutage},
		{"timeout", context.DeadlineExceeded, errOutage},
		{"closed client", closed.Ping(ctx).Err(), errUnknown},
		{"pool timeout", fmt.Errorf("wrapped: %w", redis.ErrPoolTimeout), errUnknown},
	} {
		if tc.err == nil {
			t.Fatalf("%s: no error to classify", tc.name)
		}
		if got := classify(tc.err); got != tc.want {
			t.Errorf("%s (%v): kind %d, want %d", tc.name, tc.err, got, tc.want)
		}
	}
}

// On a cluster, keys spread over the nodes, and a request denied in one
// slot gets back what it took in another.
func TestRedisCluster(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"ip","rate":"1r/m","burst":5},
		{"name":"user","key":"{http.request.header.X-User}","rate":"1r/m","burst":1}],
		"store":{"backend":"redis","addresses":[%q,%q,%q]}}`, nodes[0].addr(), nodes[1].addr(), nodes[2].addr()))
	for i := range 60 {
		if code, _ := serve(h, fmt.Sprintf("10.0.%d.1", i)); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	for _, n := range nodes {
		if keys := n.cli("DBSIZE"); keys == "0" {
			t.Fatalf("node %s holds no keys: keys did not spread over slots", n.addr())
		}
	}

	// The user zone lives in another slot than the ip zone.
	ip := "10.1.0.1"
	if code, _ := serve(h, ip, "X-User", "alice"); code != http.StatusOK {
		t.Fatalf("first: %d", code)
	}
	code, hdr := serve(h, ip, "X-User", "alice")
	if code != http.StatusTooManyRequests {
		t.Fatalf("second: %d", code)
	}
	if got := hdr.Get("Ratelimit"); !strings.Contains(got, `"ip";r=4`) {
		t.Fatalf("RateLimit %q: the denied request kept tokens of zone ip", got)
	}
	if _, hdr := serve(h, ip); !strings.Contains(hdr.Get("Ratelimit"), `"ip";r=3`) {
		t.Fatalf("RateLimit %q: want 3 left in zone ip", hdr.Get("Ratelimit"))
	}
}

// Sentinel: after a failover the store follows the new master.
func TestRedisSentinelFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	master := startRedis(t)
	replica := startRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(master.port))
	sdir := t.TempDir()
	sport := freePort(t, 0)
	conf := writeFile(t, sdir, "sentinel.conf", fmt.Sprintf(
		"port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor mymaster 127.0.0.1 %d 1\n"+
			"sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n",
		sport, sdir, master.port))
	sentinel := &redisServer{t: t, port: sport, dir: sdir, args: []string{conf, "--sentinel"}}
	sentinel.start()
	t.Cleanup(sentinel.kill)
	waitFor(t, 10*time.Second, "replica in sync", func() bool {
		return strings.Contains(replica.cli("INFO", "replication"), "master_link_status:up")
	})

	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"s","rate":"1r/m","burst":10}],
		"store":{"backend":"redis","addresses":[%q],"sentinel":"mymaster","timeout":"200ms","fail_mode":"closed"}}`, sentinel.addr()))
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.50"); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	waitFor(t, 5*time.Second, "key replicated", func() bool {
		return replica.cli("EXISTS", "rl:s:{192.0.2.50}") == "1"
	})
	sentinel.cli("SENTINEL", "FAILOVER", "mymaster")
	waitFor(t, 15*time.Second, "failover", func() bool {
		return strings.Contains(replica.cli("INFO", "replication"), "role:master")
	})
	// The store reconnects to the new master; the bucket kept its state.
	waitFor(t, 10*time.Second, "store on new master", func() bool {
		code, hdr := serve(h, "192.0.2.50")
		return code == http.StatusOK && hdr.Get("X-Ratelimit-Remaining") != ""
	})
	if n := replica.cli("GET", "rl:s:{192.0.2.50}"); n == "" {
		t.Fatal("new master has no bucket")
	}
	// Three requests before the failover, at least two after: a bucket
	// that lost its state would have 9 left.
	_, hdr := serve(h, "192.0.2.50")
	if got, err := strconv.Atoi(hdr.Get("X-Ratelimit-Remaining")); err != nil || got > 5 {
		t.Fatalf("remaining %q after failover: the bucket lost its state", hdr.Get("X-Ratelimit-Remaining"))
	}
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The store talks TLS to a Redis that only speaks TLS, trusting the CA
// it is given, and refuses a server its CA did not sign.
func TestRedisTLS(t *testing.T) {
	requireRedis(t)
	dir := t.TempDir()
	caPEM, certPEM, keyPEM := testCertificates(t)
	ca := writeFile(t, dir, "ca.pem", caPEM)
	port := freePort(t, 0)
	r := &redisServer{t: t, port: port, dir: dir, args: []string{"--bind", "127.0.0.1", "--port", "0",
		"--tls-port", strconv.Itoa(port), "--tls-cert-file", writeFile(t, dir, "cert.pem", certPEM),
		"--tls-key-file", writeFile(t, dir, "key.pem", keyPEM), "--tls-ca-cert-file", ca,
		"--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", dir}}
	r.cmd = exec.Command("redis-server", r.args...)
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.kill)
	waitFor(t, 10*time.Second, "redis-server with TLS", func() bool {
		_, err := r.tryCLI("--tls", "--cacert", ca, "PING")
		return err == nil
	})

	h := newTestHandler(t, redisConfig(r.addr(), "tls", "1r/m", 1, fmt.Sprintf(`,"tls":{"ca":%q},"fail_mode":"closed"`, ca)))
	codes := fmt.Sprint(statusOnly(serve(h, "192.0.2.70")), statusOnly(serve(h, "192.0.2.70")))
	if codes != "200 429" {
		t.Fatalf("over TLS: %s, want 200 429", codes)
	}
	if out, _ := r.tryCLI("--tls", "--cacert", ca, "EXISTS", "t:tls:{192.0.2.70}"); out != "1" {
		t.Fatalf("the bucket is not in Redis: %q", out)
	}

	// Without the CA, the server is not trusted: Redis fails, fail_mode
	// closed answers 503.
	h = newTestHandler(t, redisConfig(r.addr(), "tls", "1r/m", 1, `,"tls":{},"fail_mode":"closed","pool_size":2`))
	if code, _ := serve(h, "192.0.2.71"); code != http.StatusServiceUnavailable {
		t.Fatalf("untrusted server: %d, want 503", code)
	}
	h = newTestHandler(t, redisConfig(r.addr(), "tls", "1r/m", 1, `,"tls":{"insecure_skip_verify":true},"fail_mode":"closed","pool_size":3`))
	if code, _ := serve(h, "192.0.2.72"); code != http.StatusOK {
		t.Fatalf("insecure_skip_verify: %d, want 200", code)
	}
}

func statusOnly(code int, _ http.Header) int { return code }

// testCertificates makes a CA and a certificate it signs for 127.0.0.1.
func testCertificates(t *testing.T) (caPEM, certPEM, keyPEM string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "redis"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
	}
	caCert, _ := x509.ParseCertificate(caDER)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	encode := func(typ string, b []byte) string { return string(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b})) }
	return encode("CERTIFICATE", caDER), encode("CERTIFICATE", der), encode("EC PRIVATE KEY", keyDER)
}

// Caddy cleans up a config's handlers while their requests still run. A
// request waiting on a hung Redis when its config is cleaned up (its
// client closed under it) finishes under fail_mode: no nil store, no
// panic, no race.
func TestRedisCleanupUnderRunningRequests(t *testing.T) {
	r := startRedis(t)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := new(Handler)
	if err := json.Unmarshal([]byte(redisConfig(r.addr(), "cleanup", "1r/m", 5, `,"timeout":"2s"`)), h); err != nil {
		t.Fatal(err)
	}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	serve(h, "192.0.2.90") // connected
	r.pause()
	defer r.resume()
	var wg sync.WaitGroup
	codes := make([]int, 20)
	for i := range codes {
		wg.Go(func() { codes[i], _ = serve(h, fmt.Sprintf("192.0.2.%d", 100+i)) })
	}
	time.Sleep(100 * time.Millisecond) // all waiting on Redis
	cancel()                           // the config goes: Cleanup closes the client
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusOK {
			t.Errorf("request %d: %d, want 200 from fail_mode local's fresh buckets", i, code)
		}
	}
	// A request that arrives after the cleanup is decided the same way.
	if code, _ := serve(h, "192.0.2.91"); code != http.StatusOK {
		t.Errorf("after cleanup: %d", code)
	}
}

// A flood on one key from many concurrent callers asks Redis about once
// per token, not once per caller: neither when the bucket is new (the
// first wave) nor each time the key's cached instant passes.
func TestRedisFloodAsksOncePerBucket(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "onceper", "10r/s", 20, `,"pool_size":64`))
	var allowed, total atomic.Int64
	var wg sync.WaitGroup
	callsBefore := r.calls()
	start := time.Now()
	const warmUp, run = 500 * time.Millisecond, 2500 * time.Millisecond
	for range 64 {
		wg.Go(func() {
			for time.Since(start) < run {
				if code, _ := serve(h, "198.51.100.7"); code == http.StatusOK {
					allowed.Add(1)
				}
				total.Add(1)
			}
		})
	}
	time.Sleep(warmUp)
	allowedWarm, callsWarm := allowed.Load(), r.calls()
	wg.Wait()
	calls := r.calls() - callsBefore
	steadyAllowed, steadyCalls := allowed.Load()-allowedWarm, r.calls()-callsWarm
	t.Logf("64 callers: %d requests, %d allowed, %d Redis calls; after the first %v: %d allowed, %d calls",
		total.Load(), allowed.Load(), calls, warmUp, steadyAllowed, steadyCalls)
	if most := 20 + 10*time.Since(start).Seconds() + 1; float64(allowed.Load()) > most {
		t.Fatalf("allowed %d, more than the bucket's %.0f", allowed.Load(), most)
	}
	// The first wave, on a bucket Redis has not seen, asks no more than
	// the burst at once.
	if int64(calls) > 3*allowed.Load() {
		t.Errorf("%d Redis calls for %d allowed requests: concurrent callers multiply the calls", calls, allowed.Load())
	}
	// Once steady, about one call a token: the cache counts from when the
	// last call was sent and Redis from when it ran, and the store waits
	// out a round trip past the cached instant before asking, so a call
	// only now and then comes early and finds the bucket short.
	if int64(steadyCalls) > 2*steadyAllowed+5 {
		t.Errorf("steady: %d Redis calls for %d allowed requests", steadyCalls, steadyAllowed)
	}
}

// fail_mode closed answers 503 with Retry-After: 1, written directly on a
// server without error routes (as Caddy would, minus its ERROR log line
// with the request's headers for every request of an outage), returned
// as an error where handle_errors is there to shape it, and counted as a
// store error, not as a denial.
func TestRedisFailClosedAnswers503(t *testing.T) {
	requireRedis(t)
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t, 0))
	h := newTestHandler(t, redisConfig(dead, "closed503", "1r/m", 5, `,"fail_mode":"closed","timeout":"50ms"`))
	for _, direct := range []bool{true, false} {
		h.writeRefusals = direct
		for range 4 {
			req, rr := newRequest("192.0.2.120")
			err := h.ServeHTTP(rr, req, okHandler)
			code := rr.Code
			if err != nil {
				code = statusOf(err)
			}
			if code != http.StatusServiceUnavailable || rr.Header().Get("Retry-After") != "1" {
				t.Fatalf("direct %t: %d, Retry-After %q; want 503, 1", direct, code, rr.Header().Get("Retry-After"))
			}
			if direct != (err == nil) {
				t.Fatalf("direct %t: error %v", direct, err)
			}
		}
	}
	st := h.Zones[0].state
	if got := fmt.Sprint(st.storeErrors.Load(), st.denied.Load(), st.allowed.Load()); got != "8 0 0" {
		t.Fatalf("store errors, denied, allowed = %s, want 8 0 0", got)
	}
}

// Options that go-redis refuses with a panic give an error instead: a
// panic there would leave the client pool's entry locked, and every later
// config load waiting on it.
func TestMakeRedisClientDoesNotPanic(t *testing.T) {
	c, err := makeRedisClient(&redis.UniversalOptions{Addrs: []string{"127.0.0.1:1"}, PoolSize: 1 << 40})
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
		goRedisLog.lines = throttle{}
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

// When a call fails, fail_mode local's bucket starts from what Redis last
// said of it: a client that emptied its bucket gets the tokens that came
// back since, not a fresh burst.
func TestRedisFailLocalStartsFromWhatRedisSaid(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.addr(), "carry", "2r/s", 3, `,"timeout":100000000`))
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.8"); code != http.StatusOK {
			t.Fatalf("request %d: %d, want 200", i, code)
		}
	}
	if code, _ := serve(h, "192.0.2.8"); code != http.StatusTooManyRequests {
		t.Fatalf("4th request: %d, want 429", code)
	}
	time.Sleep(600 * time.Millisecond) // one token back
	r.kill()
	allowed := 0
	for range 3 {
		if code, _ := serve(h, "192.0.2.8"); code == http.StatusOK {
			allowed++
		}
	}
	if allowed != 1 {
		t.Errorf("%d of 3 allowed while Redis is down, want the 1 token that came back", allowed)
	}
	// A client Redis never saw gets its whole burst from fail_mode local.
	allowed = 0
	for range 4 {
		if code, _ := serve(h, "192.0.2.9"); code == http.StatusOK {
			allowed++
		}
	}
	if allowed != 3 {
		t.Errorf("a new client: %d of 4 allowed, want its burst of 3", allowed)
	}
}

// Zone names hold any characters, yet a zone's keys never meet another
// zone's: the name ends where the hash tag's '{' starts, and a '{' in a
// name is escaped.
func TestRedisZoneNamesDoNotCollide(t *testing.T) {
	r := startRedis(t)
	config := func(zone, key string) string {
		return fmt.Sprintf(`{"rate_limits":{%q:{"key":%q,"window":"1m","max_events":1}},
			"store":{"backend":"redis","addresses":[%q],"key_prefix":"t:"}}`, zone, key, r.addr())
	}
	a := newTestHandler(t, config("api:v1", "k"))
	b := newTestHandler(t, config("api", "v1:k"))
	c := newTestHandler(t, config("api{v1", "k"))
	if code, _ := serve(a, "192.0.2.1"); code != http.StatusOK {
		t.Fatalf("zone api:v1: status %d", code)
	}
	if code, _ := serve(a, "192.0.2.1"); code != http.StatusTooManyRequests {
		t.Fatalf("zone api:v1: second request: status %d, want 429", code)
	}
	for _, h := range []*Handler{b, c} {
		if code, _ := serve(h, "192.0.2.1"); code != http.StatusOK {
			t.Errorf("zone %s: status %d: it shares api:v1's bucket", h.Zones[0].Name, code)
		}
	}
	keys, _ := newRedisClient(t, r.addr()).Keys(context.Background(), "t:*").Result()
	slices.Sort(keys)
	if want := []string{"t:api%7Bv1:{k}", "t:api:v1:{k}", "t:api:{v1:k}"}; !slices.Equal(keys, want) {
		t.Errorf("keys %q, want %q", keys, want)
	}
}

// Concurrent decisions share pipelined batches: each still gets its own
// exact answer, also right after a SCRIPT FLUSH (the batch's calls find no
// script and are sent again with it), on one Redis and on a cluster.
func TestRedisPipelinedDecisionsAreExact(t *testing.T) {
	single := startRedis(t)
	nodes := startCluster(t)
	for _, tc := range []struct {
		name  string
		addrs []string
		flush func()
	}{
		{"standalone", []string{single.addr()}, func() { single.cli("SCRIPT", "FLUSH") }},
		{"cluster", []string{nodes[0].addr(), nodes[1].addr(), nodes[2].addr()}, func() {
			for _, n := range nodes {
				n.cli("SCRIPT", "FLUSH")
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addrs, _ := json.Marshal(tc.addrs)
			h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"pipe","rate":"1r/h","burst":10}],
				"store":{"backend":"redis","addresses":%s,"cluster":%v,"pool_size":4,"timeout":"5s","disable_over_limit_cache":true}}`,
				addrs, tc.name == "cluster"))
			const keys, callers, tries = 20, 64, 40
			for round := range 2 {
				tc.flush()
				var allowed [keys]atomic.Int64
				var wg sync.WaitGroup
				for c := range callers {
					wg.Go(func() {
						for i := range tries {
							k := (c + i) % keys
							reqs := []request{{zone: h.Zones[0], key: bucketKey{s: fmt.Sprintf("r%d-k%d", round, k)}}}
							ok, err := h.store.take(context.Background(), time.Now(), reqs)
							if err != nil {
								t.Error(err)
								return
							}
							if ok {
								allowed[k].Add(1)
							}
						}
					})
				}
				wg.Wait()
				for k := range allowed {
					if n := allowed[k].Load(); n != 10 {
						t.Fatalf("round %d: key %d allowed %d times, want its burst of 10", round, k, n)
					}
				}
			}
		})
	}
}
