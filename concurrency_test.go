// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

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
	tester := startCaddy(t, "", fmt.Sprintf(`http://localhost {
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
			req, _ := http.NewRequest(http.MethodGet, siteURL+"/block", nil)
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
		if got, want := h.Get("Ratelimit-Policy"), `"rated";q=10;w=60, "up";q=2;qu="concurrent-requests"`; got != want {
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
	tester := startCaddy(t, "", fmt.Sprintf(`http://localhost {
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
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, siteURL+"/block", nil)
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
		req, _ := http.NewRequest(http.MethodGet, siteURL+"/", nil)
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
	tester := startCaddy(t, "", `http://localhost {
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
	if n := slotsOf(h, h.Zones[0]).Len(); n != 0 {
		t.Errorf("%d keys in flight with none running, want 0", n)
	}
}

// The zones of the slot steps: r 1r/m burst 3 and s concurrency 2 on
// header X-Key, u concurrency 1 on header X-User (another hash tag: a
// cluster decides it apart). Each applies when header X-<zone> is 1.
const slotStepZones = `[
	{"name":"%[1]sr","key":"{http.request.header.X-Key}","rate":"1r/m","burst":3,"match":[{"header":{"X-R":["1"]}}]},
	{"name":"%[1]ss","key":"{http.request.header.X-Key}","concurrency":2,"match":[{"header":{"X-S":["1"]}}]},
	{"name":"%[1]su","key":"{http.request.header.X-User}","concurrency":1,"match":[{"header":{"X-U":["1"]}}]}]`

type slotStep struct {
	zones     string // the zones the request matches, e.g. "rs"; "" releases the slots of step release
	key, user string
	release   int
	ok        bool
	rem       int64   // whole tokens left in r; -1 when r does not apply
	free      []int64 // slots free after the decision, per slot zone; nil: not checked
}

var slotSteps = []slotStep{
	0: {zones: "s", key: "k", ok: true, rem: -1, free: []int64{1}},
	1: {zones: "s", key: "k", ok: true, rem: -1, free: []int64{0}},
	2: {zones: "s", key: "k", ok: false, rem: -1, free: []int64{0}},
	// s is full: r must not be charged.
	3:  {zones: "rs", key: "k", ok: false, rem: 3, free: []int64{0}},
	4:  {release: 0},
	5:  {zones: "rs", key: "k", ok: true, rem: 2, free: []int64{0}},
	6:  {zones: "rs", key: "k", ok: false, rem: 2, free: []int64{0}},
	7:  {release: 1},
	8:  {release: 5},
	9:  {zones: "rs", key: "k", ok: true, rem: 1, free: []int64{1}},
	10: {zones: "r", key: "k", ok: true, rem: 0},
	// r is empty: no slot of s is taken, as the next two steps show.
	11: {zones: "rs", key: "k", ok: false, rem: 0},
	12: {zones: "s", key: "k", ok: true, rem: -1, free: []int64{0}},
	13: {zones: "s", key: "k", ok: false, rem: -1, free: []int64{0}},
	// u is full: no slot of s is taken.
	14: {zones: "su", key: "k2", user: "x", ok: true, rem: -1, free: []int64{1, 0}},
	15: {zones: "su", key: "k2", user: "x", ok: false, rem: -1, free: []int64{1, 0}},
	16: {zones: "s", key: "k2", ok: true, rem: -1, free: []int64{0}},
	17: {zones: "s", key: "k2", ok: false, rem: -1, free: []int64{0}},
	18: {release: 14},
	19: {zones: "su", key: "k3", user: "x", ok: true, rem: -1, free: []int64{1, 0}},
}

// runSlotSteps replays slotSteps through h's decision, holding the slots
// of each allowed step until a release step gives them back, and then
// gives back all that are left.
func runSlotSteps(t *testing.T, h *Handler) {
	t.Helper()
	type held struct {
		r  *http.Request
		sc *scratch
	}
	holding := map[int]held{}
	for i, s := range slotSteps {
		if s.zones == "" {
			hd, ok := holding[s.release]
			if !ok {
				t.Fatalf("step %d: step %d holds nothing", i, s.release)
			}
			h.releaseSlots(hd.r, hd.sc)
			delete(holding, s.release)
			continue
		}
		header := []string{"X-Key", s.key, "X-User", s.user}
		for _, c := range s.zones {
			header = append(header, "X-"+strings.ToUpper(string(c)), "1")
		}
		req, rr := newRequest("10.0.0.1", header...)
		sc := h.scratch.Get().(*scratch)
		out, err := h.decide(rr, req, sc)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if got := out == outcomeAllow; got != s.ok {
			t.Fatalf("step %d: allowed = %v, want %v", i, got, s.ok)
		}
		if s.rem >= 0 {
			if len(sc.d.Buckets) != 1 {
				t.Fatalf("step %d: %d rate zones applied, want 1", i, len(sc.d.Buckets))
			}
			if got := sc.d.Buckets[0].Remaining(); got != s.rem {
				t.Fatalf("step %d: r has %d tokens left, want %d", i, got, s.rem)
			}
		}
		if s.free != nil {
			if len(sc.d.Slots) != len(s.free) {
				t.Fatalf("step %d: %d zones with concurrency applied, want %d", i, len(sc.d.Slots), len(s.free))
			}
			for j, want := range s.free {
				if got := sc.d.Slots[j].Free; got != want {
					t.Fatalf("step %d: zone %s has %d slots free, want %d", i, h.Zones[sc.d.Slots[j].Zone].Name, got, want)
				}
			}
		}
		if out == outcomeAllow {
			holding[i] = held{req, sc}
		} else {
			h.releaseSlots(req, sc)
		}
	}
	for _, hd := range holding {
		h.releaseSlots(hd.r, hd.sc)
	}
}

// One table of slot steps gives the same decisions with the local slot
// tables and with Redis's leases, alone and on a cluster (where u's key
// is in another slot than r's and s's), with and without the over-limit
// cache; and nothing is left held after.
func TestSlotStepsAgree(t *testing.T) {
	t.Run("local", func(t *testing.T) {
		h := newTestHandler(t, `{"zones":`+fmt.Sprintf(slotStepZones, "agree-slots-")+`}`)
		runSlotSteps(t, h)
		for _, z := range h.Zones[1:] {
			if n := slotsOf(h, z).Len(); n != 0 {
				t.Errorf("zone %s: %d keys in flight after all came back", z.Name, n)
			}
		}
	})
	r := startRedis(t)
	for _, storeCfg := range []string{`,"disable_over_limit_cache":true`, ``} {
		t.Run("redis"+storeCfg, func(t *testing.T) {
			prefix := t.Name() + ":"
			h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":%q%s}}`,
				fmt.Sprintf(slotStepZones, ""), r.Addr(), prefix, storeCfg))
			runSlotSteps(t, h)
			c := newRedisClient(t, r.Addr())
			keys, err := c.Keys(context.Background(), prefix+"*:s").Result()
			if err != nil {
				t.Fatal(err)
			}
			if len(keys) != 0 {
				t.Errorf("slot keys left after all came back: %v", keys)
			}
			for _, z := range h.Zones[1:] {
				if n := slotsOf(h, z).Len(); n != 0 {
					t.Errorf("zone %s: %d keys in the local tables, which only fail_mode local uses", z.Name, n)
				}
			}
		})
	}
	t.Run("cluster", func(t *testing.T) {
		nodes := startCluster(t)
		h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s"}}`,
			fmt.Sprintf(slotStepZones, ""), nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
		k := slotKeyName(defaultKeyPrefix, h.Zones[1].Name, h.Zones[1].keyFor("k2").String())
		u := slotKeyName(defaultKeyPrefix, h.Zones[2].Name, h.Zones[2].keyFor("x").String())
		ks, us := nodes[0].CLI("CLUSTER", "KEYSLOT", k), nodes[0].CLI("CLUSTER", "KEYSLOT", u)
		if ks == us {
			t.Fatalf("%s and %s share cluster slot %s: the steps would not cross slots", k, u, ks)
		}
		runSlotSteps(t, h)
	})
}

