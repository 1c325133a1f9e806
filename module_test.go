// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Zone names are global: a zone keeps its buckets across config loads
// while its name, rate and burst stay the same. Every test below therefore
// uses zone names of its own.

// TestServeHTTPDirect drives a provisioned handler without a server: it
// checks the defaults Provision fills in, the 429 handler error, the
// placeholders, and that cancelling the config releases the buckets.
func TestServeHTTPDirect(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	cancelled := false
	defer func() {
		if !cancelled {
			cancel()
		}
	}()

	var h Handler
	if err := json.Unmarshal([]byte(`{"zones":[
		{"name":"direct_key","key":"{http.request.header.X-Key}","rate":"1r/m","burst":2},
		{"name":"direct_defaults","rate":"2.5r/s"}
	],"headers":"legacy"}`), &h); err != nil {
		t.Fatal(err)
	}
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	defer h.Cleanup()

	// Defaults.
	z := h.Zones[1]
	if z.Key != "{http.vars.client_ip}" || z.Burst != 3 || z.Cost != 1 || z.IPv4Prefix != 32 || z.IPv6Prefix != 64 {
		t.Errorf("defaults: key %q, burst %d, cost %d, ipv4_prefix %d, ipv6_prefix %d; want {http.vars.client_ip}, 3, 1, 32, 64",
			z.Key, z.Burst, z.Cost, z.IPv4Prefix, z.IPv6Prefix)
	}
	if z := h.Zones[0]; z.Burst != 2 || z.Cost != 1 {
		t.Errorf("zone %s: burst %d, cost %d; want 2, 1", z.Name, z.Burst, z.Cost)
	}

	serve := func(key string) (*httptest.ResponseRecorder, *caddy.Replacer, bool, error) {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		if key != "" {
			req.Header.Set("X-Key", key)
		}
		repl := caddyhttp.NewTestReplacer(req)
		rr := httptest.NewRecorder()
		called := false
		next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			called = true
			return nil
		})
		err := h.ServeHTTP(rr, req, next)
		return rr, repl, called, err
	}

	for i, wantRemaining := range []string{"1", "0"} {
		rr, _, called, err := serve("alice")
		if err != nil || !called {
			t.Fatalf("request %d: err %v, next called %t; want nil, true", i+1, err, called)
		}
		if got := rr.Header().Get("X-Ratelimit-Remaining"); got != wantRemaining {
			t.Errorf("request %d: X-Ratelimit-Remaining %q, want %q", i+1, got, wantRemaining)
		}
		if got := rr.Header().Get("Retry-After"); got != "" {
			t.Errorf("request %d: Retry-After %q on an allowed request", i+1, got)
		}
	}

	rr, repl, called, err := serve("alice")
	var herr caddyhttp.HandlerError
	if !errors.As(err, &herr) || herr.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("third request: error %v, want a 429 HandlerError", err)
	}
	if called {
		t.Error("third request: next handler called after denial")
	}
	if want := "rate limit exceeded in zone direct_key"; herr.Err == nil || herr.Err.Error() != want {
		t.Errorf("error %v, want %q", herr.Err, want)
	}
	if got := rr.Header().Get("Retry-After"); got != "60" {
		t.Errorf("Retry-After %q, want 60", got)
	}
	if got, _ := repl.GetString("http.rate_limit.exceeded.name"); got != "direct_key" {
		t.Errorf("{http.rate_limit.exceeded.name} = %q, want direct_key", got)
	}
	if got, _ := repl.GetString("http.rate_limit.exceeded.retry_after"); got != "60" {
		t.Errorf("{http.rate_limit.exceeded.retry_after} = %q, want 60", got)
	}
	if got := rr.Header().Get("Ratelimit"); got != "" {
		t.Errorf("Ratelimit %q with headers legacy", got)
	}

	// Another key has its own bucket.
	if _, _, _, err := serve("bob"); err != nil {
		t.Errorf("other key: %v", err)
	}
	// No X-Key: zone direct_key does not apply; direct_defaults does, by
	// the connection's peer, as no client_ip is set (whose bucket of 3 the
	// requests above have used).
	for range 3 {
		rr, repl, _, err := serve("")
		if got := rr.Header().Get("X-Ratelimit-Limit"); got != "3" {
			t.Fatalf("empty key: X-Ratelimit-Limit %q, want 3: only zone direct_defaults applies", got)
		}
		if err != nil {
			if name, _ := repl.GetString("http.rate_limit.exceeded.name"); name != "direct_defaults" {
				t.Fatalf("empty key: %v, denied by %q, want direct_defaults", err, name)
			}
		}
	}

	// Cancelling the config releases the tables.
	ids := make([]memstore.TableID, len(h.Zones))
	for i, z := range h.Zones {
		ids[i] = bucketTableID(t, z.spec())
		if n, ok := localTables.References(ids[i]); !ok || n != 1 {
			t.Errorf("zone %s: %d references (found %t), want 1", z.Name, n, ok)
		}
	}
	cancel()
	cancelled = true
	for i, id := range ids {
		if n, ok := localTables.References(id); ok {
			t.Errorf("zone %s: still %d references after the config was cancelled", h.Zones[i].Name, n)
		}
	}
}

