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
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func mustLoad(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

func TestQuotaValidation(t *testing.T) {
	for _, tc := range []struct {
		json, wantErr string
	}{
		{`{"name":"q","quota":10,"quota_period":"month"}`, ""},
		{`{"name":"q","quota":10,"quota_period":"week","timezone":"Asia/Tokyo","cost":10,"count":{"status_code":[200]},"dry_run":true}`, ""},
		{`{"name":"q","rate":"1r/s","quota":10,"quota_period":"day"}`, ""},
		{`{"name":"q","quota":0,"quota_period":"day"}`, "quota_period needs a quota"},
		{`{"name":"q","quota":-1,"quota_period":"day"}`, "invalid quota -1: must be 1 to"},
		{`{"name":"q","quota":10}`, "quota needs a period"},
		{`{"name":"q","quota":10,"quota_period":"year"}`, "invalid quota period 'year': expected day, week or month"},
		{`{"name":"q","quota":10,"quota_period":"day","timezone":"Mars/Olympus"}`, "unknown timezone 'Mars/Olympus'"},
		{`{"name":"q","rate":"1r/s","timezone":"UTC"}`, "timezone needs a quota"},
		{`{"name":"q","quota":10,"quota_period":"day","cost":11}`, "cost 11 exceeds quota 10"},
		{`{"name":"q","quota":10,"quota_period":"day","burst":3}`, "burst needs a rate"},
		{`{"name":"q","rate":"1r/s","quota":10,"quota_period":"day","ban":"1m"}`, "ban does not combine with quota"},
		{`{"name":"q","quota":10,"quota_period":"day","concurrency":2}`, "concurrency does not combine with quota"},
		{`{"name":"q","window":"1m","max_events":5,"quota":10,"quota_period":"day"}`, "quota does not combine with window and max_events"},
		{`{"name":"q","quota":10,"quota_period":"day","count":{}}`, "count needs a response matcher"},
	} {
		h := new(Handler)
		if err := json.Unmarshal([]byte(`{"zones":[`+tc.json+`]}`), h); err != nil {
			t.Fatal(err)
		}
		err := h.Validate()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: %v", tc.json, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: error %v, want %q", tc.json, err, tc.wantErr)
		}
	}
}

func TestQuotaCaddyfile(t *testing.T) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`rate_limit {
	zone monthly {
		key      {http.request.header.X-API-Key}
		quota    10000 per month
		timezone America/New_York
	}
}`))
	if err != nil {
		t.Fatal(err)
	}
	if z := h.Zones[0]; z.Quota != 10000 || z.QuotaPeriod != "month" || z.Timezone != "America/New_York" || z.Rate != "" {
		t.Fatalf("zone %+v", z)
	}
	for _, tc := range []struct {
		body, wantErr string
		line          int
	}{
		{"quota 0 per day", "invalid quota 0: must be 1 to", 3},
		{"quota ten per day", "invalid quota 'ten': expected a whole number", 3},
		{"quota 10 per year", "invalid quota period 'year': expected day, week or month", 3},
		{"quota 10 a day", "quota <n> per day|week|month", 3},
		{"quota 10 per", "quota <n> per day|week|month", 3},
		{"quota 10 per day\n\t\ttimezone Europe/Nowhere", "unknown timezone 'Europe/Nowhere'", 4},
		{"quota 10 per day\n\t\ttimezone", "wrong argument count", 4},
		{"rate 1r/s\n\t\ttimezone UTC", "timezone needs a quota", 5},
		{"quota 10 per day\n\t\tban 1m\n\t\trate 1r/s", "ban does not combine with quota", 6},
	} {
		err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit {\n\tzone q {\n\t\t" + tc.body + "\n\t}\n}"))
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%q: error %v, want %q", tc.body, err, tc.wantErr)
			continue
		}
		if suffix := fmt.Sprintf(", at Testfile:%d", tc.line); !strings.HasSuffix(err.Error(), suffix) {
			t.Errorf("%q: error %q does not end with %q", tc.body, err, suffix)
		}
	}
}

// quotaHeaders are a response's quota headers.
func checkQuotaHeaders(t *testing.T, resp *http.Response, zone string, limit, left int64, win *calendar.Window) {
	t.Helper()
	policy := fmt.Sprintf(`"%s";q=%d;w=%d`, zone, limit, win.Seconds)
	if got := resp.Header.Get("RateLimit-Policy"); !strings.Contains(got, policy) {
		t.Errorf("RateLimit-Policy %q, want %q in it", got, policy)
	}
	got := resp.Header.Get("RateLimit")
	prefix := fmt.Sprintf(`"%s";r=%d;t=`, zone, left)
	i := strings.Index(got, prefix)
	if i < 0 {
		t.Fatalf("RateLimit %q, want %q in it", got, prefix)
	}
	secs, _ := strconv.ParseInt(strings.SplitN(got[i+len(prefix):], ",", 2)[0], 10, 64)
	if want := ceilSeconds(time.Until(win.End)); secs < want-2 || secs > want+1 {
		t.Errorf("RateLimit t=%d, want about %d: the seconds until the window ends", secs, want)
	}
}