// Three instances (a Caddy server and two handlers with their own
// connections) share the slots of one Redis: with concurrency 4, hundreds
// of concurrent clients never have a fifth request in flight upstream,
// and every slot comes back.
func TestConcurrencyRedisInstances(t *testing.T) {
	r := startRedis(t)
	var inFlight, most, served atomic.Int64
	work := func() {
		n := inFlight.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(2 * time.Millisecond)
		served.Add(1)
		inFlight.Add(-1)
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		work()
		io.WriteString(w, "up")
	}))
	defer up.Close()
	storeCfg := `store redis {
			address %s
			key_prefix inst:
			timeout 5s
			fail_mode closed
		}`
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone inst_conc {
			key static
			concurrency 4
		}
		`+storeCfg+`
	}
	reverse_proxy %s
}
`, r.Addr(), strings.TrimPrefix(up.URL, "http://")))
	var handlers []*Handler
	for _, pool := range []int{7, 9} { // distinct pools: distinct clients
		handlers = append(handlers, newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"inst_conc","key":"static","concurrency":4}],
			"store":{"backend":"redis","addresses":[%q],"key_prefix":"inst:","timeout":"5s","fail_mode":"closed","pool_size":%d}}`, r.Addr(), pool)))
	}
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		work()
		return nil
	})

	const clients, each = 100, 5
	var statuses sync.Map // status -> *atomic.Int64
	note := func(code int) {
		v, _ := statuses.LoadOrStore(code, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	var wg sync.WaitGroup
	for c := range 3 * clients {
		wg.Go(func() {
			for range each {
				if c%3 == 2 {
					resp, err := client.Get(siteURL + "/")
					if err != nil {
						t.Error(err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					note(resp.StatusCode)
					continue
				}
				req, rr := newRequest("10.0.0.1")
				if err := handlers[c%3].ServeHTTP(rr, req, next); err != nil {
					note(statusOf(err))
				} else {
					note(rr.Code)
				}
			}
		})
	}
	wg.Wait()
	counts := map[int]int64{}
	statuses.Range(func(k, v any) bool {
		counts[k.(int)] = v.(*atomic.Int64).Load()
		return true
	})
	t.Logf("statuses %v, at most %d in flight, %d served", counts, most.Load(), served.Load())
	if m := most.Load(); m > 4 || m < 2 {
		t.Fatalf("at most %d requests in flight upstream, want 2 to 4", m)
	}
	if counts[200]+counts[429] != 3*clients*each || counts[200] == 0 || counts[429] == 0 {
		t.Fatalf("statuses %v: want only 200s and 429s, of each some", counts)
	}
	if counts[200] != served.Load() {
		t.Fatalf("%d allowed, %d served", counts[200], served.Load())
	}
	if n := r.CLI("EXISTS", slotKeyName("inst:", "inst_conc", "static")); n != "0" {
		t.Fatalf("the slot key is left with slots held: %s", r.CLI("ZRANGE", slotKeyName("inst:", "inst_conc", "static"), "0", "-1", "WITHSCORES"))
	}
}

// An instance that dies holding slots (here: takes them and never gives
// them back) holds them until their lease ends; the key expires with the
// last lease.
func TestConcurrencyRedisLease(t *testing.T) {
	r := startRedis(t)
	const lease = 700 * time.Millisecond
	config := func(pool int) string {
		return fmt.Sprintf(`{"zones":[{"name":"lease_conc","key":"{http.request.header.X-Key}","concurrency":2,"lease":%d}],
			"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"lease:","pool_size":%d}}`, lease, r.Addr(), pool)
	}
	dead, alive := newTestHandler(t, config(5)), newTestHandler(t, config(6))
	start := time.Now()
	for i := range 2 {
		req, rr := newRequest("10.0.0.1", "X-Key", "a")
		sc := dead.scratch.Get().(*scratch)
		if out, err := dead.decide(rr, req, sc); out != outcomeAllow || err != nil {
			t.Fatalf("slot %d: %v %v", i, out, err)
		}
		// Never released: the instance is gone.
	}
	key := slotKeyName("lease:", "lease_conc", "a")
	if pttl, _ := strconv.Atoi(r.CLI("PTTL", key)); pttl <= 0 || pttl > int(lease/time.Millisecond) {
		t.Fatalf("PTTL %d of the slot key, want up to the lease, %v", pttl, lease)
	}
	if code, hdr := serve(alive, "10.0.0.1", "X-Key", "a"); code != http.StatusTooManyRequests || hdr.Get("Retry-After") != "1" {
		t.Fatalf("with both slots held elsewhere: %d, Retry-After %q; want 429, 1", code, hdr.Get("Retry-After"))
	}
	if code, _ := serve(alive, "10.0.0.1", "X-Key", "b"); code != http.StatusOK {
		t.Fatalf("another key: %d", code)
	}
	time.Sleep(time.Until(start.Add(lease + 50*time.Millisecond)))
	code, hdr := serve(alive, "10.0.0.1", "X-Key", "a")
	if code != http.StatusOK {
		t.Fatalf("after the lease: %d, want 200", code)
	}
	if got := hdr.Get("Ratelimit"); got != `"lease_conc";r=1` {
		t.Fatalf("after the lease: RateLimit %q: the dead instance's leases still count", got)
	}
	if n := r.CLI("EXISTS", key); n != "0" {
		t.Fatalf("slot key left after its leases ended and the last came back: %s", r.CLI("ZRANGE", key, "0", "-1", "WITHSCORES"))
	}
}

// A rate zone and a zone with concurrency are decided in one script call,
// all or nothing: a full zone spends no token, a denying rate takes no
// slot. An allowed request costs two calls: the decision and the release.
func TestConcurrencyRedisOneCall(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"one_rate","key":"{http.request.header.X-Key}","rate":"1r/m","burst":3},
		{"name":"one_conc","key":"{http.request.header.X-Key}","concurrency":1}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"one:"}}`, r.Addr()))
	release, arrived := make(chan struct{}), make(chan struct{}, 1)
	blocking := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		arrived <- struct{}{}
		<-release
		return nil
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, rr := newRequest("10.0.0.1", "X-Key", "a")
		if err := h.ServeHTTP(rr, req, blocking); err != nil {
			t.Error(err)
		}
	}()
	waitArrivals(t, arrived, 1)
	calls := r.Calls()
	for range 3 {
		code, hdr := serve(h, "10.0.0.1", "X-Key", "a")
		if code != http.StatusTooManyRequests {
			t.Fatalf("slot held: %d, want 429", code)
		}
		if got, want := hdr.Get("Ratelimit"), `"one_rate";r=2;t=60, "one_conc";r=0`; got != want {
			t.Fatalf("RateLimit %q, want %q: the full zone must spend no token", got, want)
		}
	}
	if n := r.Calls() - calls; n != 3 {
		t.Fatalf("%d script calls for 3 refused requests, want 3", n)
	}
	close(release)
	<-done

	calls = r.Calls()
	for i := range 2 {
		if code, _ := serve(h, "10.0.0.1", "X-Key", "a"); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	if n := r.Calls() - calls; n != 4 {
		t.Fatalf("%d script calls for 2 allowed requests, want 4 (a decision and a release each)", n)
	}
	// The rate is empty: the next request takes no slot.
	if code, _ := serve(h, "10.0.0.1", "X-Key", "a"); code != http.StatusTooManyRequests {
		t.Fatalf("rate empty: %d, want 429", code)
	}
	if n := r.CLI("EXISTS", slotKeyName("one:", "one_conc", "a")); n != "0" {
		t.Fatalf("a slot is held after a request the rate zone refused: %s", r.CLI("ZRANGE", slotKeyName("one:", "one_conc", "a"), "0", "-1"))
	}
}

// When Redis fails, fail_mode decides the slots too: local uses this
// instance's slot tables, open lets requests through, closed answers 503.
func TestConcurrencyRedisFailModes(t *testing.T) {
	for _, mode := range []string{"local", "open", "closed"} {
		t.Run(mode, func(t *testing.T) {
			r := startRedis(t)
			h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"fail_conc_%s","key":"static","concurrency":1}],
				"store":{"backend":"redis","addresses":[%q],"fail_mode":%q,"timeout":"50ms"}}`, mode, r.Addr(), mode))
			r.Kill()
			release, arrived := make(chan struct{}), make(chan struct{}, 1)
			blocking := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				arrived <- struct{}{}
				<-release
				return nil
			})
			first := make(chan int, 1)
			go func() {
				req, rr := newRequest("10.0.0.1")
				if err := h.ServeHTTP(rr, req, blocking); err != nil {
					first <- statusOf(err)
					arrived <- struct{}{}
					return
				}
				first <- rr.Code
			}()
			waitArrivals(t, arrived, 1)
			second, _ := serve(h, "10.0.0.1")
			close(release)
			want := map[string][2]int{"local": {200, 429}, "open": {200, 200}, "closed": {503, 503}}[mode]
			if got := [2]int{<-first, second}; got != want {
				t.Fatalf("with Redis down, one request in flight: statuses %v, want %v", got, want)
			}
			if n := slotsOf(h, h.Zones[0]).Len(); n != 0 {
				t.Fatalf("%d keys left in the local slot table", n)
			}
		})
	}
}

