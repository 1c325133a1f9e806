// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/redis/go-redis/v9"
)

// provision provisions a handler from its JSON config, as a config load
// does, and returns it with what unloads it.
func provision(t *testing.T, config string) (*Handler, func()) {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := new(Handler)
	if err := json.Unmarshal([]byte(config), h); err != nil {
		t.Fatal(err)
	}
	if err := h.Provision(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	return h, func() {
		if err := h.Cleanup(); err != nil {
			t.Error(err)
		}
		cancel()
	}
}

// syncInstances are n handlers, each with its own Redis store on addr, as
// n Caddy instances would be: each its own connection pool (pool_size
// differs), so its own copies of the zones with sync.
func syncInstances(t *testing.T, addr, zones string, n int) []*Handler {
	t.Helper()
	hs := make([]*Handler, n)
	for i := range hs {
		hs[i] = newTestHandler(t, fmt.Sprintf(`{"zones":[%s],
			"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"t:","pool_size":%d}}`, zones, addr, 10+i))
	}
	return hs
}

// syncZone is a zone of rate 20r/s burst 40 keyed by X-Key, with sync
// when it is given.
func syncZoneJSON(name, sync string) string {
	if sync != "" {
		sync = fmt.Sprintf(`,"sync":%q`, sync)
	}
	return fmt.Sprintf(`{"name":%q,"key":"{http.request.header.X-Key}","rate":"20r/s","burst":40%s}`, name, sync)
}

// syncBound is the most the instances may allow beyond an exact zone of
// 20r/s with sync 100ms: (N - 1) x rate x interval, and a request each
// but one for rounding.
func syncBound(n int) int { return (n - 1) * (20*100/1000 + 1) }

// emptyEverywhere floods key on every instance until each refuses it.
func emptyEverywhere(t *testing.T, hs []*Handler, key string) {
	t.Helper()
	for i, h := range hs {
		waitFor(t, 5*time.Second, fmt.Sprintf("instance %d refusing %s", i, key), func() bool {
			code := 0
			for range 100 {
				code, _ = serve(h, "10.0.0.1", "X-Key", key)
			}
			return code == http.StatusTooManyRequests
		})
	}
}

// A request that a zone with sync and a zone without both limit is
// decided by Redis, all or nothing: a refusal of the exact zone charges
// the other nothing; and when Redis fails, fail_mode decides it.
func TestSyncWithExactZone(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[%s,{"name":"e","rate":"1r/m","burst":2}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"t:","fail_mode":"closed"}}`, syncZoneJSON("s", "100ms"), r.Addr()))
	for i, want := range []int{200, 200, 429, 429, 429} {
		if code, _ := serve(h, "10.0.0.1", "X-Key", "k"); code != want {
			t.Fatalf("request %d: %d, want %d", i, code, want)
		}
	}
	// Two of the sync zone's 40 tokens are spent: the refusals took none.
	_, hdr := serve(h, "10.0.0.2", "X-Key", "k")
	if got := hdr.Get("RateLimit"); !strings.Contains(got, `"s";r=37;`) {
		t.Errorf("RateLimit %q, want zone s with 37 tokens left", got)
	}
	r.Kill()
	if code, _ := serve(h, "10.0.0.3", "X-Key", "k"); code != http.StatusServiceUnavailable {
		t.Errorf("Redis down: %d, want 503 (fail_mode closed)", code)
	}
}

// A refusal's Retry-After and headers are the shared bucket's: once the
// wait it gives is over, another instance allows the key.
func TestSyncRetryAfter(t *testing.T) {
	r := startRedis(t)
	hs := syncInstances(t, r.Addr(), `{"name":"s","key":"{http.request.header.X-Key}","rate":"1r/s","burst":3,"sync":"100ms"}`, 3)
	emptyEverywhere(t, hs, "k")
	code, hdr := serve(hs[0], "10.0.0.1", "X-Key", "k")
	if code != http.StatusTooManyRequests {
		t.Fatalf("%d, want 429", code)
	}
	wait, err := strconv.Atoi(hdr.Get("Retry-After"))
	if err != nil || wait < 1 || wait > 2 {
		t.Fatalf("Retry-After %q, want 1 or 2 (a token a second)", hdr.Get("Retry-After"))
	}
	if got := hdr.Get("X-RateLimit-Remaining"); got != "0" {
		t.Errorf("X-RateLimit-Remaining %q, want 0", got)
	}
	time.Sleep(time.Duration(wait) * time.Second)
	if code, hdr := serve(hs[1], "10.0.0.1", "X-Key", "k"); code != http.StatusOK {
		t.Errorf("after Retry-After on another instance: %d (Retry-After %s), want 200", code, hdr.Get("Retry-After"))
	}
}

// syncHandles are n handles of a site, /a, /b, ..., each a rate_limit
// with zone s of limit (its rate and burst lines) and sync 100ms on store
// (its address lines), each its own Redis connection pool (pool_size 10,
// 11, ...) and so its own copies: n instances, as n Caddy servers would
// be.
func syncHandles(storeCfg, limit string, n int) string {
	var out strings.Builder
	for i := range n {
		fmt.Fprintf(&out, `	handle /%c {
		rate_limit {
			zone s {
				key {http.request.header.X-Key}
				%s
				sync 100ms
			}
			store redis {
				%s
				key_prefix t:
				pool_size %d
			}
		}
		respond "ok"
	}
`, 'a'+i, limit, storeCfg, 10+i)
	}
	return out.String()
}

// syncSites is a Caddy site with three instances of a zone with sync,
// at /a, /b and /c, and an exact zone at /e.
func syncSites(addr string) string {
	return "http://localhost {\n" + syncHandles("address "+addr+"\n\t\t\t\ttimeout 5s", "rate 20r/s\n\t\t\t\tburst 40", 3) + fmt.Sprintf(`	handle /e {
		rate_limit {
			zone e {
				key {http.request.header.X-Key}
				rate 20r/s
				burst 40
			}
			store redis {
				address %s
				timeout 5s
				key_prefix t:
			}
		}
		respond "ok"
	}
}
`, addr)
}

// syncCopies are the copies of the zones named name of the running
// config's handlers, as their stores report them, with the keys each
// holds.
func syncCopies(name string) map[any]int64 {
	registry.Lock()
	defer registry.Unlock()
	out := make(map[any]int64)
	for _, ref := range registry.zones[name] {
		if st := ref.h.store.Stats(ref.z.index); st.SyncCopies != nil {
			out[st.SyncCopies] = st.SyncHeld
		}
	}
	return out
}

// Through Caddy: one key flooded round robin on three instances is
// allowed within the bound of what the exact zone allows beside it; a
// reset through the admin API reaches the three; the reconciliations
// are in the metrics; a reload keeps the copies.
func TestSyncThroughCaddy(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, "", syncSites(r.Addr()))
	send := func(path string) int { return sendKey(t, tester, path, "k") }
	allowed, exact := 0, 0
	for i, start := 0, time.Now(); time.Since(start) < 2*time.Second; i++ {
		if send([]string{"a", "b", "c"}[i%3]) == http.StatusOK {
			allowed++
		}
		if send("e") == http.StatusOK {
			exact++
		}
	}
	t.Logf("allowed %d, exact %d", allowed, exact)
	if allowed > exact+syncBound(3) || allowed < exact*9/10 {
		t.Errorf("allowed %d, want %d to %d (exact %d)", allowed, exact*9/10, exact+syncBound(3), exact)
	}

	// Empty everywhere, then reset through the admin API: three
	// intervals later the three instances know, and allow the burst
	// between them (without a word of the reset, /a and /b would allow
	// the refill alone, 6 tokens each, and /c its 20 requests).
	for range 50 {
		send("a")
		send("b")
		send("c")
	}
	resetBucket(t, "s", "k")
	time.Sleep(300 * time.Millisecond)
	after := 0
	for i := range 60 {
		if send([]string{"a", "b", "c"}[i%3]) == http.StatusOK {
			after++
		}
	}
	if after < 40 {
		t.Errorf("%d of 60 requests allowed three intervals after the reset, want at least 40", after)
	}

	m := scrape(t, tester)
	if n := m[`caddy_rate_limit_sync_reconciliations_total{result="ok",zone="s"}`]; n == 0 {
		t.Error("no reconciliation in the metrics")
	}
	if n := m[`caddy_rate_limit_sync_reconciled_keys_total{zone="s"}`]; n == 0 {
		t.Error("no reconciled key in the metrics")
	}
	if n := m[`caddy_rate_limit_sync_keys{zone="s"}`]; n != 3 {
		t.Errorf("sync_keys %v, want 3: a copy of k in each instance", n)
	}

	copies := syncCopies("s")
	if len(copies) != 3 {
		t.Fatalf("%d sets of copies, want 3", len(copies))
	}
	reload(t, tester, "", syncSites(r.Addr()))
	for sz, held := range syncCopies("s") {
		if _, ok := copies[sz]; !ok {
			t.Error("the reload made new copies")
		}
		if held == 0 {
			t.Error("the reload dropped the copies")
		}
	}
}

// sendKey sends a GET of path on the test site with X-Key key, and
// returns the status.
func sendKey(t *testing.T, tester *caddytest.Tester, path, key string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, siteURL+"/"+path, nil)
	req.Header.Set("X-Key", key)
	resp, err := tester.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// tokensInRedis is what the bucket (hash, field) of burst tokens, one
// every token, holds in Redis now: from the one number Redis keeps, the
// instant it is full again (nanoseconds since 2025), and Redis's clock.
func tokensInRedis(t *testing.T, c *redis.Client, hash, field string, burst int, token time.Duration) float64 {
	t.Helper()
	ctx := context.Background()
	var clock *redis.TimeCmd
	var full *redis.StringCmd
	if _, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		clock, full = p.Time(ctx), p.HGet(ctx, hash, field)
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		t.Fatal(err)
	}
	at, err := full.Int64()
	if errors.Is(err, redis.Nil) {
		return float64(burst) // no bucket: a full one
	}
	if err != nil {
		t.Fatal(err)
	}
	debt := time.Duration(at) - clock.Val().Sub(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	return float64(burst) - float64(max(debt, 0))/float64(token)
}

// After an outage, what each instance spent while Redis was away reaches
// Redis capped at two intervals of refill a key (docs/sync.md): at 10r/s
// burst 10 with sync 100ms, a key used at half its rate all along on one
// instance, and another on two, with Redis away for 5 s: killed and
// started again empty (its buckets full), or frozen (SIGSTOP: calls time
// out) and thawed. The reconciliations after it leave the shared buckets
// at 8 and 6 tokens or more (two tokens an instance), where the whole
// outage's spending (25 tokens a key) would leave them 15 tokens in debt;
// and neither key is ever refused.
func TestSyncOutageForgiven(t *testing.T) {
	for _, tc := range []struct {
		name          string
		away, recover func(r *redisServer)
		timeout       string
	}{
		// A call to a killed Redis fails at once; one that timed out on a
		// loaded machine before the kill would be in doubt, and forgive
		// what the test looks for.
		{"killed", (*redisServer).Kill, (*redisServer).Start, "\n\t\t\t\ttimeout 5s"},
		// A frozen Redis times calls out, which are in doubt, and runs
		// them when it thaws.
		{"frozen", (*redisServer).Pause, (*redisServer).Resume, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startRedis(t)
			tester := startCaddy(t, "", "http://localhost {\n"+syncHandles("address "+r.Addr()+tc.timeout, "rate 10r/s\n\t\t\t\tburst 10", 2)+"}\n")
			instances := map[string][]string{"one": {"a"}, "two": {"a", "b"}}
			halfRate := func(when string, d time.Duration) {
				for i, start := 0, time.Now(); time.Since(start) < d; i++ {
					for key, paths := range instances {
						if code := sendKey(t, tester, paths[i%len(paths)], key); code != http.StatusOK {
							t.Errorf("%s: key %s, request %d: %d, want 200", when, key, i, code)
						}
					}
					time.Sleep(200 * time.Millisecond)
				}
			}
			halfRate("before the outage", 400*time.Millisecond)
			tc.away(r)
			halfRate("during the outage", 5*time.Second)
			tc.recover(r)
			least := leastTokens(t, r, []string{"one", "two"}, "10r/s", 1500*time.Millisecond)
			for key, paths := range instances {
				t.Logf("key %s on %d instances: %.2f tokens at least after the outage", key, len(paths), least[key])
				if want := float64(10 - 2*len(paths)); least[key] < want-1e-6 {
					t.Errorf("key %s on %d instances: the shared bucket went down to %.2f tokens after the outage, want %v or more (two intervals of refill an instance)",
						key, len(paths), least[key], want)
				}
				if least[key] > 9.5 {
					t.Errorf("key %s: %.2f tokens at least: nothing of the outage's spending reached Redis", key, least[key])
				}
			}
			halfRate("after the outage", 3*time.Second)
		})
	}
}

// leastTokens is the least each key's bucket of zone s of syncHandles
// (burst 10, at rate) holds in Redis over d (once, for 0): refills only
// add to it, so what was charged meanwhile is at most what it lacks of
// the burst.
func leastTokens(t *testing.T, r *redisServer, keys []string, rate string, d time.Duration) map[string]float64 {
	t.Helper()
	c := newRedisClient(t, r.Addr())
	perSec, _, err := parseRate(rate)
	if err != nil {
		t.Fatal(err)
	}
	token := gcra.NewLimit(perSec, 10).TokenTime
	least := make(map[string]float64)
	for _, key := range keys {
		least[key] = 10
	}
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		for _, key := range keys {
			hash, field := bucketName(t, "t:", "s", rate, 10, key)
			least[key] = min(least[key], tokensInRedis(t, c, hash, field, 10, token))
		}
		if time.Since(start) >= d {
			return least
		}
	}
}

// At a slow rate, where two intervals of refill are less than a request,
// what an instance spent while Redis was away reaches Redis capped at
// one request's cost a key (docs/sync.md): at 1r/m burst 10 with sync
// 100ms (two intervals: 0.003 tokens), a key that Redis knows at 8
// tokens is used 12 times while Redis is away, which its copy decides.
// Killed and started again empty, Redis then holds 9 tokens; frozen and
// thawed, 7: a call that timed out was run when Redis thawed (a request
// beyond the allowance, asked of Redis as the outage began), and the
// copy, counting it as sent, sends nothing more.
func TestSyncOutageForgivenSlow(t *testing.T) {
	for _, tc := range []struct {
		name          string
		away, recover func(r *redisServer)
		timeout       string  // as in TestSyncOutageForgiven
		least         float64 // Redis's tokens after the outage, at least
	}{
		{"killed", (*redisServer).Kill, (*redisServer).Start, "\n\t\t\t\ttimeout 5s", 9},
		{"frozen", (*redisServer).Pause, (*redisServer).Resume, "", 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startRedis(t)
			tester := startCaddy(t, "", "http://localhost {\n"+syncHandles("address "+r.Addr()+tc.timeout, "rate 1r/m\n\t\t\t\tburst 10", 1)+"}\n")
			// The first request is Redis's; the second, its copy's, within
			// its allowance, which the reconciliations send.
			for i := range 2 {
				if code := sendKey(t, tester, "a", "slow"); code != http.StatusOK {
					t.Fatalf("request %d before the outage: %d, want 200", i, code)
				}
				time.Sleep(300 * time.Millisecond)
			}
			before := leastTokens(t, r, []string{"slow"}, "1r/m", 0)["slow"]
			if before < 8-1e-6 || before > 8.1 {
				t.Fatalf("before the outage: %.3f tokens in Redis, want 8", before)
			}
			tc.away(r)
			allowed := 0
			for range 12 {
				if sendKey(t, tester, "a", "slow") == http.StatusOK {
					allowed++
				}
				time.Sleep(100 * time.Millisecond)
			}
			if allowed == 0 {
				t.Fatal("the copy allowed nothing while Redis was away")
			}
			tc.recover(r)
			least := leastTokens(t, r, []string{"slow"}, "1r/m", 1500*time.Millisecond)["slow"]
			t.Logf("%d of 12 allowed while Redis was away; %.3f tokens at least after", allowed, least)
			if least < tc.least-1e-6 {
				t.Errorf("the shared bucket went down to %.3f tokens after the outage, want %v or more (one request's cost of the outage's spending)", least, tc.least)
			}
			if least > tc.least+0.5 {
				t.Errorf("%.3f tokens at least after the outage: nothing of its spending reached Redis, want %v", least, tc.least)
			}
		})
	}
}

// On a Redis Cluster, the reconciliations are counted a script call each,
// one per hash tag (docs/operating.md): 30 keys, nearly each its own hash
// tag, used on one instance once every 150 ms, eight times. The calls
// counted are the script calls the masters ran meanwhile (only the
// reconciliations ran any), none failed, and they carried each key once
// a use.
func TestSyncClusterReconciliationCalls(t *testing.T) {
	nodes := startCluster(t)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.Addr())
	}
	tester := startCaddy(t, "", "http://localhost {\n"+syncHandles("address "+strings.Join(addrs, " ")+"\n\t\t\t\ttimeout 5s", "rate 20r/s\n\t\t\t\tburst 40", 1)+"}\n")
	const keys, uses = 30, 8
	use := func() {
		for k := range keys {
			if code := sendKey(t, tester, "a", strconv.Itoa(k)); code != http.StatusOK {
				t.Fatalf("key %d: %d, want 200", k, code)
			}
		}
		time.Sleep(150 * time.Millisecond)
	}
	use() // the copies, made from Redis's answers
	calls := func() (n int) {
		for _, node := range nodes {
			n += node.Calls()
		}
		return n
	}
	const ok, failed, carried = `caddy_rate_limit_sync_reconciliations_total{result="ok",zone="s"}`,
		`caddy_rate_limit_sync_reconciliations_total{result="error",zone="s"}`, `caddy_rate_limit_sync_reconciled_keys_total{zone="s"}`
	before, m0 := calls(), scrape(t, tester)
	for range uses {
		use()
	}
	time.Sleep(200 * time.Millisecond) // the last reconciliation
	made, m := calls()-before, scrape(t, tester)
	t.Logf("%d script calls, counted %v ok and %v failed, carrying %v keys", made, m[ok]-m0[ok], m[failed]-m0[failed], m[carried]-m0[carried])
	if n := m[failed] - m0[failed]; n != 0 {
		t.Errorf("%v failed reconciliations, want none", n)
	}
	if n := m[ok] - m0[ok]; int(n) != made {
		t.Errorf("%v reconciliations counted, while the masters ran %d script calls", n, made)
	}
	if n := m[carried] - m0[carried]; n != keys*uses {
		t.Errorf("%v keys carried, want %d (each key once a use)", n, keys*uses)
	}
}

func TestSyncCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		input   string
		wantErr string
		line    int
	}{
		{
			name: "not a duration",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync often
	}
}`,
			wantErr: "invalid sync 'often': expected a duration such as 100ms",
			line:    4,
		},
		{
			name: "too short",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100us
	}
}`,
			wantErr: "invalid sync 100µs: must be 1ms to 1m",
			line:    4,
		},
		{
			name: "no argument",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync
	}
}`,
			wantErr: "wrong argument count",
			line:    4,
		},
		{
			name: "with delay",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
		delay 1s
	}
	store redis
}`,
			wantErr: "zone a: sync cannot go with delay",
			line:    6,
		},
		{
			name: "with concurrency",
			input: `rate_limit {
	zone a {
		rate 1r/s
		concurrency 4
		sync 100ms
	}
	store redis
}`,
			wantErr: "zone a: sync cannot go with concurrency",
			line:    6,
		},
		{
			name: "without a rate",
			input: `rate_limit {
	zone a {
		quota 10 per day
		sync 100ms
	}
	store redis
}`,
			wantErr: "zone a: sync needs a rate",
			line:    5,
		},
		{
			name: "on the local store",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
	}
}`,
			wantErr: "zone a: sync needs the Redis store",
			line:    6,
		},
		{
			name: "on the local store, said",
			input: `rate_limit {
	zone a {
		rate 1r/s
		sync 100ms
	}
	store local
}`,
			wantErr: "zone a: sync needs the Redis store",
			line:    7,
		},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