func adminJSON(t *testing.T, method, path string, v any) int {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+adminAddr+path, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if v != nil && resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
	}
	return resp.StatusCode
}

// TestQuotaThroughCaddy runs a monthly quota and a zone with a rate and
// a daily quota through a real Caddy, on each store: the counts, the
// headers, the Retry-After of a refusal, all or nothing with the rate,
// and the admin API's view and reset.
func TestQuotaThroughCaddy(t *testing.T) {
	r := startRedis(t)
	for _, storeCfg := range []string{`{"backend":"local","persist":false}`, fmt.Sprintf(`{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"thru:"}`, r.Addr())} {
		backend := "local"
		if strings.Contains(storeCfg, "redis") {
			backend = "redis"
		}
		t.Run(backend, func(t *testing.T) {
			monthly, api := "monthly-"+backend, "api-"+backend
			loadJSON(t, jsonServer(fmt.Sprintf(`{"handler":"rate_limit","headers":"ietf","store":%s,"zones":[
				{"name":%q,"key":"{http.request.header.X-API-Key}","quota":3,"quota_period":"month","timezone":"Europe/Paris"},
				{"name":%q,"key":"{http.request.header.X-API-Key}","match":[{"path":["/api/*"]}],"rate":"1r/m","burst":2,"quota":5,"quota_period":"day","cost":2}
			]},{"handler":"static_response","body":"ok"}`, storeCfg, monthly, api)))
			paris := mustLoad(t, "Europe/Paris")
			mwin := (&calendar.Windows{Period: calendar.Periods["month"], Loc: paris}).Window(time.Now())
			send := func(key, path string, want int) *http.Response {
				t.Helper()
				req, _ := http.NewRequest("GET", siteURL+path, nil)
				req.Header.Set("X-API-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != want {
					t.Fatalf("%s %s: status %d, want %d", key, path, resp.StatusCode, want)
				}
				return resp
			}
			for i := range int64(3) {
				checkQuotaHeaders(t, send("alice", "/", 200), monthly, 3, 2-i, mwin)
			}
			resp := send("alice", "/", 429)
			checkQuotaHeaders(t, resp, monthly, 3, 0, mwin)
			ra, _ := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
			if want := ceilSeconds(time.Until(mwin.End)); ra < want-2 || ra > want+1 {
				t.Fatalf("Retry-After %d, want about %d: until the month ends in Paris", ra, want)
			}
			send("bob", "/", 200) // another key, another count

			var info keyView
			if code := adminJSON(t, "GET", "/rate_limit/"+monthly+"/alice", &info); code != 200 || info.Quota == nil ||
				info.Quota.Used != 3 || info.Quota.Left != 0 || info.Quota.ResetIn < time.Until(mwin.End).Seconds()-2 {
				t.Fatalf("admin GET: %d %+v %+v", code, info, info.Quota)
			}
			if code := adminJSON(t, "DELETE", "/rate_limit/"+monthly+"/alice", nil); code != 200 {
				t.Fatalf("admin DELETE: %d", code)
			}
			checkQuotaHeaders(t, send("alice", "/", 200), monthly, 3, 2, mwin)

			// api: 1r/m burst 2, 5 a day, 2 a request. carol's first
			// request takes 2 of each zone's (monthly: 1 of 3).
			dwin := (&calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}).Window(time.Now())
			checkQuotaHeaders(t, send("carol", "/api/x", 200), api, 5, 3, dwin)
			// The bucket refuses: neither quota counts the request.
			send("carol", "/api/x", 429)
			var ci keyView
			adminJSON(t, "GET", "/rate_limit/"+api+"/carol", &ci)
			if ci.Quota == nil || ci.Quota.Used != 2 || ci.Tokens == nil || *ci.Tokens >= 1 {
				t.Fatalf("after a refusal by the bucket: %+v %+v", ci, ci.Quota)
			}
			var mi keyView
			adminJSON(t, "GET", "/rate_limit/"+monthly+"/carol", &mi)
			if mi.Quota == nil || mi.Quota.Used != 1 {
				t.Fatalf("monthly after a refusal by api's bucket: %+v", mi.Quota)
			}
			// The monthly quota refuses: api's bucket and quota keep
			// what they had.
			send("carol", "/", 200)
			send("carol", "/", 200)
			adminJSON(t, "DELETE", "/rate_limit/"+api+"/carol", nil) // a full bucket again, and 0 counted
			send("carol", "/api/x", 429)
			adminJSON(t, "GET", "/rate_limit/"+api+"/carol", &ci)
			if ci.Quota == nil || ci.Quota.Used != 0 || ci.Tokens == nil || *ci.Tokens != 2 {
				t.Fatalf("after a refusal by the monthly quota: %+v %+v", ci, ci.Quota)
			}
		})
	}
}