// After an outage, Redis decides the slots again with no request paying
// for it: Redis frozen then thawed, and, however long after, of three
// requests at once with concurrency 2, the third is refused (the store
// probed Redis in the background, so none of them is decided by the
// local slot table, which knows nothing of Redis's).
func TestConcurrencyAfterOutage(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"after_outage","key":"static","concurrency":2}],
		"store":{"backend":"redis","addresses":[%q],"fail_mode":"local","timeout":"50ms"}}`, r.Addr()))
	r.Pause()
	for i := 0; !h.store.Stats(0).Unavailable; i++ {
		if i == 20 {
			t.Fatal("the breaker is closed with Redis frozen")
		}
		serve(h, "10.0.0.1")
	}
	r.Resume()
	waitFor(t, 5*time.Second, "the breaker's probes finding Redis back", func() bool { return !h.store.Stats(0).Unavailable })
	release, arrived := make(chan struct{}), make(chan struct{}, 3)
	blocking := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		arrived <- struct{}{}
		<-release
		return nil
	})
	codes := make(chan int, 3)
	for range 2 {
		go func() {
			req, rr := newRequest("10.0.0.1")
			if err := h.ServeHTTP(rr, req, blocking); err != nil {
				codes <- statusOf(err)
				arrived <- struct{}{}
				return
			}
			codes <- rr.Code
		}()
	}
	waitArrivals(t, arrived, 2)
	third, _ := serve(h, "10.0.0.1")
	held := r.CLI("ZCARD", slotKeyName("rl:", "after_outage", "static"))
	close(release)
	if held != "2" {
		t.Fatalf("Redis holds %s slots for the two requests in flight, want 2: the fallback decided", held)
	}
	if a, b := <-codes, <-codes; a != 200 || b != 200 || third != 429 {
		t.Fatalf("three requests at once after the outage: %d %d %d, want 200 200 429", a, b, third)
	}
	if n := r.CLI("EXISTS", slotKeyName("rl:", "after_outage", "static")); n != "0" {
		t.Fatalf("slots left held in Redis")
	}
}

// The admin API shows a key's slots in use and free, on both stores.
func TestConcurrencyAdmin(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store, lease string }{
		{"adm_conc_local", ``, ""},
		{"adm_conc_redis", fmt.Sprintf(`,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"adm:"}`, r.Addr()), "1m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, fmt.Sprintf(`{"zones":[
				{"name":%q,"key":"{http.request.header.X-Key}","concurrency":3},
				{"name":"%s_both","key":"{http.request.header.X-Key}","rate":"1r/m","burst":5,"concurrency":2}]%s}`, tc.name, tc.name, tc.store))
			req, rr := newRequest("10.0.0.1", "X-Key", "a")
			sc := h.scratch.Get().(*scratch)
			if out, err := h.decide(rr, req, sc); out != outcomeAllow || err != nil {
				t.Fatalf("%v %v", out, err)
			}
			admin := func(path string) map[string]any {
				t.Helper()
				rec := httptest.NewRecorder()
				if err := (adminAPI{}).serve(rec, httptest.NewRequest(http.MethodGet, path, nil)); err != nil {
					t.Fatalf("GET %s: %v", path, err)
				}
				var v map[string]any
				if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
					t.Fatal(err)
				}
				return v
			}
			got := admin("/rate_limit/" + tc.name + "/a")
			if got["in_flight"] != 1.0 || got["free"] != 2.0 || got["concurrency"] != 3.0 || got["tokens"] != nil {
				t.Fatalf("key a: %v, want 1 in flight, 2 free, no bucket", got)
			}
			got = admin("/rate_limit/" + tc.name + "_both/a")
			if tokens, _ := got["tokens"].(float64); got["in_flight"] != 1.0 || got["free"] != 1.0 || math.Abs(tokens-4) > 0.01 {
				t.Fatalf("key a of the zone with both: %v, want 1 in flight, 1 free, 4 tokens", got)
			}
			got = admin("/rate_limit/" + tc.name)
			lease, _ := got["lease"].(string)
			if _, ok := got["rate"]; ok || got["concurrency"] != 3.0 || lease != tc.lease {
				t.Fatalf("zone: %v, want concurrency 3, no rate, lease %q", got, tc.lease)
			}
			h.releaseSlots(req, sc)
			if got := admin("/rate_limit/" + tc.name + "/a"); got["in_flight"] != 0.0 || got["free"] != 3.0 {
				t.Fatalf("after release: %v", got)
			}
		})
	}
}

// A zone with concurrency in dry run lets a request that finds no slot
// free go on without one, and says so, on both stores.
func TestConcurrencyDryRunBothStores(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"dry_conc_local", ``},
		{"dry_conc_redis", fmt.Sprintf(`,"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"dry:"}`, r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":%q,"key":"static","concurrency":1,"dry_run":true}]%s}`, tc.name, tc.store))
			req, rr := newRequest("10.0.0.1")
			sc := h.scratch.Get().(*scratch)
			if out, err := h.decide(rr, req, sc); out != outcomeAllow || err != nil {
				t.Fatalf("first: %v %v", out, err)
			}
			req2, rr2 := newRequest("10.0.0.1")
			if err := h.ServeHTTP(rr2, req2, okHandler); err != nil || rr2.Code != http.StatusOK {
				t.Fatalf("second, no slot free in dry run: %v %d, want 200", err, rr2.Code)
			}
			repl := req2.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			if v, _ := repl.Get("http.rate_limit." + tc.name + ".would_deny"); v != true {
				t.Fatalf("would_deny %v, want true", v)
			}
			st := h.Zones[0].state
			if st.dryRunDenied.Load() != 1 || st.allowed.Load() != 1 {
				t.Fatalf("dry_run_denied %d, allowed %d; want 1, 1", st.dryRunDenied.Load(), st.allowed.Load())
			}
			h.releaseSlots(req, sc)
			if code, _ := serve(h, "10.0.0.1"); code != http.StatusOK || st.allowed.Load() != 2 {
				t.Fatalf("after release: %d, allowed %d", code, st.allowed.Load())
			}
		})
	}
}

// A slot key of another type under the store's prefix is repaired by the
// next decision, as bucket keys are, and is no store error.
func TestConcurrencyRedisWrongTypeSlotKey(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"wrong_conc","key":"static","concurrency":1}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"wt:","fail_mode":"closed"}}`, r.Addr()))
	key := slotKeyName("wt:", "wrong_conc", "static")
	r.CLI("SET", key, "not a set")
	for i := range 2 {
		if code, _ := serve(h, "10.0.0.1"); code != http.StatusOK {
			t.Fatalf("request %d: %d, want 200", i, code)
		}
	}
	if st := h.Zones[0].state; st.storeErrors.Load() != 0 {
		t.Fatalf("%d store errors", st.storeErrors.Load())
	}
	if n := r.CLI("EXISTS", key); n != "0" {
		t.Fatalf("slot key left: type %s", r.CLI("TYPE", key))
	}
}

