// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// 10,000 wrong passwords sent at once, 500 in flight, to basic_auth behind
// `count { status 401 }` with a burst of 5 and a ban: basic_auth sees 5 of
// them, and the 6th starts the ban, which then refuses the right password
// too. basic_auth answers a wrong password with an error, not a written
// response: count reads its status from the error.
func TestCountWrongPasswordFlood(t *testing.T) {
	total, inFlight := 10000, 500
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", storeJSON()},
		// A timeout for a loaded test machine, not the default 100ms:
		// a call that times out would let fail_mode decide, and its
		// local buckets would start a ban of their own.
		{"redis", storeJSON(r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "flood-" + tc.name
			tester := loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[{"name":"`+zone+`",
				"rate":"5/h","burst":5,"ban":"1h","count":{"status_code":[401]}}],"store":`+tc.store+`},
				{"handler":"rate_limit_test_pass_counter","name":"`+zone+`"},
				`+basicAuth+`,
				{"handler":"static_response","body":"welcome"}`))
			c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
				MaxConnsPerHost: inFlight, MaxIdleConnsPerHost: inFlight,
			}}
			defer c.CloseIdleConnections()
			const ip = "198.51.100.7"

			start := time.Now()
			var codes [600]atomic.Int64
			var failed atomic.Int64
			var next atomic.Int64
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for range inFlight {
				wg.Go(func() {
					<-gate
					for i := next.Add(1); i <= int64(total); i = next.Add(1) {
						req, _ := http.NewRequest(http.MethodGet, siteIPURL+"/", nil)
						req.Header.Set("X-Forwarded-For", ip)
						req.Header.Set("Authorization", password("guess-"+strconv.FormatInt(i, 10)))
						resp, err := c.Do(req)
						if err != nil {
							if failed.Add(1) == 1 {
								t.Errorf("request %d: %v", i, err)
							}
							continue
						}
						resp.Body.Close()
						codes[min(resp.StatusCode, len(codes)-1)].Add(1)
					}
				})
			}
			close(gate)
			wg.Wait()
			elapsed := time.Since(start)
			t.Logf("%d wrong passwords, %d in flight: %v", total, inFlight, elapsed)

			seen := passed(zone).Load()
			if n401, n429 := codes[401].Load(), codes[429].Load(); seen != 5 || n401 != 5 || n429 != int64(total-5) || failed.Load() != 0 {
				t.Fatalf("basic_auth saw %d guesses; clients got %d × 401, %d × 429, %d errors; want 5 seen, 5 × 401, %d × 429",
					seen, n401, n429, failed.Load(), total-5)
			}
			// The ban holds the right password out too: an hour and a
			// token (720s at 5/h), less the time the flood took.
			code, _, retry := hit(t, c, "/", ip, "Authorization", password("right-password"))
			if code != 429 || retry < 4320-int(elapsed.Seconds())-2 || retry > 4320 {
				t.Fatalf("right password during the ban: %d, Retry-After %d; want 429 and about 4320", code, retry)
			}
			if n := passed(zone).Load(); n != 5 {
				t.Fatalf("basic_auth saw %d requests, want still 5", n)
			}
			m := scrape(t, tester)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_bans_total{zone=%q}`, zone), 1)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_requests_total{result="denied",zone=%q}`, zone), float64(total-4))
			// Another client logs in.
			if code, body, _ := hit(t, c, "/", "198.51.100.8", "Authorization", password("right-password")); code != 200 || body != "welcome" {
				t.Fatalf("another client with the right password: %d %q", code, body)
			}
		})
	}
}

// count on a Redis Cluster, with two zones whose keys are in different
// slots, so taken zone by zone: responses that do not match give the
// tokens back in both, and a request that the second zone denies gives
// back what the first took.
func TestCountCluster(t *testing.T) {
	var addrs []string
	for _, n := range startCluster(t) {
		addrs = append(addrs, n.Addr())
	}
	tester := loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[
			{"name":"count-user","key":"{http.request.header.X-User}","rate":"5/h","burst":10,"count":{"status_code":[401]}},
			{"name":"count-ip","rate":"5/h","burst":3,"count":{"status_code":[401]}}],
		"store":`+storeJSON(addrs...)+`},
		{"handler":"subroute","routes":[
			{"match":[{"path":["/bad"]}],"handle":[{"handler":"static_response","status_code":401}]},
			{"handle":[{"handler":"static_response","body":"ok"}]}]}`))
	c := &http.Client{Timeout: 10 * time.Second}
	const ip = "198.51.100.40"
	ratelimit := func(path, ip, user string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, siteIPURL+path, nil)
		req.Header.Set("X-Forwarded-For", ip)
		req.Header.Set("X-User", user)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("RateLimit")
	}
	for i := range 10 {
		code, rl := ratelimit("/good", ip, "alice")
		if code != 200 || !strings.Contains(rl, `"count-user";r=9;`) || !strings.Contains(rl, `"count-ip";r=2;`) {
			t.Fatalf("good request %d: %d, RateLimit %q; want 200 with 9 and 2 left: the others gave their tokens back", i, code, rl)
		}
	}

	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range 20 {
		wg.Go(func() {
			code, _ := ratelimit("/bad", ip, "alice")
			mu.Lock()
			codes[code]++
			mu.Unlock()
		})
	}
	wg.Wait()
	if codes[401] != 3 || codes[429] != 17 {
		t.Fatalf("20 concurrent wrong passwords: %v, want 3 × 401 (the ip zone's burst), 17 × 429", codes)
	}
	// alice's bucket paid for the 3 wrong passwords that went on, and
	// for nothing that the ip zone denied.
	if code, rl := ratelimit("/good", "198.51.100.41", "alice"); code != 200 || !strings.Contains(rl, `"count-user";r=6;`) {
		t.Fatalf("alice from another address: %d, RateLimit %q; want 200 with 6 left", code, rl)
	}
	if code, _ := ratelimit("/good", ip, "bob"); code != 429 {
		t.Fatalf("bob from the address that guessed: %d, want 429", code)
	}
	m := scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_refunds_total{zone="count-user"}`, 11)
	wantMetric(t, m, `caddy_rate_limit_refunds_total{zone="count-ip"}`, 11)
}

// count in dry run: the responses that match are charged and the others
// given back, as when enforced, but nothing is refused; the placeholder
// says which requests would have been. The ban a denial starts is noted.
func TestCountDryRun(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", storeJSON()},
		{"redis", storeJSON(r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "count-dry-" + tc.name
			tester := loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[{"name":"`+zone+`",
					"rate":"5/h","burst":2,"ban":"1h","count":{"status_code":[401]},"dry_run":true}],"store":`+tc.store+`},
				{"handler":"headers","response":{"set":{"X-Would-Deny":["{http.rate_limit.`+zone+`.would_deny}"]}}},
				{"handler":"subroute","routes":[
					{"match":[{"path":["/bad"]}],"handle":[{"handler":"static_response","status_code":401}]},
					{"handle":[{"handler":"static_response","body":"ok"}]}]}`))
			c := &http.Client{Timeout: 10 * time.Second}
			const ip = "198.51.100.50"
			step := func(i int, path string, wantCode int, wantWouldDeny string) {
				t.Helper()
				req, _ := http.NewRequest(http.MethodGet, siteIPURL+path, nil)
				req.Header.Set("X-Forwarded-For", ip)
				resp, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if got := resp.Header.Get("X-Would-Deny"); resp.StatusCode != wantCode || got != wantWouldDeny {
					t.Fatalf("step %d %s: %d, would deny %q; want %d, %q", i, path, resp.StatusCode, got, wantCode, wantWouldDeny)
				}
			}
			for i := range 5 { // given back: the bucket stays full
				step(i, "/good", 200, "false")
			}
			for i, want := range []string{"false", "false", "true", "true", "true"} {
				step(5+i, "/bad", 401, want)
			}
			step(10, "/good", 200, "true")
			m := scrape(t, tester)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_requests_total{result="dry_run_denied",zone=%q}`, zone), 4)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_requests_total{result="denied",zone=%q}`, zone), 0)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_refunds_total{zone=%q}`, zone), 5)
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_bans_total{zone=%q}`, zone), 1)
		})
	}
}