// TestRedisQuotaWindowEnds runs a quota with windows of 2 seconds on
// Redis's own clock: the counter expires at its window's end, and the
// next window starts from 0. Calendar windows last a day at least, so
// the test shortens them.
func TestRedisQuotaWindowEnds(t *testing.T) {
	r := startRedis(t)
	for _, backend := range []string{"local", "redis"} {
		t.Run(backend, func(t *testing.T) {
			storeCfg := `{"backend":"local","persist":false}`
			if backend == "redis" {
				storeCfg = fmt.Sprintf(`{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"short:"}`, r.Addr())
			}
			h := newTestHandler(t, `{"zones":[{"name":"short-`+backend+`","key":"{http.request.header.K}","quota":2,"quota_period":"day"}],"store":`+storeCfg+`}`)
			z := h.Zones[0]
			z.quota.Every = 2 * time.Second
			// Start just after a window starts. The requests must be
			// decided before it ends; the refusal's Retry-After is the
			// time left in it when it was decided, between its sending
			// and its answer (2s, unless the machine is slow to send).
			start := time.Now().Truncate(2 * time.Second).Add(2 * time.Second)
			end := start.Add(2 * time.Second)
			time.Sleep(time.Until(start.Add(50 * time.Millisecond)))
			for i, want := range []int{200, 200, 429} {
				sent := time.Now()
				code, hdr := serve(h, "192.0.2.1", "K", "k")
				answered := time.Now()
				if !answered.Before(end) {
					t.Fatalf("request %d answered %v after its window ended", i, answered.Sub(end))
				}
				if code != want {
					t.Fatalf("request %d: %d, want %d", i, code, want)
				}
				lo, hi := int(math.Ceil(end.Sub(answered).Seconds())), int(math.Ceil(end.Sub(sent).Seconds()))
				if got, err := strconv.Atoi(hdr.Get("Retry-After")); want == 429 && (err != nil || got < lo || got > hi) {
					t.Fatalf("Retry-After %q, want %d to %d: the time left in the window", hdr.Get("Retry-After"), lo, hi)
				}
			}
			if backend == "redis" {
				c := newRedisClient(t, r.Addr())
				key := counterKeyOf(h, z.index, "k")
				ttl, err := c.PTTL(context.Background(), key).Result()
				if err != nil || ttl <= 0 || ttl > 2*time.Second {
					t.Fatalf("PTTL %s = %v, %v; want the time left in the window", key, ttl, err)
				}
				n, _ := c.HGet(context.Background(), key, "n").Int64()
				if n != 2 {
					t.Fatalf("count %d in Redis, want 2", n)
				}
				time.Sleep(ttl + 50*time.Millisecond)
				if n, _ := c.Exists(context.Background(), key).Result(); n != 0 {
					t.Fatal("counter outlived its window")
				}
			} else {
				time.Sleep(time.Until(time.Now().Truncate(2 * time.Second).Add(2*time.Second + 50*time.Millisecond)))
			}
			if code, _ := serve(h, "192.0.2.1", "K", "k"); code != 200 {
				t.Fatalf("next window: %d, want 200", code)
			}
		})
	}
}