// A request that a zone with a quota and a zone with concurrency both
// apply to is decided in one script call, whose quota and slot sections
// both hold arguments: the quota counts only the requests it allows, and
// a request the quota refuses holds no slot.
func TestConcurrencyRedisWithQuota(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"qs_quota","quota":2,"quota_period":"day"},
		{"name":"qs_conc","concurrency":1}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"qs:"}}`, r.Addr()))
	calls := r.Calls()
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		code, hdr := serve(h, "10.0.0.1")
		if code != want {
			t.Fatalf("request %d: %d, want %d (RateLimit %q)", i, code, want, hdr.Get("Ratelimit"))
		}
		if want == http.StatusOK && !strings.Contains(hdr.Get("Ratelimit"), fmt.Sprintf(`"qs_quota";r=%d`, 1-i)) {
			t.Fatalf("request %d: RateLimit %q, want %d left of the quota", i, hdr.Get("Ratelimit"), 1-i)
		}
	}
	// Two allowed requests: a decision and a release each; the refused
	// one: a decision.
	if n := r.Calls() - calls; n != 5 {
		t.Fatalf("%d script calls, want 5", n)
	}
	if n := r.CLI("EXISTS", slotKeyName("qs:", "qs_conc", "10.0.0.1")); n != "0" {
		t.Fatalf("a slot is held after the requests ended")
	}
}