func TestSyncValidate(t *testing.T) {
	const redis = `"store":{"backend":"redis"}`
	for _, tc := range []struct {
		name, json, wantErr string
	}{
		{"ok", `{"zones":[{"name":"a","rate":"1r/s","sync":"100ms"}],` + redis + `}`, ""},
		{"plans", `{"zones":[{"name":"a","rate":"{r}","burst":"{b}","sync":"100ms"}],` + redis + `}`, ""},
		{"local store", `{"zones":[{"name":"a","rate":"1r/s","sync":"100ms"}]}`, "zone a: sync needs the Redis store"},
		{"too long", `{"zones":[{"name":"a","rate":"1r/s","sync":"2m"}],` + redis + `}`, "invalid sync 2m0s: must be 1ms to 1m"},
		{"ban", `{"zones":[{"name":"a","rate":"1r/s","ban":"1m","sync":"100ms"}],` + redis + `}`, "sync cannot go with ban"},
		{"count", `{"zones":[{"name":"a","rate":"1r/s","count":{"status_code":[401]},"sync":"100ms"}],` + redis + `}`, "sync cannot go with count"},
		{"usage", `{"zones":[{"name":"a","rate":"1r/s","usage":{"header":"X-Used"},"sync":"100ms"}],` + redis + `}`, "sync cannot go with usage"},
		{"quota", `{"zones":[{"name":"a","rate":"1r/s","quota":10,"quota_period":"day","sync":"100ms"}],` + redis + `}`, "sync cannot go with quota"},
	} {
		t.Run(tc.name, func(t *testing.T) { checkValidate(t, tc.json, tc.wantErr) })
	}
}