// TestRedisQuotaClockSkew: instances whose clocks are up to a window
// ahead or behind Redis's count in Redis's window; further apart, the
// call fails (and fail_mode decides) rather than counting in another.
func TestRedisQuotaClockSkew(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"skew","quota":3,"quota_period":"day"}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"skew:","disable_over_limit_cache":true}}`, r.Addr()))
	z := h.Zones[0]
	z.quota.Every = time.Hour
	now := time.Now()
	if now.Add(time.Minute).Truncate(time.Hour) != now.Truncate(time.Hour) {
		t.Skip("too close to a window's end")
	}
	for i, skew := range []time.Duration{-59 * time.Minute, 0, 59 * time.Minute, 0} {
		c := counterReq(z, store.Key{Text: "k"}, now)
		c.Window = z.quota.Window(now.Add(skew))
		reqs := &store.Demands{Counters: []store.CounterDemand{c}}
		ok, err := h.store.Take(context.Background(), now, reqs)
		if err != nil || ok != (i < 3) || reqs.Counters[0].Used != min(int64(i+1), 3) {
			t.Fatalf("skew %v: ok %v used %d err %v", skew, ok, reqs.Counters[0].Used, err)
		}
	}
	c := counterReq(z, store.Key{Text: "k"}, now)
	c.Window = z.quota.Window(now.Add(2 * time.Hour))
	if _, err := h.store.Take(context.Background(), now, &store.Demands{Counters: []store.CounterDemand{c}}); err == nil || !strings.Contains(err.Error(), "quota window") {
		t.Fatalf("two windows ahead: err %v", err)
	}
}

// TestRedisQuotaCluster: on Redis Cluster, a zone's quota and the
// request's buckets share the key's slot and one call; zones of other
// keys are taken one by one and given back.
func TestRedisQuotaCluster(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"cq","key":"{http.request.header.K}","quota":2,"quota_period":"week","timezone":"Asia/Tokyo"},
		{"name":"cr","key":"{http.request.header.R}","rate":"1r/m","burst":1}],
		"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s"}}`, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
	// cq's key and cr's key are in different slots: the call is split.
	if code, _ := serve(h, "192.0.2.1", "K", "a", "R", "x"); code != 200 {
		t.Fatalf("first: %d", code)
	}
	// cr refuses: cq's count is given back.
	if code, _ := serve(h, "192.0.2.1", "K", "a", "R", "x"); code != 429 {
		t.Fatalf("second: %d", code)
	}
	d := &store.Demands{Counters: []store.CounterDemand{counterReq(h.Zones[0], store.Key{Text: "a"}, time.Now())}}
	q := &d.Counters[0]
	if err := h.store.Peek(context.Background(), time.Now(), d); err != nil || q.Used != 1 {
		t.Fatalf("count %d, %v; want 1: a refused request is not counted", q.Used, err)
	}
	for i, want := range []int{200, 429} {
		if code, _ := serve(h, "192.0.2.1", "K", "a", "R", fmt.Sprint("y", i)); code != want {
			t.Fatalf("request %d: %d, want %d", i, code, want)
		}
	}
}

// TestQuotaCountAndDryRun: with count, a request whose response does
// not match is given back to the quota; in dry run, a quota that would
// refuse lets the request through and says so.
func TestQuotaCountAndDryRun(t *testing.T) {
	r := startRedis(t)
	for _, backend := range []string{"local", "redis"} {
		t.Run(backend, func(t *testing.T) {
			storeCfg := `{"backend":"local","persist":false}`
			if backend == "redis" {
				storeCfg = fmt.Sprintf(`{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"cdr:"}`, r.Addr())
			}
			h := newTestHandler(t, fmt.Sprintf(`{"zones":[
				{"name":"qc-%s","quota":2,"quota_period":"day","count":{"status_code":[5]}},
				{"name":"qd-%s","quota":1,"quota_period":"week","dry_run":true,"match":[{"path":["/dry"]}]}],"store":%s}`, backend, backend, storeCfg))
			// 200s are given back: the quota of 2 never runs out.
			for i := range 5 {
				if code, _ := serve(h, "192.0.2.1"); code != 200 {
					t.Fatalf("request %d: %d", i, code)
				}
			}
			d := &store.Demands{Counters: []store.CounterDemand{counterReq(h.Zones[0], store.Key{Text: "192.0.2.1"}, time.Now())}}
			q := &d.Counters[0]
			if err := h.store.Peek(context.Background(), time.Now(), d); err != nil || q.Used != 0 {
				t.Fatalf("count %d, %v; want 0: every response was given back", q.Used, err)
			}
			// Dry run: the second request in the week would be refused.
			for i, want := range []bool{false, true} {
				req, rr := newRequest("192.0.2.2")
				req.URL.Path = "/dry"
				if err := h.ServeHTTP(rr, req, okHandler); err != nil || rr.Code != 200 {
					t.Fatalf("dry run %d: %v %d", i, err, rr.Code)
				}
				repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				if v, _ := repl.Get("http.rate_limit.qd-" + backend + ".would_deny"); v != want {
					t.Fatalf("dry run %d: would_deny %v, want %v", i, v, want)
				}
			}
		})
	}
}

