// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// reserveZoneBlock is a Caddyfile whose zone a has lines, the first on
// line 4.
func reserveZoneBlock(lines ...string) string {
	return "rate_limit {\n\tzone a {\n\t\trate 1r/m\n\t\t" + strings.Join(lines, "\n\t\t") + "\n\t}\n}"
}

func TestReserveCaddyfileErrors(t *testing.T) {
	const prio = "priority {http.request.header.X-Priority}"
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"a reserve of 0%", reserveZoneBlock(prio, "reserve high 0%"), "invalid reserve high 0%: must be above 0% and below 100%", 5},
		{"reserves summing to 100%", reserveZoneBlock(prio, "reserve high 40%", "reserve mid 60%"), "reserves sum to 100%", 6},
		{"a class reserved twice", reserveZoneBlock(prio, "reserve high 10%", "reserve high 10%"), "class high reserved twice", 6},
		{"a reserve without priority", reserveZoneBlock("reserve high 20%"), "zone a: reserve needs priority", 5},
		{"priority without a reserve", reserveZoneBlock(prio), "zone a: priority needs a reserve", 5},
		{"priority without placeholders", reserveZoneBlock("priority high", "reserve high 20%"), "invalid priority 'high'", 6},
		{"priority twice", reserveZoneBlock(prio, prio), "priority already specified", 5},
		{"a reserve without %", reserveZoneBlock(prio, "reserve high 20"), "invalid reserve '20': a percentage, such as 20%", 5},
		{"a reserve of the lowest class", reserveZoneBlock(prio, "reserve other 20%"), "invalid reserve class 'other'", 5},
		{"a reserve without its share", reserveZoneBlock(prio, "reserve high"), "wrong argument count", 5},
		{"with sync", reserveZoneBlock(prio, "reserve high 20%", "sync 1s"), "reserve cannot go with sync", 7},
		{"with share", reserveZoneBlock(prio, "reserve high 20%", "share 1s"), "reserve cannot go with share", 7},
		{"with ban", reserveZoneBlock(prio, "reserve high 20%", "ban 1m"), "reserve cannot go with ban", 7},
		{"with delay", reserveZoneBlock(prio, "reserve high 20%", "delay 1s"), "reserve cannot go with delay", 7},
		{"the lowest class below the cost", reserveZoneBlock("burst 4", prio, "reserve high 80%"),
			"reserves leave the lowest class 0 of the burst of 4: below the cost of 1", 7},
		{"without a rate", "rate_limit {\n\tzone a {\n\t\tconcurrency 4\n\t\t" + prio + "\n\t\treserve high 20%\n\t}\n}",
			"zone a: reserve needs a rate", 6},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

func TestReserveValidate(t *testing.T) {
	const prio = `"priority":"{http.request.header.X-Priority}"`
	for _, tc := range []struct{ zone, wantErr string }{
		{prio + `,"reserve":[{"class":"high","percent":20},{"class":"mid","percent":12.5}]`, ""},
		{prio + `,"reserve":[{"class":"high","percent":100}]`, "invalid reserve high 100%"},
		{prio + `,"reserve":[{"class":"a","percent":50},{"class":"b","percent":50}]`, "reserves sum to 100%"},
		{prio + `,"reserve":[{"class":"a","percent":10},{"class":"a","percent":10}]`, "class a reserved twice"},
		{prio + `,"reserve":[{"percent":10}]`, "reserve needs a class"},
		{`"reserve":[{"class":"high","percent":20}]`, "reserve needs priority"},
		{prio, "priority needs a reserve"},
		{prio + `,"reserve":[{"class":"high","percent":20}],"ban":60000000000`, "reserve cannot go with ban"},
		{prio + `,"reserve":[{"class":"high","percent":20}],"delay":1000000000`, "reserve cannot go with delay"},
		{prio + `,"reserve":[{"class":"high","percent":95}]`, "reserves leave the lowest class 0 of the burst of 10"},
	} {
		t.Run(tc.zone, func(t *testing.T) {
			checkValidate(t, `{"zones":[{"name":"a","key":"static","rate":"1r/m","burst":10,`+tc.zone+`}]}`, tc.wantErr)
		})
	}
	for _, kind := range []string{"sync", "share"} {
		checkValidate(t, `{"zones":[{"name":"a","key":"static","rate":"1r/m","burst":10,"priority":"{http.request.header.X-Priority}",
			"reserve":[{"class":"high","percent":20}],"`+kind+`":1000000000}],"store":{"backend":"redis","addresses":["127.0.0.1:1"]}}`,
			"reserve cannot go with "+kind)
	}
}