// TestDenialLog checks the debug entry for a denial, which names the
// client's key only with log_key.
func TestDenialLog(t *testing.T) {
	for _, logKey := range []bool{false, true} {
		t.Run(fmt.Sprintf("log_key %t", logKey), func(t *testing.T) {
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			name := fmt.Sprintf("denial_log_%t", logKey)
			h := Handler{
				Zones:  []*Zone{{Name: name, Key: "{http.request.header.X-Key}", Rate: "1r/m", Burst: 1}},
				LogKey: logKey,
			}
			if err := h.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			defer h.Cleanup()
			core, logs := observer.New(zapcore.DebugLevel)
			h.logger = zap.New(core)

			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			for i := range 2 {
				req := httptest.NewRequest(http.MethodGet, "/", nil)
				req.Header.Set("X-Key", "2001:db8::1")
				caddyhttp.NewTestReplacer(req)
				err := h.ServeHTTP(httptest.NewRecorder(), req, next)
				if (err != nil) != (i == 1) {
					t.Fatalf("request %d: error %v", i+1, err)
				}
			}

			entries := logs.All()
			if len(entries) != 1 {
				t.Fatalf("%d log entries, want 1: %v", len(entries), entries)
			}
			e := entries[0]
			if e.Level != zapcore.DebugLevel || e.Message != "rate limit exceeded" {
				t.Errorf("entry %s %q, want debug \"rate limit exceeded\"", e.Level, e.Message)
			}
			fields := e.ContextMap()
			if fields["zone"] != name || fields["remote_ip"] != "192.0.2.1" {
				t.Errorf("zone %v, remote_ip %v; want %s, 192.0.2.1", fields["zone"], fields["remote_ip"], name)
			}
			if wait, _ := fields["wait"].(time.Duration); wait <= 59*time.Second || wait > time.Minute {
				t.Errorf("wait %v, want just under a minute", fields["wait"])
			}
			key, ok := fields["key"]
			switch {
			case logKey && key != "2001:db8::/64":
				t.Errorf("key %v, want the client's /64, 2001:db8::/64", key)
			case !logKey && ok:
				t.Errorf("key %v logged without log_key", key)
			}
		})
	}
}

// testGlobalOptions is the test Caddy's global options, with extra ones:
// its ports (pickTestPorts), which the sites' addresses without a port
// (http://localhost) take.
func testGlobalOptions(extra string) string {
	return fmt.Sprintf(`{
	skip_install_trust
	admin %s
	http_port %d
	https_port %d
	grace_period 1ns
	persist_config off
%s}

`, adminAddr, httpPort, httpsPort, extra)
}

// startCaddy loads a config made of the test global options, extra
// global options and sites into the test Caddy.
func startCaddy(t *testing.T, extraGlobal, sites string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(testGlobalOptions(extraGlobal)+sites, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	waitLoaded(t, tester)
	return tester
}

// reload loads another config into a running test Caddy.
func reload(t *testing.T, tester *caddytest.Tester, extraGlobal, sites string) {
	t.Helper()
	tester.InitServer(testGlobalOptions(extraGlobal)+sites, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	waitLoaded(t, tester)
}

// get requests path from the test site with the header name/value pairs
// and asserts the status and the body.
func get(t *testing.T, tester *caddytest.Tester, path string, wantStatus int, wantBody string, header ...string) http.Header {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, siteURL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, _ := tester.AssertResponse(req, wantStatus, wantBody)
	return resp.Header
}

// TestRefill waits for tokens to come back: a bucket of 2 that gets one
// back every 200ms. Each request is checked against the tokens the
// bucket may hold when the server decides it, which is between the
// request's sending and its answer (refillRange): on a machine that
// other tests load, requests meant to come within 200ms may not, and
// the bucket then holds what that time gave back. Unloaded, the range is
// narrow enough that each status and remaining count has one value.
func TestRefill(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone refill {
			rate 5r/s
			burst 2
		}
	}
	respond "ok"
}
`)
	resetBucket(t, "refill", "127.0.0.1") // full, whatever an earlier run of the test left
	b := refillRange{burst: 2, token: 200 * time.Millisecond}
	request := func(what string) (int, http.Header) {
		t.Helper()
		sent := time.Now()
		resp, err := tester.Client.Get(siteURL + "/")
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		lo, hi := b.decided(sent, time.Now())
		remaining := resp.Header.Get("X-Ratelimit-Remaining")
		switch resp.StatusCode {
		case http.StatusOK:
			if hi < 1 {
				t.Errorf("%s: allowed with at most %.3f tokens", what, hi)
			}
			lo, hi = max(lo, 1)-1, hi-1
			if n, err := strconv.Atoi(remaining); err != nil || float64(n) < math.Floor(lo) || float64(n) > math.Floor(hi) {
				t.Errorf("%s: remaining %q, want the whole tokens of %.3f to %.3f", what, remaining, lo, hi)
			}
		case http.StatusTooManyRequests:
			if lo >= 1 {
				t.Errorf("%s: refused with at least %.3f tokens", what, lo)
			}
			hi = min(hi, 1)
		default:
			t.Fatalf("%s: status %d", what, resp.StatusCode)
		}
		b.lo, b.hi = lo, hi
		return resp.StatusCode, resp.Header
	}

	if _, h := request("first request"); h.Get("X-Ratelimit-Remaining") != "1" {
		t.Errorf("first request: remaining %q, want 1", h.Get("X-Ratelimit-Remaining"))
	}
	// Requests until one is refused: the second, unless 200ms passed.
	var h http.Header
	for i, code := 2, 200; code != http.StatusTooManyRequests; i++ {
		if i > 50 {
			t.Fatal("50 requests, none refused")
		}
		code, h = request(fmt.Sprintf("request %d", i))
	}
	if got := h.Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After %q, want 1 (the wait of at most 200ms rounded up)", got)
	}
	if got, want := h.Get("Ratelimit"), `"refill";r=0;t=1`; got != want {
		t.Errorf("Ratelimit %q, want %q", got, want)
	}

	// A token is back after 200ms: one remains after 250ms, and is spent.
	time.Sleep(250 * time.Millisecond)
	request("after 250ms")

	// The bucket is full again after 400ms, and never holds more than 2.
	time.Sleep(450 * time.Millisecond)
	if _, h := request("after 450ms more"); h.Get("X-Ratelimit-Remaining") != "1" {
		t.Errorf("after 450ms more: remaining %q, want 1", h.Get("X-Ratelimit-Remaining"))
	}
}

// refillRange is what a bucket of burst tokens, one back every token,
// may hold after the requests so far: from lo to hi tokens. Each request
// was decided at an instant between its sending and its answer.
type refillRange struct {
	burst  float64
	token  time.Duration
	lo, hi float64
	// The last request's sending and answer; zero before the first.
	sent, answered time.Time
}

// decided is the range of tokens the bucket holds when a request sent
// and answered at those instants is decided, before it takes any.
func (b *refillRange) decided(sent, answered time.Time) (lo, hi float64) {
	if b.sent.IsZero() {
		b.lo, b.hi = b.burst, b.burst // a new bucket is full
	} else {
		shortest, longest := max(sent.Sub(b.answered), 0), answered.Sub(b.sent)
		b.lo = min(b.burst, b.lo+float64(shortest)/float64(b.token))
		b.hi = min(b.burst, b.hi+float64(longest)/float64(b.token))
	}
	b.sent, b.answered = sent, answered
	return b.lo, b.hi
}

// TestCost charges several tokens per request.
func TestCost(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone cost {
			rate 1r/m
			burst 5
			cost 2
		}
	}
	respond "ok"
}
`)
	for i, want := range []string{`"cost";r=3;t=60`, `"cost";r=1;t=60`} {
		h := get(t, tester, "/", 200, "ok")
		if got := h.Get("Ratelimit"); got != want {
			t.Errorf("request %d: Ratelimit %q, want %q", i+1, got, want)
		}
	}
	// One token is left, but a request needs two: the next one comes back
	// in a minute.
	h := get(t, tester, "/", 429, "")
	checkHeaders(t, "request 3", h, map[string]string{
		"X-Ratelimit-Limit":     "5",
		"X-Ratelimit-Remaining": "1",
		"X-Ratelimit-Reset":     "?",
		"Ratelimit-Policy":      `"cost";q=5;w=300`,
		"Ratelimit":             `"cost";r=1;t=60`,
		"Retry-After":           "60",
	})
}