// The load runs of docs/sync.md: `make sync` (RATE_LIMIT_SYNC=1) writes
// bench/results/sync.md. Two redis-servers: one for the zones with sync,
// one for the exact zones beside them, so that each side's script calls
// and Redis CPU are its own.
//
//   - One fresh key flooded round robin on N instances for 5 s, at 20r/s
//     burst 40, by 8 clients each sending a request a millisecond, for N
//     of 1, 3 and 5 and sync of 10ms, 100ms and 1s; an exact zone beside
//     it, flooded alike. Then the same through Caddy (three instances as
//     three handlers of one Caddy, each its own connection pool).
//   - 2,000 keys under their limit (100r/s burst 200, each key asked on
//     each instance every 100ms, 60,000 requests a second): what was
//     refused, and the script calls and Redis CPU a request, with sync
//     100ms and exact.
func TestSyncLoad(t *testing.T) {
	if os.Getenv("RATE_LIMIT_SYNC") == "" {
		t.Skip("set RATE_LIMIT_SYNC=1, or run make sync")
	}
	syncRedis, exactRedis := startRedis(t), startRedis(t)
	var out strings.Builder
	fmt.Fprintf(&out, "# sync: load runs\n\n`make sync` on %s, %d CPUs (%s).\n\n", runtime.GOOS+"/"+runtime.GOARCH, runtime.NumCPU(), time.Now().UTC().Format("2006-01-02"))
	out.WriteString("## One fresh key flooded round robin for 5 s, rate 20r/s burst 40\n\n")
	out.WriteString("| instances | sync | allowed | exact zone | excess | bound (N-1) x (rate x sync + 1) | script calls (sync) | script calls (exact) |\n|---|---|---|---|---|---|---|---|\n")
	for _, n := range []int{1, 3, 5} {
		for _, interval := range []time.Duration{10 * time.Millisecond, 100 * time.Millisecond, time.Second} {
			name := fmt.Sprintf("flood-%d-%v", n, interval)
			var hs []*Handler
			for i := range n {
				h, unload := provision(t, fmt.Sprintf(`{"zones":[%s],"store":{"backend":"redis","addresses":[%q],"timeout":"5s","pool_size":%d}}`,
					syncZoneJSON(name, interval.String()), syncRedis.Addr(), 10+i))
				defer unload()
				hs = append(hs, h)
			}
			exact, unload := provision(t, fmt.Sprintf(`{"zones":[%s],"store":{"backend":"redis","addresses":[%q],"timeout":"5s"}}`, syncZoneJSON(name, ""), exactRedis.Addr()))
			defer unload()
			syncCalls, exactCalls := syncRedis.Calls(), exactRedis.Calls()
			allowed, exactAllowed := syncFlood(hs, exact, 5*time.Second)
			syncCalls, exactCalls = syncRedis.Calls()-syncCalls, exactRedis.Calls()-exactCalls
			bound := float64(n-1) * (20*interval.Seconds() + 1)
			fmt.Fprintf(&out, "| %d | %v | %d | %d | %+d | %.1f | %d | %d |\n", n, interval, allowed, exactAllowed, allowed-exactAllowed, bound, syncCalls, exactCalls)
			t.Logf("%d instances, sync %v: allowed %d, exact %d", n, interval, allowed, exactAllowed)
		}
	}

	// Through Caddy: the sites of TestSyncThroughCaddy, flooded alike over
	// HTTP.
	tester := startCaddy(t, "", syncSites(syncRedis.Addr()))
	var allowed, exactAllowed atomic.Int64
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 8 {
		wg.Go(func() {
			for time.Since(start) < 5*time.Second {
				i := next.Add(1)
				for _, p := range []string{[]string{"a", "b", "c"}[i%3], "e"} {
					req, _ := http.NewRequest(http.MethodGet, siteURL+"/"+p, nil)
					req.Header.Set("X-Key", "through-caddy")
					resp, err := tester.Client.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						if p == "e" {
							exactAllowed.Add(1)
						} else {
							allowed.Add(1)
						}
					}
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	wg.Wait()
	fmt.Fprintf(&out, "\nThrough Caddy, 3 instances, sync 100ms, %d requests to each side: allowed %d, exact zone %d (%+d; bound 6).\n",
		next.Load(), allowed.Load(), exactAllowed.Load(), allowed.Load()-exactAllowed.Load())

	out.WriteString("\n## 2,000 keys under their limit on three instances, rate 100r/s burst 200\n\n")
	out.WriteString("| zone | requests | refused | script calls | calls a request | calls a request after the first pass | Redis CPU a request |\n|---|---|---|---|---|---|---|\n")
	for _, interval := range []string{"100ms", ""} {
		r := syncRedis
		if interval == "" {
			r = exactRedis
		}
		zone := fmt.Sprintf(`{"name":"under-%s","key":"{http.request.header.X-Key}","rate":"100r/s","burst":200%s}`, interval, map[bool]string{true: `,"sync":"` + interval + `"`}[interval != ""])
		var hs []*Handler
		for i := range 3 {
			h, unload := provision(t, fmt.Sprintf(`{"zones":[%s],"store":{"backend":"redis","addresses":[%q],"timeout":"5s","pool_size":%d}}`, zone, r.Addr(), 10+i))
			defer unload()
			hs = append(hs, h)
		}
		res := syncUnderLimit(r, hs, 2000, 10*time.Second)
		label := "sync " + interval
		if interval == "" {
			label = "exact"
		}
		fmt.Fprintf(&out, "| %s | %d | %d | %d | %.4f | %.4f | %.2f µs |\n", label, res.requests, res.refused, res.calls,
			float64(res.calls)/float64(res.requests), float64(res.callsAfter)/float64(res.requestsAfter), res.cpu.Seconds()*1e6/float64(res.requests))
		t.Logf("%s: %+v", label, res)
	}
	if err := os.WriteFile("bench/results/sync.md", []byte(out.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
}

// syncFlood floods one key round robin on hs, and the same key on exact,
// from 8 clients each sending a request a millisecond, for d; it returns
// what each allowed.
func syncFlood(hs []*Handler, exact *Handler, d time.Duration) (allowed, exactAllowed int) {
	var a, e, next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 8 {
		wg.Go(func() {
			for time.Since(start) < d {
				i := next.Add(1)
				if code, _ := serve(hs[int(i)%len(hs)], "10.0.0.1", "X-Key", "k"); code == http.StatusOK {
					a.Add(1)
				}
				if code, _ := serve(exact, "10.0.0.1", "X-Key", "k"); code == http.StatusOK {
					e.Add(1)
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	wg.Wait()
	return int(a.Load()), int(e.Load())
}

type underLimit struct {
	requests, refused, calls  int
	requestsAfter, callsAfter int // after the first pass over the keys
	cpu                       time.Duration
}

// syncUnderLimit asks each of keys on each of hs every 100ms for d, from 4
// clients.
func syncUnderLimit(r *redisServer, hs []*Handler, keys int, d time.Duration) underLimit {
	var res underLimit
	calls, cpu := r.Calls(), redisCPU(r)
	var requests, refused atomic.Int64
	start := time.Now()
	for pass := 0; time.Since(start) < d; pass++ {
		began := time.Now()
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				for k := w; k < keys; k += 4 {
					for _, h := range hs {
						if code, _ := serve(h, "10.0.0.1", "X-Key", strconv.Itoa(k)); code != http.StatusOK {
							refused.Add(1)
						}
						requests.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if pass == 0 {
			res.requestsAfter, res.callsAfter = -int(requests.Load()), -(r.Calls() - calls)
		}
		time.Sleep(100*time.Millisecond - time.Since(began))
	}
	res.requests, res.refused, res.calls = int(requests.Load()), int(refused.Load()), r.Calls()-calls
	res.requestsAfter += res.requests
	res.callsAfter += res.calls
	res.cpu = redisCPU(r) - cpu
	return res
}

// redisCPU is the CPU time Redis has used.
func redisCPU(r *redisServer) time.Duration {
	var total float64
	for _, line := range strings.Split(r.CLI("INFO", "cpu"), "\n") {
		for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), f); ok {
				x, _ := strconv.ParseFloat(v, 64)
				total += x
			}
		}
	}
	return time.Duration(total * float64(time.Second))
}
