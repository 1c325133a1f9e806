// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestSlotTable(t *testing.T) {
	tb := newSlotTable(2)
	a, b, c := bucketKey{s: "a"}, bucketKey{s: "b"}, bucketKey{s: "c"}
	for i, want := range []int64{1, 0} {
		free, ok := tb.acquire(a, 2)
		if !ok || free != want {
			t.Fatalf("acquire %d: free %d ok %v, want %d true", i, free, ok, want)
		}
	}
	if _, ok := tb.acquire(a, 2); ok {
		t.Fatal("third slot of two taken")
	}
	if _, ok := tb.acquire(b, 2); !ok {
		t.Fatal("key b refused")
	}
	// Two keys are in flight: a third key is refused (max_keys 2).
	if _, ok := tb.acquire(c, 2); ok {
		t.Fatal("key c taken beyond max_keys 2")
	}
	if got := tb.len(); got != 2 {
		t.Fatalf("len %d, want 2", got)
	}
	tb.release(b)
	if got := tb.len(); got != 1 {
		t.Fatalf("after b's only slot came back: len %d, want 1 (the entry is deleted)", got)
	}
	if _, ok := tb.acquire(c, 2); !ok {
		t.Fatal("key c refused with room in the table")
	}
	tb.release(a)
	if got := tb.free(a, 2); got != 1 {
		t.Fatalf("free %d, want 1", got)
	}
	tb.release(a)
	tb.release(a) // one release too many changes nothing
	tb.release(c)
	if got := tb.len(); got != 0 {
		t.Fatalf("len %d, want 0 with nothing in flight", got)
	}
}

// TestSlotTableConcurrent never lets more than n of many goroutines hold
// a slot of one key.
func TestSlotTableConcurrent(t *testing.T) {
	tb := newSlotTable(10)
	k := bucketKey{s: "k"}
	const n = 3
	var mu sync.Mutex
	in, most := 0, 0
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 500 {
				if _, ok := tb.acquire(k, n); !ok {
					continue
				}
				mu.Lock()
				in++
				most = max(most, in)
				mu.Unlock()
				mu.Lock()
				in--
				mu.Unlock()
				tb.release(k)
			}
		})
	}
	wg.Wait()
	if most > n || most == 0 {
		t.Fatalf("at most %d in flight, want 1 to %d", most, n)
	}
	if tb.len() != 0 {
		t.Fatalf("len %d after all returned", tb.len())
	}
}

// blockingUpstream answers /block only when release is closed, and
// reports each arrival on arrived; anything else it answers at once.
func blockingUpstream(t *testing.T) (srv *httptest.Server, arrived chan struct{}, release chan struct{}) {
	arrived, release = make(chan struct{}, 16), make(chan struct{})
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/block") {
			arrived <- struct{}{}
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		io.WriteString(w, "up")
	}))
	t.Cleanup(srv.Close)
	return srv, arrived, release
}

func waitArrivals(t *testing.T, arrived chan struct{}, n int) {
	t.Helper()
	for i := range n {
		select {
		case <-arrived:
		case <-time.After(5 * time.Second):
			t.Fatalf("only %d of %d requests reached the upstream", i, n)
		}
	}
}