// TestConcurrentRequests floods two zones at once: exactly the smaller
// burst gets through, and the denied requests cost the larger zone
// nothing.
func TestConcurrentRequests(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone conc_a {
			rate 1r/m
			burst 10
		}
		zone conc_b {
			match {
				path /both
			}
			rate 1r/m
			burst 7
		}
	}
	respond "ok"
}
`)
	const n = 40
	codes := make(chan int, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			resp, err := tester.Client.Get(siteURL + "/both")
			if err != nil {
				t.Error(err)
				codes <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	wg.Wait()
	close(codes)
	count := make(map[int]int)
	for c := range codes {
		count[c]++
	}
	if count[200] != 7 || count[429] != n-7 {
		t.Errorf("status counts %v, want 7 × 200 and %d × 429", count, n-7)
	}

	// conc_a gave only what conc_b allowed.
	for range 3 {
		get(t, tester, "/a", 200, "ok")
	}
	get(t, tester, "/a", 429, "")
}

// TestAllOrNothing checks that a request denied by one zone spends
// nothing in the others.
func TestAllOrNothing(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone aon_a {
			match {
				path /a*
			}
			rate 1r/m
			burst 1
		}
		zone aon_b {
			match {
				path /a* /b*
			}
			rate 1r/m
			burst 3
		}
		zone aon_c {
			match {
				path /c*
			}
			rate 1r/m
			burst 1
		}
		zone aon_d {
			match {
				header X-D *
			}
			rate 1r/m
			burst 1
		}
	}
	respond "ok"
}
`)
	// /a takes from A and B.
	h := get(t, tester, "/a", 200, "ok")
	checkHeaders(t, "/a", h, map[string]string{
		"X-Ratelimit-Limit":     "1", // A has the fewest tokens left
		"X-Ratelimit-Remaining": "0",
		"X-Ratelimit-Reset":     "?",
		"Ratelimit-Policy":      `"aon_a";q=1;w=60, "aon_b";q=3;w=180`,
		"Ratelimit":             `"aon_a";r=0;t=60, "aon_b";r=2;t=60`,
	})

	// A denies: B is not charged, and says so.
	h = get(t, tester, "/a", 429, "")
	checkHeaders(t, "/a again", h, map[string]string{
		"X-Ratelimit-Limit":     "1",
		"X-Ratelimit-Remaining": "0",
		"X-Ratelimit-Reset":     "?",
		"Ratelimit-Policy":      `"aon_a";q=1;w=60, "aon_b";q=3;w=180`,
		"Ratelimit":             `"aon_a";r=0;t=60, "aon_b";r=2;t=60`,
		"Retry-After":           "60",
	})

	// Only B: it still has the 2 tokens the denied request did not take.
	h = get(t, tester, "/b", 200, "ok")
	checkHeaders(t, "/b", h, map[string]string{
		"X-Ratelimit-Limit":     "3",
		"X-Ratelimit-Remaining": "1",
		"X-Ratelimit-Reset":     "?",
		"Ratelimit-Policy":      `"aon_b";q=3;w=180`,
		"Ratelimit":             `"aon_b";r=1;t=60`,
	})

	// The other way round: D is drained first, then a request for C and
	// D is denied by D and must leave C's only token in place.
	get(t, tester, "/d", 200, "ok", "X-D", "1")
	h = get(t, tester, "/c", 429, "", "X-D", "1")
	if got, want := h.Get("Ratelimit"), `"aon_c";r=1;t=0, "aon_d";r=0;t=60`; got != want {
		t.Errorf("/c with X-D: Ratelimit %q, want %q", got, want)
	}
	h = get(t, tester, "/c", 200, "ok")
	if got, want := h.Get("Ratelimit"), `"aon_c";r=0;t=60`; got != want {
		t.Errorf("/c: Ratelimit %q, want %q", got, want)
	}
	get(t, tester, "/c", 429, "")
}