// count reads the final status however the response is written: 1xx
// responses before it are informational, a body without a status is a
// 200, a later handler's error counts by its status.
func TestCountReadsTheFinalStatus(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"count-status","rate":"1r/m","burst":100,"count":{"status_code":[401]}}]}`)
	for _, tc := range []struct {
		name    string
		next    caddyhttp.HandlerFunc
		refunds uint64 // given back: the response did not match
	}{
		{"early hints, then 401", func(w http.ResponseWriter, _ *http.Request) error {
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusUnauthorized)
			return nil
		}, 0},
		{"early hints, then 200", func(w http.ResponseWriter, _ *http.Request) error {
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusOK)
			return nil
		}, 1},
		{"401, then a body", func(w http.ResponseWriter, _ *http.Request) error {
			w.WriteHeader(http.StatusUnauthorized)
			_, err := w.Write([]byte("no"))
			return err
		}, 0},
		{"a body alone", func(w http.ResponseWriter, _ *http.Request) error {
			_, err := w.Write([]byte("yes"))
			return err
		}, 1},
		{"a body copied", func(w http.ResponseWriter, _ *http.Request) error {
			_, err := io.Copy(w, strings.NewReader("yes"))
			return err
		}, 1},
		{"nothing written", func(http.ResponseWriter, *http.Request) error { return nil }, 1},
		{"an error 401", func(http.ResponseWriter, *http.Request) error {
			return caddyhttp.Error(http.StatusUnauthorized, nil)
		}, 0},
		{"an error 500", func(http.ResponseWriter, *http.Request) error { return fmt.Errorf("broken") }, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := h.Zones[0].state.refunds.Load()
			req, rr := newRequest("192.0.2.80")
			_ = h.ServeHTTP(rr, req, tc.next)
			if got := h.Zones[0].state.refunds.Load() - before; got != tc.refunds {
				t.Fatalf("%d refunds, want %d", got, tc.refunds)
			}
		})
	}
	// The 3 responses that matched kept their tokens.
	if code, hdr := serve(h, "192.0.2.80"); code != 200 || !strings.Contains(hdr.Get("Ratelimit"), "r=96;") {
		t.Fatalf("%d, RateLimit %q; want 200 with 96 left", code, hdr.Get("Ratelimit"))
	}
}

// A client that leaves before its response gets the tokens of a response
// that does not match back all the same, from Redis too.
func TestCountRefundsWhenClientGone(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"count-gone","rate":"1r/m","burst":2,"count":{"status_code":[401]}}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"t:"}}`, r.Addr()))
	for i := range 3 {
		req, rr := newRequest("192.0.2.81")
		ctx, cancel := context.WithCancel(req.Context())
		req = req.WithContext(ctx)
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
			cancel() // the client goes
			w.WriteHeader(http.StatusOK)
			return nil
		})
		if err := h.ServeHTTP(rr, req, next); err != nil || rr.Code != 200 {
			t.Fatalf("request %d: %v, %d", i, err, rr.Code)
		}
	}
	if n := h.Zones[0].state.refunds.Load(); n != 3 {
		t.Fatalf("%d refunds, want 3", n)
	}
	if keys := r.CLI("DBSIZE"); keys != "0" {
		t.Fatalf("%s keys in Redis, want none: every bucket is full again", keys)
	}
}

// The writer that count wraps around the response offers what the writer
// it wraps offers, to handlers that check for it themselves.
func TestCountWriterInterfaces(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"count-writer","rate":"1r/m","burst":1,"count":{"status_code":[401]}}]}`)
	req, rr := newRequest("192.0.2.82")
	var checked bool
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		f, flusher := w.(http.Flusher)
		hj, hijacker := w.(http.Hijacker)
		_, unwraps := w.(interface{ Unwrap() http.ResponseWriter })
		if !flusher || !hijacker || !unwraps {
			t.Fatalf("flusher %t, hijacker %t, unwraps %t; want all", flusher, hijacker, unwraps)
		}
		w.WriteHeader(http.StatusOK)
		f.Flush()
		// httptest's recorder cannot be hijacked: the error says so.
		if _, _, err := hj.Hijack(); err == nil {
			t.Fatal("hijacked a writer that cannot be")
		}
		checked = true
		return nil
	})
	if err := h.ServeHTTP(rr, req, next); err != nil || !checked || !rr.Flushed {
		t.Fatalf("err %v, checked %t, flushed %t", err, checked, rr.Flushed)
	}
}