func TestConcurrency(t *testing.T) {
	up, arrived, release := blockingUpstream(t)
	tester := startCaddy(t, "", fmt.Sprintf(`http://localhost:9080 {
	rate_limit {
		zone rated {
			key {http.request.header.X-Key}
			rate 10r/m
		}
		zone up {
			key {http.request.header.X-Key}
			concurrency 2
		}
	}
	handle /err {
		error "boom" 500
	}
	handle /dead {
		reverse_proxy 127.0.0.1:1
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))

	// Two requests of key a block in the upstream, holding both slots.
	var wg sync.WaitGroup
	status := make([]int, 2)
	for i := range 2 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, "http://localhost:9080/block", nil)
			req.Header.Set("X-Key", "a")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			status[i] = resp.StatusCode
		})
	}
	waitArrivals(t, arrived, 2)

	// The third is refused, and gets its token of zone rated back: two
	// refusals in a row both see the 8 tokens the two in flight left.
	for range 2 {
		h := get(t, tester, "/", 429, "", "X-Key", "a")
		if got := h.Get("Retry-After"); got != "1" {
			t.Errorf("Retry-After %q, want 1", got)
		}
		if got, want := h.Get("Ratelimit-Policy"), `"rated";q=10;w=60, "up";q=2`; got != want {
			t.Errorf("RateLimit-Policy %q, want %q", got, want)
		}
		if got, want := h.Get("Ratelimit"), `"rated";r=8;t=6, "up";r=0`; got != want {
			t.Errorf("RateLimit %q, want %q", got, want)
		}
	}
	// Another key has its own slots.
	if h := get(t, tester, "/", 200, "up", "X-Key", "b"); !strings.Contains(h.Get("Ratelimit"), `"up";r=1`) {
		t.Errorf("key b: RateLimit %q, want up's r=1", h.Get("Ratelimit"))
	}

	close(release)
	wg.Wait()
	for i, s := range status {
		if s != 200 {
			t.Errorf("blocked request %d: status %d, want 200", i, s)
		}
	}
	if h := get(t, tester, "/", 200, "up", "X-Key", "a"); !strings.Contains(h.Get("Ratelimit"), `"up";r=1`) {
		t.Errorf("after release: RateLimit %q, want up's r=1", h.Get("Ratelimit"))
	}

	// Slots come back after errors: a handler error and a dead upstream.
	// Had they leaked, the third request would be refused.
	for range 3 {
		get(t, tester, "/err", 500, "", "X-Key", "c")
		get(t, tester, "/dead", 502, "", "X-Key", "c")
	}
	if h := get(t, tester, "/", 200, "up", "X-Key", "c"); !strings.Contains(h.Get("Ratelimit"), `"up";r=1`) {
		t.Errorf("after errors: RateLimit %q, want up's r=1", h.Get("Ratelimit"))
	}
}

// TestConcurrencyClientGone gives back the slot of a request whose client
// left while the upstream was answering.
func TestConcurrencyClientGone(t *testing.T) {
	up, arrived, _ := blockingUpstream(t)
	tester := startCaddy(t, "", fmt.Sprintf(`http://localhost:9080 {
	rate_limit {
		zone up {
			key {http.request.header.X-Key}
			concurrency 1
		}
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://localhost:9080/block", nil)
		req.Header.Set("X-Key", "a")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	waitArrivals(t, arrived, 1)
	get(t, tester, "/", 429, "", "X-Key", "a")
	cancel()
	<-done
	deadline := time.Now().Add(3 * time.Second)
	for {
		req, _ := http.NewRequest(http.MethodGet, "http://localhost:9080/", nil)
		req.Header.Set("X-Key", "a")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the slot of a client that left is not back: status %d", resp.StatusCode)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConcurrencyOtherZoneDenies: a request that another zone refuses
// holds no slot.
func TestConcurrencyOtherZoneDenies(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost:9080 {
	rate_limit {
		zone strict {
			match path /strict
			rate 1r/m
		}
		zone up {
			key static
			concurrency 1
		}
	}
	respond "ok"
}
`)
	get(t, tester, "/strict", 200, "ok")
	for range 3 {
		h := get(t, tester, "/strict", 429, "")
		if got := h.Get("Retry-After"); got == "1" {
			t.Errorf("refused by strict, Retry-After %q: want strict's wait", got)
		}
	}
	if h := get(t, tester, "/", 200, "ok"); h.Get("Ratelimit") != `"up";r=0` {
		t.Errorf("RateLimit %q, want %q", h.Get("Ratelimit"), `"up";r=0`)
	}
	if h := get(t, tester, "/", 200, "ok"); h.Get("X-Ratelimit-Limit") != "" {
		t.Errorf("X-RateLimit-Limit %q for a zone without a rate, want none", h.Get("X-Ratelimit-Limit"))
	}
}

// TestConcurrencyDirect drives a handler without a server: slots come
// back after an error and after a panic in the handlers that follow.
func TestConcurrencyDirect(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"direct_conc","key":"{http.request.header.X-Key}","concurrency":2}],"headers":"ietf"}`)
	release, arrived := make(chan struct{}), make(chan struct{}, 2)
	blocking := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		arrived <- struct{}{}
		<-release
		return nil
	})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			req, rr := newRequest("10.0.0.1", "X-Key", "a")
			if err := h.ServeHTTP(rr, req, blocking); err != nil {
				t.Error(err)
			}
		})
	}
	waitArrivals(t, arrived, 2)
	req, rr := newRequest("10.0.0.1", "X-Key", "a")
	err := h.ServeHTTP(rr, req, okHandler)
	if statusOf(err) != http.StatusTooManyRequests {
		t.Fatalf("third request in flight: %v, want a 429", err)
	}
	if got := rr.Header().Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After %q, want 1", got)
	}
	close(release)
	wg.Wait()

	failing := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		return caddyhttp.Error(http.StatusBadGateway, io.ErrUnexpectedEOF)
	})
	panicking := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic("boom") })
	for range 3 {
		req, rr := newRequest("10.0.0.1", "X-Key", "a")
		if err := h.ServeHTTP(rr, req, failing); statusOf(err) != http.StatusBadGateway {
			t.Fatalf("failing handler: %v, want its 502", err)
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Error("the panic did not reach the caller")
				}
			}()
			req, rr := newRequest("10.0.0.1", "X-Key", "a")
			h.ServeHTTP(rr, req, panicking)
		}()
	}
	req, rr = newRequest("10.0.0.1", "X-Key", "a")
	if err := h.ServeHTTP(rr, req, okHandler); err != nil {
		t.Fatalf("after errors and panics: %v", err)
	}
	if got, want := rr.Header().Get("Ratelimit"), `"direct_conc";r=1`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if n := h.Zones[0].slots.len(); n != 0 {
		t.Errorf("%d keys in flight with none running, want 0", n)
	}
}

// TestConcurrencyRedisRefused: the Redis store has no slots yet, and says
// so when the config loads.
func TestConcurrencyRedisRefused(t *testing.T) {
	r := startRedis(t)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	h := new(Handler)
	if err := json.Unmarshal(fmt.Appendf(nil, `{"zones":[{"name":"redis_conc","concurrency":2}],"store":{"backend":"redis","addresses":[%q]}}`, r.addr()), h); err != nil {
		t.Fatal(err)
	}
	err := h.Provision(ctx)
	h.Cleanup()
	if err == nil || !strings.Contains(err.Error(), "zone redis_conc: concurrency is not supported with store redis") {
		t.Fatalf("provision: %v, want concurrency refused with store redis", err)
	}
}