// TestIPPrefixes groups client addresses into networks, with the client
// address taken from X-Forwarded-For sent by a trusted proxy.
func TestIPPrefixes(t *testing.T) {
	tester := startCaddy(t, `	servers {
		trusted_proxies static private_ranges 127.0.0.1/8 ::1/128
	}
`, `http://localhost {
	handle /v6 {
		rate_limit {
			zone ip_default {
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
	handle /v4 {
		rate_limit {
			zone ip_v4_24 {
				rate 1r/m
				burst 1
				ipv4_prefix 24
			}
		}
		respond "ok"
	}
	handle /v6_48 {
		rate_limit {
			zone ip_v6_48 {
				rate 1r/m
				burst 1
				ipv6_prefix 48
			}
		}
		respond "ok"
	}
	handle /remote {
		rate_limit {
			zone ip_remote {
				key {remote_host}
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
	handle /static {
		rate_limit {
			zone ip_static {
				key everyone
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
}
`)
	xff := func(path, ip string, status int) {
		t.Helper()
		body := "ok"
		if status != 200 {
			body = ""
		}
		get(t, tester, path, status, body, "X-Forwarded-For", ip)
	}

	// Default prefixes: /64 for IPv6, /32 for IPv4.
	xff("/v6", "2001:db8:a:b::1", 200)
	xff("/v6", "2001:db8:a:b:ffff:ffff:ffff:fffe", 429) // same /64
	xff("/v6", "2001:db8:a:c::1", 200)                  // next /64
	xff("/v6", "2001:db8:a:c::1, 198.51.100.99", 429)   // left-most address counts
	xff("/v6", "[2001:db8:a:d::1]:4321", 200)           // port dropped
	xff("/v6", "2001:db8:a:d::2%eth0", 429)             // zone dropped, same /64
	xff("/v6", "198.51.100.1", 200)
	xff("/v6", "198.51.100.2", 200) // another /32
	xff("/v6", "198.51.100.1", 429)
	get(t, tester, "/v6", 200, "ok") // the proxy itself, 127.0.0.1
	get(t, tester, "/v6", 429, "")

	// ipv4_prefix 24.
	xff("/v4", "203.0.113.5", 200)
	xff("/v4", "203.0.113.250", 429)       // same /24
	xff("/v4", "::ffff:203.0.113.9", 429)  // IPv4-mapped: same /24
	xff("/v4", "203.0.114.5", 200)         // next /24
	xff("/v4", "2001:db8:a:b::1", 200)     // IPv6 keeps its own /64
	xff("/v4", "2001:db8:a:b::2", 429)     // same /64
	xff("/v4", "2001:db8:a:bb::1", 200)    // another /64
	xff("/v6_48", "2001:db8:1::1", 200)    // ipv6_prefix 48
	xff("/v6_48", "2001:db8:1:ff::1", 429) // same /48
	xff("/v6_48", "2001:db8:2::1", 200)    // next /48

	// {remote_host} is the proxy's address, whatever it forwards; a key
	// without placeholders is one bucket for everyone.
	xff("/remote", "2001:db8:a:b::1", 200)
	xff("/remote", "203.0.113.5", 429)
	xff("/static", "2001:db8:a:b::1", 200)
	xff("/static", "203.0.113.5", 429)
}

// TestReload checks that buckets survive a config reload while the zone
// keeps its name, rate and burst, and start afresh when they change.
func TestReload(t *testing.T) {
	config := func(zones, body string) string {
		return `http://localhost {
	handle /unlimited {
		respond "` + body + `"
	}
	handle {
		rate_limit {
` + zones + `		}
		respond "` + body + `"
	}
}
`
	}
	const keep = `			zone reload_keep {
				rate 1r/m
				burst 2
			}
`
	const other = `			zone reload_other {
				rate 100r/m
			}
`
	const faster = `			zone reload_keep {
				rate 2r/m
				burst 2
			}
`
	tester := startCaddy(t, "", config(keep, "one"))
	get(t, tester, "/", 200, "one")
	get(t, tester, "/", 200, "one")
	get(t, tester, "/", 429, "")

	// Only the body changes: the bucket is still empty.
	reload(t, tester, "", config(keep, "two"))
	get(t, tester, "/unlimited", 200, "two")
	h := get(t, tester, "/", 429, "")
	if got, want := h.Get("Ratelimit"), `"reload_keep";r=0;t=60`; got != want {
		t.Errorf("after reload: Ratelimit %q, want %q", got, want)
	}

	// Another zone before it moves it to another index: still empty.
	reload(t, tester, "", config(other+keep, "three"))
	get(t, tester, "/unlimited", 200, "three")
	h = get(t, tester, "/", 429, "")
	if got, want := h.Get("Ratelimit"), `"reload_other";r=100;t=0, "reload_keep";r=0;t=60`; got != want {
		t.Errorf("after adding a zone: Ratelimit %q, want %q", got, want)
	}

	// A new rate starts a fresh bucket.
	reload(t, tester, "", config(faster, "four"))
	h = get(t, tester, "/", 200, "four")
	if got, want := h.Get("Ratelimit"), `"reload_keep";r=1;t=30`; got != want {
		t.Errorf("after changing the rate: Ratelimit %q, want %q", got, want)
	}

	// So does going back: the old bucket was dropped with the config
	// that last used it.
	reload(t, tester, "", config(keep, "five"))
	h = get(t, tester, "/", 200, "five")
	if got, want := h.Get("Ratelimit"), `"reload_keep";r=1;t=60`; got != want {
		t.Errorf("after changing the rate back: Ratelimit %q, want %q", got, want)
	}
}