// reserveHandler is a handler of zone name, 1r/m burst 10, keeping 30%
// for high, on the store storeJSON ("" for the local store).
func reserveHandler(t *testing.T, name, rate string, burst int, percent, storeJSON string) *Handler {
	t.Helper()
	if storeJSON != "" {
		storeJSON = `,"store":` + storeJSON
	}
	return newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":%q,"key":"static","rate":%q,"burst":%d,
		"priority":"{http.request.header.X-Priority}","reserve":[{"class":"high","percent":%s}]}]%s}`, name, rate, burst, percent, storeJSON))
}

// high is the header of a request of class high.
var high = []string{"X-Priority", "high"}

// handlersInTurn sends a request of the class ("" for the lowest) to hs
// in turn, its class in X-Priority.
func handlersInTurn(hs ...*Handler) func(class string) (int, http.Header) {
	n := 0
	return func(class string) (int, http.Header) {
		h := hs[n%len(hs)]
		n++
		if class == "" {
			return serve(h, "192.0.2.1")
		}
		return serve(h, "192.0.2.1", "X-Priority", class)
	}
}

// checkReserveSteps sends the steps of `reserve high 30%` on 1r/m burst
// 10 with send, of a class ("" for the lowest): the lowest class gets 7
// and is refused, then high gets the other 3; each class is told its own
// truth in the headers. The times in the headers are checked to the
// second, or with slack seconds less for what the bucket refilled while
// a loaded machine took that long (through a real Caddy); the counts
// hold either way, a token taking a minute.
func checkReserveSteps(t *testing.T, name string, slack int, send func(class string) (int, http.Header)) {
	t.Helper()
	wantRetry := func(what string, hdr http.Header, want int) {
		t.Helper()
		got, err := strconv.Atoi(hdr.Get("Retry-After"))
		if err != nil || got > want || got < want-slack {
			t.Fatalf("%s: Retry-After %q, want %d (less %d s at most)", what, hdr.Get("Retry-After"), want, slack)
		}
	}
	for i := range 7 {
		code, hdr := send("")
		if code != http.StatusOK {
			t.Fatalf("request %d of the lowest class: %d, want 200", i, code)
		}
		if want := fmt.Sprintf(`%q;q=7;w=420`, name); hdr.Get("RateLimit-Policy") != want {
			t.Fatalf("policy %q, want %q", hdr.Get("RateLimit-Policy"), want)
		}
		if want := fmt.Sprintf(`%q;r=%d;t=`, name, 6-i); i < 6 && !strings.HasPrefix(hdr.Get("RateLimit"), want) ||
			slack == 0 && i < 6 && hdr.Get("RateLimit") != want+"60" {
			t.Fatalf("RateLimit %q, want %s60", hdr.Get("RateLimit"), want)
		}
	}
	code, hdr := send("")
	if code != http.StatusTooManyRequests || hdr.Get("X-RateLimit-Limit") != "7" || hdr.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("the lowest class beyond its 7: %d, limit %q, remaining %q; want 429, 7, 0",
			code, hdr.Get("X-RateLimit-Limit"), hdr.Get("X-RateLimit-Remaining"))
	}
	wantRetry("the lowest class beyond its 7", hdr, 60)
	for i := range 3 {
		code, hdr := send("high")
		if code != http.StatusOK {
			t.Fatalf("request %d of high: %d, want 200", i, code)
		}
		if want := fmt.Sprintf(`%q;q=10;w=600`, name); hdr.Get("RateLimit-Policy") != want {
			t.Fatalf("high's policy %q, want %q", hdr.Get("RateLimit-Policy"), want)
		}
		if want := fmt.Sprint(2 - i); hdr.Get("X-RateLimit-Remaining") != want || hdr.Get("X-RateLimit-Limit") != "10" {
			t.Fatalf("high's limit %q, remaining %q, want 10, %s", hdr.Get("X-RateLimit-Limit"), hdr.Get("X-RateLimit-Remaining"), want)
		}
	}
	code, hdr = send("high")
	if code != http.StatusTooManyRequests || hdr.Get("RateLimit-Policy") != fmt.Sprintf(`%q;q=10;w=600`, name) {
		t.Fatalf("high beyond the whole burst: %d, policy %q; want 429 and high's", code, hdr.Get("RateLimit-Policy"))
	}
	wantRetry("high beyond the whole burst", hdr, 60)
	// The lowest class waits for 3 + 1 tokens.
	code, hdr = send("")
	if code != http.StatusTooManyRequests || hdr.Get("RateLimit-Policy") != fmt.Sprintf(`%q;q=7;w=420`, name) {
		t.Fatalf("the lowest class on the empty bucket: %d, policy %q; want 429 and the lowest class's", code, hdr.Get("RateLimit-Policy"))
	}
	wantRetry("the lowest class on the empty bucket", hdr, 240)
}

func TestReserveLocal(t *testing.T) {
	h := reserveHandler(t, "reserve_local", "1r/m", 10, "30", "")
	checkReserveSteps(t, "reserve_local", 0, handlersInTurn(h))

	// The refusals by class: two of the lowest, one of high.
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(zoneCollector)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "caddy_rate_limit_class_denied_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["zone"] == "reserve_local" {
				got[labels["class"]] = m.GetCounter().GetValue()
			}
		}
	}
	if got["high"] != 1 || got["other"] != 2 {
		t.Errorf("class_denied_total: %v, want high 1, other 2", got)
	}

	// The admin API: each class's tokens, and the zone's refusals by
	// class.
	v, err := adminGet(t, http.MethodGet, "/rate_limit/reserve_local/static")
	if err != nil {
		t.Fatal(err)
	}
	if c := fmt.Sprint(v["classes"]); c != "[map[capacity:10 class:high remaining:0] map[capacity:7 class:other remaining:0]]" {
		t.Errorf("key's classes: %s", c)
	}
	v, _ = adminGet(t, http.MethodGet, "/rate_limit/reserve_local")
	if r := fmt.Sprint(v["reserves"]); r != "map[classes:[map[class:high denied:1 reserve_percent:30] map[class:other denied:2 reserve_percent:0]] priority:{http.request.header.X-Priority}]" {
		t.Errorf("zone's reserves: %s", r)
	}
}

// Two instances, each its own store on one Redis, keep one reserve
// exactly: the requests alternate between them.
func TestReserveRedisTwoInstances(t *testing.T) {
	r := startRedis(t)
	store := fmt.Sprintf(`{"backend":"redis","addresses":[%q],"key_prefix":"rsv:",%s}`, r.Addr(), testTimeout)
	a := reserveHandler(t, "reserve_redis", "1r/m", 10, "30", store)
	b := reserveHandler(t, "reserve_redis", "1r/m", 10, "30", store)
	checkReserveSteps(t, "reserve_redis", 0, handlersInTurn(a, b))
}

// Under a flood of the lowest class at about 1000 requests a second,
// high's requests at 10 a second are admitted: the flood cannot reach
// into high's 20%.
func TestReserveUnderFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("a 10s flood")
	}
	t.Run("local", func(t *testing.T) {
		checkReserveFlood(t, reserveHandler(t, "reserve_flood_local", "100r/s", 100, "20", ""))
	})
	t.Run("redis", func(t *testing.T) {
		r := startRedis(t)
		store := fmt.Sprintf(`{"backend":"redis","addresses":[%q],"key_prefix":"rsvf:",%s}`, r.Addr(), testTimeout)
		checkReserveFlood(t, reserveHandler(t, "reserve_flood_redis", "100r/s", 100, "20", store))
	})
}

func checkReserveFlood(t *testing.T, h *Handler) {
	t.Helper()
	const d = 10 * time.Second
	var flood, floodOK atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// Four senders of the lowest class, each 10 requests every 40ms:
	// about 1000 a second.
	for range 4 {
		wg.Go(func() {
			tick := time.NewTicker(40 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				for range 10 {
					if code, _ := serve(h, "192.0.2.1"); code == http.StatusOK {
						floodOK.Add(1)
					}
					flood.Add(1)
				}
			}
		})
	}
	var sent, admitted int
	tick := time.NewTicker(100 * time.Millisecond)
	for start := time.Now(); time.Since(start) < d; {
		<-tick.C
		sent++
		if code, _ := serve(h, "192.0.2.1", high...); code == http.StatusOK {
			admitted++
		}
	}
	tick.Stop()
	close(stop)
	wg.Wait()
	t.Logf("flood: %d requests, %d admitted; high: %d of %d admitted", flood.Load(), floodOK.Load(), admitted, sent)
	if flood.Load() < int64(2*sent*10) {
		t.Fatalf("the flood sent %d requests beside high's %d: not a flood", flood.Load(), sent)
	}
	if floodOK.Load() == flood.Load() {
		t.Fatal("the flood was never refused: it did not reach the reserve")
	}
	if admitted*100 < sent*99 {
		t.Errorf("high: %d of %d admitted, want at least 99%%", admitted, sent)
	}
}

// reserveSites is a site with a zone of `reserve high 30%` on 1r/m burst
// 10, its class in X-Class, at /local on the local store, and at /a and
// /b as two instances would have it, each its own store on the Redis at
// addr.
func reserveSites(addr string) string {
	zone := func(name, store string) string {
		return fmt.Sprintf(`rate_limit {
			zone %s {
				key static
				rate 1r/m
				burst 10
				priority {http.request.header.X-Class}
				reserve high 30%%
			}
			%s
		}
		respond "ok"`, name, store)
	}
	redis := fmt.Sprintf("store redis {\n\t\t\t\taddress %s\n\t\t\t\ttimeout 5s\n\t\t\t\tkey_prefix rsvc:\n\t\t\t}", addr)
	return fmt.Sprintf("http://localhost {\n\thandle /local {\n\t\t%s\n\t}\n\thandle /a {\n\t\t%s\n\t}\n\thandle /b {\n\t\t%s\n\t}\n}\n",
		zone("reserve_caddy_local", ""), zone("reserve_caddy_redis", redis), zone("reserve_caddy_redis", redis))
}

// Through a real Caddy, its class read by the Caddyfile's priority: the
// lowest class gets 7 of the burst of 10 and is refused with a
// Retry-After, then high gets the other 3, each class told its own
// policy. On Redis, the requests alternate between two instances.
func TestReserveThroughCaddy(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, "", reserveSites(r.Addr()))
	paths := func(ps ...string) func(class string) (int, http.Header) {
		n := 0
		return func(class string) (int, http.Header) {
			req, _ := http.NewRequest(http.MethodGet, siteURL+ps[n%len(ps)], nil)
			n++
			if class != "" {
				req.Header.Set("X-Class", class)
			}
			resp, err := tester.Client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode, resp.Header
		}
	}
	t.Run("local", func(t *testing.T) {
		checkReserveSteps(t, "reserve_caddy_local", 5, paths("/local"))
		v := adminKeyAt(t, adminAddr, "reserve_caddy_local", "static")
		if c := fmt.Sprint(v["classes"]); c != "[map[capacity:10 class:high remaining:0] map[capacity:7 class:other remaining:0]]" {
			t.Errorf("the admin API's classes of the key: %s", c)
		}
	})
	t.Run("redis", func(t *testing.T) {
		checkReserveSteps(t, "reserve_caddy_redis", 5, paths("/a", "/b"))
	})
}