// Zones of one name with quotas of different periods count apart, on
// both stores, as a local table's counters do: a quota's counter is its
// zone's name, period and time zone. A zone of that name and period with
// another limit counts in the same counter: its limit may change.
func TestQuotaZonesOfOneName(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", `{"backend":"local","persist":false}`},
		{"redis", fmt.Sprintf(`{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"qn:"}`, r.Addr())},
		{"redis-no-cache", fmt.Sprintf(`{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"qn2:","disable_over_limit_cache":true}`, r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := func(limit int, period string) *Handler {
				return newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"q-%s","key":"k","quota":%d,"quota_period":%q}],"store":%s}`,
					tc.name, limit, period, tc.store))
			}
			monthly, daily, daily3 := zone(2, "month"), zone(1, "day"), zone(3, "day")
			for _, step := range []struct {
				h    *Handler
				what string
				want int
			}{
				{monthly, "2 a month", 200}, {monthly, "2 a month", 200}, {monthly, "2 a month", 429},
				{daily, "1 a day, after 2 a month's", 200}, {daily, "1 a day", 429},
				{monthly, "2 a month, after 1 a day's", 429},
				{daily3, "3 a day, after 1 a day's one", 200}, {daily3, "3 a day", 200}, {daily3, "3 a day", 429},
			} {
				if code, _ := serve(step.h, "192.0.2.1"); code != step.want {
					t.Fatalf("%s: status %d, want %d", step.what, code, step.want)
				}
			}
		})
	}
}

// TestRedisQuotaUntaggedCounter: a counter that a build before the
// window's tag kept under the zone's name alone still counts in its
// window, read by decisions and by the admin API while the tagged key is
// absent and carried over by the first write; one of another window is
// not read; a reset deletes both. The tag of month@UTC is fixed: counters
// written by one version must be found by the next.
func TestRedisQuotaUntaggedCounter(t *testing.T) {
	r := startRedis(t)
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"up","key":"{http.request.header.K}","quota":3,"quota_period":"month"}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"5s","key_prefix":"up:","disable_over_limit_cache":true}}`, r.Addr()))
	z, s := h.Zones[0], h.store
	tagged, untagged := counterKeyOf(h, z.index, "k"), redisKeysOf(h).Counter(rediswire.ZoneField(z.Name), "k")
	if !strings.HasSuffix(tagged, "}up:4nV7:k:quota") || !strings.HasSuffix(untagged, "}up:k:quota") {
		t.Fatalf("keys %q and %q", tagged, untagged)
	}
	end := z.quota.Window(time.Now()).End
	// An earlier build counted 2 in this window.
	c.HSet(ctx, untagged, "w", end.UnixMilli(), "n", 2)
	c.PExpireAt(ctx, untagged, end)
	peek := func() int64 {
		t.Helper()
		d := &store.Demands{Counters: []store.CounterDemand{counterReq(z, store.Key{Text: "k"}, time.Now())}}
		if err := s.Peek(ctx, time.Now(), d); err != nil {
			t.Fatal(err)
		}
		return d.Counters[0].Used
	}
	if used := peek(); used != 2 {
		t.Fatalf("admin view before any request: used %d, want the untagged key's 2", used)
	}
	for i, want := range []int{200, 429} {
		if code, _ := serve(h, "192.0.2.1", "K", "k"); code != want {
			t.Fatalf("request %d: %d, want %d", i, code, want)
		}
	}
	if n, _ := c.HGet(ctx, tagged, "n").Int64(); n != 3 {
		t.Fatalf("tagged counter %d, want 3", n)
	}
	if n, _ := c.HGet(ctx, untagged, "n").Int64(); n != 2 {
		t.Fatalf("untagged counter %d, want 2: it is never written", n)
	}
	if found, err := s.Reset(ctx, &store.Demands{Counters: []store.CounterDemand{counterReq(z, store.Key{Text: "k"}, time.Now())}}); err != nil || !found {
		t.Fatalf("reset: %v, %v", found, err)
	}
	if n, _ := c.Exists(ctx, tagged, untagged).Result(); n != 0 {
		t.Fatalf("%d of the two keys left after a reset", n)
	}
	// An untagged counter of another window (another period's, of a zone
	// of the same name) is not this one's.
	c.HSet(ctx, untagged, "w", end.Add(24*time.Hour).UnixMilli(), "n", 3)
	c.PExpireAt(ctx, untagged, end.Add(24*time.Hour))
	for i, want := range []int{200, 200, 200, 429} {
		if code, _ := serve(h, "192.0.2.1", "K", "k"); code != want {
			t.Fatalf("after the reset, request %d: %d, want %d", i, code, want)
		}
	}
}