// TestHandleErrors shapes the 429 with the handler's placeholders.
func TestHandleErrors(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	handle /plain {
		rate_limit {
			zone he_plain {
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
	handle /jitter {
		rate_limit {
			zone he_jitter {
				rate 1r/m
				burst 1
			}
			jitter 0.5
		}
		respond "ok"
	}
	handle_errors 429 {
		respond "zone={http.rate_limit.exceeded.name} retry={http.rate_limit.exceeded.retry_after}" 429
	}
}
`)
	get(t, tester, "/plain", 200, "ok")
	h := get(t, tester, "/plain", 429, "zone=he_plain retry=60")
	if got := h.Get("Retry-After"); got != "60" {
		t.Errorf("Retry-After %q, want 60", got)
	}

	// With jitter 0.5, a 60s wait becomes 60 to 90s; the placeholder and
	// the header agree.
	get(t, tester, "/jitter", 200, "ok")
	seen := make(map[int]bool)
	for range 20 {
		req, err := http.NewRequest(http.MethodGet, siteURL+"/jitter", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp := tester.AssertResponseCode(req, 429)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		ra := resp.Header.Get("Retry-After")
		if want := "zone=he_jitter retry=" + ra; string(body) != want {
			t.Errorf("body %q, want %q", body, want)
		}
		n, err := strconv.Atoi(ra)
		if err != nil || n < 60 || n > 90 {
			t.Errorf("Retry-After %q, want 60 to 90", ra)
		}
		seen[n] = true
	}
	if len(seen) < 2 {
		t.Errorf("20 jittered Retry-After values were all %v", seen)
	}
}

// TestEmptyKeySkipsZone: a key that expands to nothing exempts the
// request from the zone.
func TestEmptyKeySkipsZone(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone empty_key {
			key {http.request.header.X-Api-Key}
			rate 1r/m
			burst 1
		}
	}
	respond "ok"
}
`)
	for i := range 5 {
		h := get(t, tester, "/", 200, "ok")
		checkHeaders(t, fmt.Sprintf("request %d without key", i+1), h, nil)
	}
	get(t, tester, "/", 200, "ok", "X-Api-Key", "k1")
	get(t, tester, "/", 429, "", "X-Api-Key", "k1")
	get(t, tester, "/", 200, "ok", "X-Api-Key", "k2")
	get(t, tester, "/", 200, "ok", "X-Api-Key", "   ") // blank: trimmed to nothing
	get(t, tester, "/", 200, "ok")
}

// TestOddKeys sends keys that are huge, odd or many.
func TestOddKeys(t *testing.T) {
	tester := startCaddy(t, `	servers {
		max_header_size 4MB
	}
`, `http://localhost {
	handle /evict/* {
		rate_limit {
			zone odd_evict {
				key {http.request.header.X-Api-Key}
				rate 1r/m
				burst 1
			}
			store local {
				max_keys 16
			}
		}
		respond "ok"
	}
	handle {
		rate_limit {
			zone odd_keys {
				key {http.request.header.X-Api-Key}
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
}
`)
	once := func(key string) {
		t.Helper()
		get(t, tester, "/", 200, "ok", "X-Api-Key", key)
		get(t, tester, "/", 429, "", "X-Api-Key", key)
	}

	// 1 MiB keys: each has its own bucket.
	big := strings.Repeat("k", 1<<20)
	once(big)
	once(big[:len(big)-1] + "x")

	// Odd bytes and lookalikes.
	for _, k := range []string{
		"\xff\xfe\x80",
		"%00%zz",
		"{}",
		"{http.request.uri}",
		"fe80::1%eth0",
		"1.2.3.4%eth0",
		"::",
		"::ffff:198.51.100.7",
		"1.2.3.4:80",
		"0x7f.1",
		strings.Repeat(":", 64),
		strings.Repeat("f", 65),
		"é✓\u200b",
	} {
		once(k)
	}
	// A key is not expanded again: the same literal placeholder is the
	// same bucket, whatever the URI.
	get(t, tester, "/other", 429, "", "X-Api-Key", "{http.request.uri}")
	// An IPv4-mapped address and its IPv4 form are one client.
	get(t, tester, "/", 429, "", "X-Api-Key", "198.51.100.7")

	// Many distinct keys.
	for i := range 300 {
		get(t, tester, "/", 200, "ok", "X-Api-Key", fmt.Sprintf("many-%d", i))
	}
	// With room to spare, nothing was forgotten.
	get(t, tester, "/", 429, "", "X-Api-Key", "many-0")

	// With max_keys 16, a flood of new keys evicts the drained bucket, and
	// its client gets a full bucket back.
	get(t, tester, "/evict/", 200, "ok", "X-Api-Key", "victim")
	get(t, tester, "/evict/", 429, "", "X-Api-Key", "victim")
	for i := range 100 {
		get(t, tester, "/evict/", 200, "ok", "X-Api-Key", fmt.Sprintf("flood-%d", i))
	}
	get(t, tester, "/evict/", 200, "ok", "X-Api-Key", "victim")
}

// TestCaddyfileExample checks that the demo Caddyfile adapts without
// warnings to a valid handler.
func TestCaddyfileExample(t *testing.T) {
	src, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	out := adaptCaddyfile(t, string(src))

	// Find the rate_limit handler and check it as a JSON user's would be.
	var find func(v any) []json.RawMessage
	find = func(v any) []json.RawMessage {
		var found []json.RawMessage
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "rate_limit" {
				b, err := json.Marshal(v)
				if err != nil {
					t.Fatal(err)
				}
				found = append(found, b)
			}
			for _, e := range v {
				found = append(found, find(e)...)
			}
		case []any:
			for _, e := range v {
				found = append(found, find(e)...)
			}
		}
		return found
	}
	var cfg any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	handlers := find(cfg)
	if len(handlers) != 1 {
		t.Fatalf("found %d rate_limit handlers, want 1", len(handlers))
	}
	var h Handler
	if err := json.Unmarshal(handlers[0], &h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Errorf("handler does not validate: %v", err)
	}
	var names []string
	for _, z := range h.Zones {
		names = append(names, z.Name)
	}
	if got, want := strings.Join(names, ","), "api,login,per_key"; got != want {
		t.Errorf("zones %s, want %s", got, want)
	}
}

// The demo Caddyfile does what its comments and the README say, through
// a real Caddy: a client without a key gets 10 requests in a row, then
// 429s (the README's loop); a made-up key no more than its IP's 10; the
// pro key 200 at once, 100 a second, from an IP that has spent its 10.
func TestCaddyfileExampleRuns(t *testing.T) {
	src, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	site := string(src[strings.Index(string(src), "http://127.0.0.1:8080 {"):])
	startCaddy(t, "\tauto_https off\n", strings.Replace(site, ":8080", ":"+strconv.Itoa(httpPort), 1))
	// send makes a request of /api/ from 127.0.0.2 with key, if any, and
	// returns its status and its RateLimit-Policy.
	send := func(key string) (int, string, error) {
		req, err := http.NewRequest(http.MethodGet, siteIPURL+"/api/", nil)
		if err != nil {
			return 0, "", err
		}
		if key != "" {
			req.Header.Set("X-API-Key", key)
		}
		resp, err := loopback(2).Do(req)
		if err != nil {
			return 0, "", err
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("RateLimit-Policy"), nil
	}
	var codes []string
	for range 12 {
		code, _, err := send("")
		if err != nil {
			t.Fatal(err)
		}
		codes = append(codes, strconv.Itoa(code))
	}
	if got, want := strings.Join(codes, " "), "200 200 200 200 200 200 200 200 200 200 429 429"; got != want {
		t.Fatalf("the README's loop: %s, want %s", got, want)
	}
	if code, _, err := send("made-up"); err != nil || code != http.StatusTooManyRequests {
		t.Fatalf("a made-up key from an IP that spent its 10: %d %v, want 429", code, err)
	}
	// 200 at once: all together, so that no refill comes between.
	var wg sync.WaitGroup
	var allowed atomic.Int64
	errs := make(chan error, 200)
	for range 200 {
		wg.Go(func() {
			code, policy, err := send("demo-pro-key")
			switch {
			case err != nil:
				errs <- err
			case code == http.StatusOK && policy == `"per_key";q=200;w=2`:
				allowed.Add(1)
			case code == http.StatusOK:
				errs <- fmt.Errorf("RateLimit-Policy %s, want the pro plan's alone: 200 a 2 s", policy)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := allowed.Load(); n != 200 {
		t.Fatalf("the pro key, 200 requests at once: %d allowed, want 200", n)
	}
}

// TestLoadErrors loads bad JSON configs: Caddy must refuse them with the
// handler's own error, and keep running.
func TestLoadErrors(t *testing.T) {
	config := func(handler string) string {
		return jsonServer(handler + `, {"handler": "static_response", "body": "ok"}`)
	}
	for _, tc := range []struct {
		name, handler, wantErr string
	}{
		{
			name:    "negative burst",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s", "burst": -1}]}`,
			wantErr: "zone le: invalid burst -1: must be at least 1",
		},
		{
			name:    "empty zone name",
			handler: `{"handler": "rate_limit", "rate_limits": {"": {"window": "1s", "max_events": 1}}}`,
			wantErr: "name is required",
		},
		{
			name:    "jitter",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "jitter": -2}`,
			wantErr: "invalid jitter -2: must be a number of at least 0",
		},
		{
			name:    "max_events 0",
			handler: `{"handler": "rate_limit", "rate_limits": {"le": {"window": "1m", "max_events": 0}}}`,
			wantErr: "zone le: max_events is required with window, and at least 1",
		},
		{
			name:    "distributed",
			handler: `{"handler": "rate_limit", "rate_limits": {"le": {"window": "1m", "max_events": 1}}, "distributed": {}}`,
			wantErr: "'distributed' is a github.com/mholt/caddy-ratelimit option: use",
		},
		{
			name:    "max_keys",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "local", "max_keys": -1}}`,
			wantErr: "invalid max_keys -1: must be at least 1",
		},
		{
			name:    "unknown store",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "nowhere"}}`,
			wantErr: "http.handlers.rate_limit.stores.nowhere",
		},
		{
			name:    "pool_size beyond int32",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "redis", "pool_size": 3000000000}}`,
			wantErr: "invalid pool_size 3000000000: must be 0 to 100000",
		},
		{
			name:    "negative db",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "redis", "db": -1}}`,
			wantErr: "invalid db -1",
		},
		{
			name:    "negative timeout",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "redis", "timeout": -5}}`,
			wantErr: "invalid timeout -5ns: must be positive",
		},
		{
			name:    "key_prefix with a brace",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s"}], "store": {"backend": "redis", "key_prefix": "rl{x}:"}}`,
			wantErr: "invalid key_prefix 'rl{x}:'",
		},
		{
			name:    "bad matcher",
			handler: `{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s", "match": [{"nomatcher": true}]}]}`,
			wantErr: "zone le: loading matchers",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			caddytest.AssertLoadError(t, config(tc.handler), "json", tc.wantErr)
		})
	}

	// A config that fails after one handler took its tables gives them
	// back, and the running config keeps its own.
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone le_ok {
			rate 1r/s
			burst 1
		}
	}
	respond "ok"
}
`)
	id := bucketTableID(t, store.ZoneSpec{Name: "le_ok", Bucket: true, Shape: gcra.NewLimit(1, 1)})
	if n, _ := localTables.References(id); n != 1 {
		t.Fatalf("running config: %d references to zone le_ok's table, want 1", n)
	}
	caddytest.AssertLoadError(t, config(
		`{"handler": "rate_limit", "zones": [{"name": "le_ok", "rate": "1r/s", "burst": 1}]}, `+
			`{"handler": "rate_limit", "zones": [{"name": "le", "rate": "1r/s", "burst": -1}]}`,
	), "json", "zone le: invalid burst -1")
	if n, _ := localTables.References(id); n != 1 {
		t.Errorf("after a failed load: %d references to zone le_ok's table, want 1", n)
	}
	get(t, tester, "/", 200, "ok")
	get(t, tester, "/", 429, "")
}

// The rate_limit_exceeded event reaches its subscribers, with the fields
// github.com/mholt/caddy-ratelimit sends.
func TestExceededEvent(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"events","rate":"1r/m","burst":1}]}`)
	sub := recordEvents(t, h)
	serve(h, "192.0.2.40")
	serve(h, "192.0.2.40")
	got := sub.events
	if len(got) != 1 {
		t.Fatalf("%d events for one denial", len(got))
	}
	d := got[0].Data
	if d["zone"] != "events" || d["remote_ip"] != "192.0.2.40" || fmt.Sprint(d["wait"]) == "0s" {
		t.Fatalf("event data %v", d)
	}
}

// eventRecorder is an events handler that keeps what it gets.
type eventRecorder struct{ events []caddy.Event }

func (r *eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	r.events = append(r.events, e)
	return nil
}

// On a Unix-socket listener Caddy has no client IP: a {client_ip} key
// falls back to the connection's peer, so the socket's clients share one
// bucket instead of going unlimited.
func TestUnixSocketClientsAreLimited(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "caddy.sock")
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	bind unix/%s
	rate_limit {client_ip} 1r/m 5
	respond "ok"
}
`, sock))
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return new(net.Dialer).DialContext(ctx, "unix", sock)
		},
	}}
	var codes []int
	for range 20 {
		resp, err := client.Get("http://localhost/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
	}
	ok := 0
	for _, c := range codes {
		if c == http.StatusOK {
			ok++
		}
	}
	if ok != 5 {
		t.Fatalf("%d of 20 requests through the socket allowed (%v), want the bucket's 5", ok, codes)
	}
}

// A denial in a zone with a ban refuses the key for the whole ban, says
// so in Retry-After, the admin API and the metrics, counts the ban once,
// and DELETE lifts it.
func TestBan(t *testing.T) {
	tester := startCaddy(t, "", `
http://localhost {
	rate_limit {
		zone ban-login {
			match {
				path /login
			}
			rate 5/m
			burst 2
			ban 15m
		}
	}
	respond "ok"
}`)
	get(t, tester, "/login", 200, "ok")
	get(t, tester, "/login", 200, "ok")
	// The ban, then the token the request needs: 900s + 12s.
	hdr := get(t, tester, "/login", 429, "")
	if got := hdr.Get("Retry-After"); got != "912" {
		t.Errorf("Retry-After %q, want 912: the ban and a token at 5/m", got)
	}
	hdr = get(t, tester, "/login", 429, "")
	if got, _ := strconv.Atoi(hdr.Get("Retry-After")); got < 911 || got > 912 {
		t.Errorf("Retry-After %q during the ban, want 911 or 912: denials do not lengthen it", hdr.Get("Retry-After"))
	}
	get(t, tester, "/other", 200, "ok") // not in the zone

	b := adminDo(t, tester, http.MethodGet, "/rate_limit/ban-login/127.0.0.1", 200)
	if b["banned"] != true || b["tokens"] != 0.0 {
		t.Errorf("admin: %v, want banned with 0 tokens", b)
	}
	if left, _ := b["banned_for"].(float64); left < 898 || left > 900 {
		t.Errorf("admin: banned_for %v, want just under 900", b["banned_for"])
	}
	if z := adminDo(t, tester, http.MethodGet, "/rate_limit/ban-login", 200); z["ban"] != "15m0s" || z["bans"] != 1.0 {
		t.Errorf("admin zone: ban %v, bans %v; want 15m0s, 1", z["ban"], z["bans"])
	}
	m := scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_bans_total{zone="ban-login"}`, 1)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="ban-login"}`, 2)

	adminDo(t, tester, http.MethodDelete, "/rate_limit/ban-login/127.0.0.1", 200)
	get(t, tester, "/login", 200, "ok")
}

// Denials from many instances at once start one ban: only the denial that
// finds the bucket not banned starts it, in the same atomic call.
func TestRedisBanStartsOnce(t *testing.T) {
	r := startRedis(t)
	config := fmt.Sprintf(`{"zones":[{"name":"ban-once","rate":"1r/m","burst":3,"ban":"1h"}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"t:"}}`, r.Addr())
	hs := []*Handler{newTestHandler(t, config), newTestHandler(t, config)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for i := range 40 {
		wg.Go(func() {
			code, _ := serve(hs[i%2], "192.0.2.60")
			mu.Lock()
			codes[code]++
			mu.Unlock()
		})
	}
	wg.Wait()
	if codes[200] != 3 || codes[429] != 37 {
		t.Fatalf("codes %v, want 3 × 200 and 37 × 429", codes)
	}
	if n := hs[0].Zones[0].state.bans.Load(); n != 1 {
		t.Fatalf("%d bans started, want 1", n)
	}
	hash, _ := bucketOf(hs[0], 0, "192.0.2.60")
	ttl := r.CLI("PTTL", hash)
	if ms, _ := strconv.Atoi(ttl); ms < 3600_000 || ms > 3780_000 {
		t.Fatalf("PTTL %s, want the ban and a refill: just under 3780000 ms", ttl)
	}
	// The over-limit cache learns the ban from a denial's reply: the
	// denials after it ask Redis nothing. (Under the burst above, a late
	// allowed reply may have made the cache forget, which is safe.)
	serve(hs[0], "192.0.2.60")
	calls := r.Calls()
	for range 3 {
		if code, hdr := serve(hs[0], "192.0.2.60"); code != 429 || len(hdr.Get("Retry-After")) != 4 {
			t.Fatalf("during the ban: %d, Retry-After %s, want 429 and about 3660", code, hdr.Get("Retry-After"))
		}
	}
	if n := r.Calls() - calls; n != 0 {
		t.Fatalf("denials during a known ban asked Redis %d times", n)
	}
}

// The exceeded event says whether the denial started a ban.
func TestExceededEventBan(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"events-ban","rate":"1r/m","burst":1,"ban":"10m"}]}`)
	sub := recordEvents(t, h)
	for range 3 {
		serve(h, "192.0.2.41")
	}
	if len(sub.events) != 2 || sub.events[0].Data["ban"] != true || sub.events[1].Data["ban"] != false {
		t.Fatalf("events %v, want a denial that starts the ban, then one that does not", sub.events)
	}
}

// With count, only the responses that match are charged: tokens are taken
// before the request goes on, so concurrent wrong passwords get no more
// tries than the burst, and given back after a response that does not
// match. A later handler's error counts by its status.
func TestCount(t *testing.T) {
	r := startRedis(t)
	for _, storeCfg := range []string{"local", "redis"} {
		t.Run(storeCfg, func(t *testing.T) {
			storeConfig := ""
			if storeCfg == "redis" {
				storeConfig = fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\ttimeout 5s\n\t\t}", r.Addr())
			}
			zone := "count-" + storeCfg
			tester := startCaddy(t, "", fmt.Sprintf(`
http://localhost {
	rate_limit {
		zone %s {
			rate 5/m
			burst 5
			ban 15m
			count status 401
		}
		%s
	}
	respond /good "ok" 200
	respond /bad 401
	error /err "wrong password" 401
}`, zone, storeConfig))
			for range 20 {
				get(t, tester, "/good", 200, "ok")
			}
			var wg sync.WaitGroup
			var mu sync.Mutex
			codes := map[int]int{}
			for i := range 50 {
				wg.Go(func() {
					path := []string{"/bad", "/err"}[i%2]
					resp, err := tester.Client.Get(siteURL + path)
					if err != nil {
						t.Error(err)
						return
					}
					resp.Body.Close()
					mu.Lock()
					codes[resp.StatusCode]++
					mu.Unlock()
				})
			}
			wg.Wait()
			if codes[401] != 5 || codes[429] != 45 {
				t.Fatalf("50 concurrent wrong passwords: %v, want 5 × 401 (the burst), 45 × 429", codes)
			}
			hdr := get(t, tester, "/good", 429, "")
			if got, _ := strconv.Atoi(hdr.Get("Retry-After")); got < 900 || got > 912 {
				t.Errorf("Retry-After %q, want the ban's", hdr.Get("Retry-After"))
			}
			m := scrape(t, tester)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_refunds_total{zone=%q}`, zone), 20)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_bans_total{zone=%q}`, zone), 1)
		})
	}
}

// The writer that count wraps around the response still flushes, and a
// response that does not match gives the tokens back at once.
func TestCountKeepsFlushing(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"count-flush","rate":"1r/m","burst":1,"count":{"status_code":[401]}}]}`)
	for i := range 3 {
		req, rr := newRequest("192.0.2.70")
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			w.WriteHeader(http.StatusOK)
			return http.NewResponseController(w).Flush()
		})
		if err := h.ServeHTTP(rr, req, next); err != nil || !rr.Flushed || rr.Code != 200 {
			t.Fatalf("request %d: err %v, flushed %t, status %d; want nil, true, 200", i, err, rr.Flushed, rr.Code)
		}
	}
	if n := h.Zones[0].state.refunds.Load(); n != 3 {
		t.Fatalf("%d refunds, want 3", n)
	}
}

// recordEvents gives h an events app whose rate_limit_exceeded events
// the returned recorder keeps.
func recordEvents(t *testing.T, h *Handler) *eventRecorder {
	t.Helper()
	app := new(caddyevents.App)
	if err := app.Provision(h.ctx); err != nil {
		t.Fatal(err)
	}
	sub := &eventRecorder{}
	if err := app.On(exceededEvent, sub); err != nil {
		t.Fatal(err)
	}
	h.events = app
	return sub
}

// BenchmarkServeHTTP is the handler's whole cost for one request, without
// Caddy's server around it: key from {client_ip}, decision, headers.
func BenchmarkServeHTTP(b *testing.B) {
	for _, tc := range []struct{ name, zone string }{
		{"allowed", `{"name":"bench-allowed","rate":"1000000000r/s"}`},
		{"allowed-ban", `{"name":"bench-allowed-ban","rate":"1000000000r/s","ban":"15m"}`},
		// count 401, and the response a 200: every request is charged,
		// then given its token back.
		{"allowed-count", `{"name":"bench-allowed-count","rate":"1000000000r/s","count":{"status_code":[401]}}`},
		{"allowed-concurrency", `{"name":"bench-allowed-concurrency","rate":"1000000000r/s","concurrency":100}`},
		{"allowed-delay", `{"name":"bench-allowed-delay","rate":"1000000000r/s","delay":"1s"}`},
		{"denied", `{"name":"bench-denied","rate":"1r/s"}`}, // Retry-After: 1
		{"allowed_api_key", `{"name":"bench-api-key","key":"{http.request.header.X-API-Key}","rate":"1000000000r/s"}`},
		{"allowed-quota", `{"name":"bench-quota","quota":999999999999999,"quota_period":"month"}`},
		{"allowed-rate-quota", `{"name":"bench-rate-quota","rate":"1000000000r/s","quota":999999999999999,"quota_period":"month"}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop() // Caddy's default level skips denial logs too
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			req.Header.Set("X-API-Key", "an-api-key-of-32-bytes-abcdefghi")
			vars := map[string]any{"client_ip": "192.0.2.1"}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				_ = h.ServeHTTP(w, req, next)
			}
		})
	}
}

// headerSink is a ResponseWriter that keeps headers and drops the rest.
type headerSink struct{ h http.Header }

func (w *headerSink) Header() http.Header { return w.h }

func (w *headerSink) Write(p []byte) (int, error) { return len(p), nil }

func (w *headerSink) WriteHeader(int) {}

// BenchmarkServeHTTPPlan is the allowed path of a zone whose rate and
// burst come with the request (plans.go), beside the same zone with
// fixed numbers: `benchstat -col /rate`. The values come from
// {http.vars.*}, as an authentication handler would set them, or from
// request headers.
func BenchmarkServeHTTPPlan(b *testing.B) {
	for _, tc := range []struct{ name, zone string }{
		{"rate=fixed", `{"name":"bench-plan-fixed","rate":"1000000000r/s","burst":1000000000}`},
		{"rate=vars", `{"name":"bench-plan-vars","rate":"{http.vars.plan_rate}","burst":"{http.vars.plan_burst}"}`},
		{"rate=header", `{"name":"bench-plan-header","rate":"{http.request.header.X-Rate}","burst":"{http.request.header.X-Burst}"}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			req.Header.Set("X-Rate", "1000000000r/s")
			req.Header.Set("X-Burst", "1000000000")
			vars := map[string]any{"client_ip": "192.0.2.1", "plan_rate": "1000000000r/s", "plan_burst": "1000000000"}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				if err := h.ServeHTTP(w, req, next); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
