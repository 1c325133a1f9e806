// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddytest"
)

// The admin API's view of a bucket, and its reset, through the store.
func TestAdminBucket(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"admin-unit","rate":"1r/m","burst":3}]}`)
	for range 3 {
		serve(h, "2001:db8:1::5")
	}
	z := h.Zones[0]
	d := &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, z.keyFor("2001:db8:1::77"))}} // the same /64
	if err := h.store.Peek(context.Background(), nowForTest(), d); err != nil {
		t.Fatal(err)
	}
	q := &d.Buckets[0]
	if tokens := z.limit.Tokens(q.Debt); tokens > 0.1 {
		t.Fatalf("tokens %v, want about 0", tokens)
	}
	if q.Key.Net != netip.MustParsePrefix("2001:db8:1::/64") {
		t.Fatalf("bucket %v", q.Key)
	}
	if found, err := h.reset(context.Background(), d); err != nil || !found {
		t.Fatalf("reset: found %t, %v; want true, nil", found, err)
	}
	if code, hdr := serve(h, "2001:db8:1::5"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != "2" {
		t.Fatalf("after reset: %d, remaining %s", code, hdr.Get("X-Ratelimit-Remaining"))
	}
	// A full bucket has nothing to reset.
	if found, err := h.reset(context.Background(), &store.Demands{Buckets: []store.BucketDemand{bucketReq(z, z.keyFor("192.0.2.200"))}}); err != nil || found {
		t.Fatalf("reset of a full bucket: found %t, %v; want false, nil", found, err)
	}
}

// adminDo sends a request to the admin API and decodes its JSON answer.
func adminDo(t *testing.T, tester *caddytest.Tester, method, path string, wantStatus int) map[string]any {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+adminAddr+path, nil)
	resp, err := tester.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v map[string]any
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != wantStatus {
		t.Fatalf("%s %s: %d %s, want %d", method, path, resp.StatusCode, body, wantStatus)
	}
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("%s %s: %v: %s", method, path, err, body)
	}
	return v
}

func TestAdminAPI(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, opsGlobal, opsSites("a", r.Addr(), "ok"))

	list := adminDo(t, tester, "GET", "/rate_limit/", 200)
	names := []string{}
	for _, z := range list["zones"].([]any) {
		if name := z.(map[string]any)["name"].(string); strings.HasPrefix(name, "a_") {
			names = append(names, name)
		}
	}
	if got := strings.Join(names, " "); got != "a_dry a_local a_quiet a_redis" {
		t.Fatalf("zones %s", got)
	}

	for _, tc := range []struct{ zone, path, store string }{
		{"a_local", "/local", "local"},
		{"a_redis", "/redis", "redis"},
	} {
		t.Run(tc.store, func(t *testing.T) {
			z := adminDo(t, tester, "GET", "/rate_limit/"+tc.zone, 200)
			if z["store"] != tc.store || z["rate"] != "1r/m" || z["burst"] != 2.0 {
				t.Fatalf("zone %v", z)
			}

			// A skewed load: one client floods, two others ask twice.
			for _, ip := range []string{"2001:db8:7::1", "10.9.2.1", "10.9.2.2"} {
				get(t, tester, tc.path, 200, "ok", from(ip)...)
				get(t, tester, tc.path, 200, "ok", from(ip)...)
			}
			for range 5 {
				get(t, tester, tc.path, 429, "", from("2001:db8:7::1")...)
			}
			get(t, tester, tc.path, 429, "", from("10.9.2.1")...)

			// The bucket of a key in the flooder's /64, path-escaped.
			b := adminDo(t, tester, "GET", "/rate_limit/"+tc.zone+"/2001:db8:7::99", 200)
			if b["bucket"] != "2001:db8:7::/64" || b["tokens"].(float64) > 0.1 || b["full_in"].(float64) < 119 {
				t.Fatalf("bucket %v", b)
			}
			// The network as the API prints it names the same bucket, on
			// both stores.
			b = adminDo(t, tester, "GET", "/rate_limit/"+tc.zone+"/2001%3Adb8%3A7%3A%3A%2F64", 200)
			if b["bucket"] != "2001:db8:7::/64" || b["tokens"].(float64) > 0.1 {
				t.Fatalf("network in CIDR notation: bucket %v", b)
			}

			top := adminDo(t, tester, "GET", "/rate_limit/"+tc.zone+"/top", 200)
			items := top["top"].([]any)
			first := items[0].(map[string]any)
			if len(items) != 2 || first["key"] != "2001:db8:7::/64" || first["denials"] != 5.0 {
				t.Fatalf("top %v", top)
			}

			// Reset, by the network's name: the flooder is served again,
			// with a full bucket. A second reset finds nothing to reset.
			b = adminDo(t, tester, "DELETE", "/rate_limit/"+tc.zone+"/2001:db8:7::%2F64", 200)
			if b["tokens"] != 2.0 || b["full_in"] != 0.0 {
				t.Fatalf("after reset: %v", b)
			}
			e := adminDo(t, tester, "DELETE", "/rate_limit/"+tc.zone+"/2001:db8:7::1", 404)
			if !strings.Contains(fmt.Sprint(e["error"]), "nothing to reset") {
				t.Fatalf("reset of a full bucket: %v", e)
			}
			get(t, tester, tc.path, 200, "ok", from("2001:db8:7::1")...)

			// Errors are JSON, with the right status.
			e = adminDo(t, tester, "GET", "/rate_limit/nope/1.2.3.4", 404)
			if !strings.Contains(fmt.Sprint(e["error"]), `unknown zone "nope"`) {
				t.Fatalf("unknown zone: %v", e)
			}
			adminDo(t, tester, "POST", "/rate_limit/"+tc.zone+"/1.2.3.4", 405)
			adminDo(t, tester, "DELETE", "/rate_limit/"+tc.zone+"/top", 405)
		})
	}

	// The Redis store's bucket is unreadable while Redis is down.
	r.Kill()
	start := time.Now()
	e := adminDo(t, tester, "GET", "/rate_limit/a_redis/10.9.2.1", 502)
	if !strings.Contains(fmt.Sprint(e["error"]), "reading the bucket") || time.Since(start) > 2*time.Second {
		t.Fatalf("redis down: %v after %v", e, time.Since(start))
	}
}

// Zones of one name with different limits (the line form names its zone
// default) limit separately, on both stores, and the admin API and the
// metrics tell them apart: listed each with its limit and counters, a
// key's GET and DELETE act on each, and their series differ by their
// limit label.
func TestAdminZonesOfOneName(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, sites string }{
		{"local", `http:// {
	handle /one {
		rate_limit {http.request.header.X-Key} 1r/m 2
		respond "one"
	}
	handle /two {
		rate_limit {http.request.header.X-Key} 1r/m 4
		respond "two"
	}
}
`},
		{"redis", fmt.Sprintf(`http:// {
	handle /one {
		rate_limit {
			zone default {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
			}
			store redis {
				address %[1]s
				timeout 5s
			}
		}
		respond "one"
	}
	handle /two {
		rate_limit {
			zone default {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 4
			}
			store redis {
				address %[1]s
				timeout 5s
			}
		}
		respond "two"
	}
}
`, r.Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) { testZonesOfOneName(t, tc.name == "local", tc.sites) })
	}
}

func testZonesOfOneName(t *testing.T, local bool, sites string) {
	tester := startCaddy(t, "", sites)
	// A zone's counters outlive its config: count from here.
	base := scrape(t, tester)
	counted := func(limit, result string) string {
		return fmt.Sprintf(`caddy_rate_limit_requests_total{limit=%q,result=%q,zone="default"}`, limit, result)
	}
	for _, want := range []int{200, 200, 429} {
		get(t, tester, "/one", want, map[int]string{200: "one", 429: ""}[want], "X-Key", "v")
	}
	for range 4 {
		get(t, tester, "/two", 200, "two", "X-Key", "v")
	}
	get(t, tester, "/two", 429, "", "X-Key", "v")

	zones := adminDo(t, tester, http.MethodGet, "/rate_limit/", 200)["zones"].([]any)
	byLimit := map[string]map[string]any{}
	for _, z := range zones {
		if z := z.(map[string]any); z["name"] == "default" {
			byLimit[z["limit"].(string)] = z
		}
	}
	for limit, want := range map[string][2]float64{"1r/m burst 2": {2, 1}, "1r/m burst 4": {4, 1}} {
		z := byLimit[limit]
		if z == nil {
			t.Fatalf("no zone default of limit %q in %v", limit, zones)
		}
		req := z["requests"].(map[string]any)
		allowed, denied := req["allowed"].(float64)-base[counted(limit, "allowed")], req["denied"].(float64)-base[counted(limit, "denied")]
		if allowed != want[0] || denied != want[1] || local && z["tracked_keys"] != 1.0 {
			t.Errorf("zone default of %s: %v allowed, %v denied, tracked keys %v; want %v allowed, %v denied, 1 key", limit, allowed, denied, z["tracked_keys"], want[0], want[1])
		}
	}
	if len(byLimit) != 2 {
		t.Fatalf("%d zones named default, want 2: %v", len(byLimit), zones)
	}

	// A DELETE resets the key in both, and reports each.
	each := adminDo(t, tester, http.MethodDelete, "/rate_limit/default/v", 200)["zones"].([]any)
	if len(each) != 2 {
		t.Fatalf("DELETE reported %d zones, want 2: %v", len(each), each)
	}
	for _, z := range each {
		if z := z.(map[string]any); z["tokens"] != z["burst"] {
			t.Errorf("after the reset, zone default of %s holds %v of %v tokens", z["limit"], z["tokens"], z["burst"])
		}
	}
	get(t, tester, "/one", 200, "one", "X-Key", "v")
	get(t, tester, "/two", 200, "two", "X-Key", "v")

	m := scrape(t, tester)
	for limit, want := range map[string]float64{"1r/m burst 2": 3, "1r/m burst 4": 5} {
		wantMetric(t, m, counted(limit, "allowed"), base[counted(limit, "allowed")]+want)
		if local {
			wantMetric(t, m, fmt.Sprintf(`caddy_rate_limit_keys{limit=%q,zone="default"}`, limit), 1)
		}
	}
}

// A key whose whole name is `top` is addressed as `%74op`: the path's
// `top` is the zone's top list, and one letter escaped is the key.
func TestAdminKeyNamedTop(t *testing.T) {
	tester := startCaddy(t, "", `http:// {
	rate_limit {
		zone topkey {
			key   {http.request.header.X-Key}
			rate  1r/m
			burst 1
		}
	}
	respond "ok"
}
`)
	get(t, tester, "/", 200, "ok", "X-Key", "top")
	get(t, tester, "/", 429, "", "X-Key", "top")

	b := adminDo(t, tester, http.MethodGet, "/rate_limit/topkey/%74op", 200)
	if b["key"] != "top" || b["tokens"].(float64) > 0.1 {
		t.Fatalf("GET of %%74op: %v, want the empty bucket of key top", b)
	}
	list := adminDo(t, tester, http.MethodGet, "/rate_limit/topkey/top", 200)
	items, _ := list["top"].([]any)
	if len(items) != 1 || items[0].(map[string]any)["key"] != "top" {
		t.Fatalf("GET of top: %v, want the top list, holding key top", list)
	}
	adminDo(t, tester, http.MethodDelete, "/rate_limit/topkey/top", 405)
	b = adminDo(t, tester, http.MethodDelete, "/rate_limit/topkey/%74op", 200)
	if b["key"] != "top" || b["tokens"] != 1.0 {
		t.Fatalf("DELETE of %%74op: %v, want key top's full bucket", b)
	}
	get(t, tester, "/", 200, "ok", "X-Key", "top")
}

// A key's view in the admin API holds the fields of what its zone
// limits, and only those: each kind of limit adds its own.
func TestAdminKeyViewFields(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {
		zone kv-ban {
			key {http.request.header.K}
			rate 1r/m
			burst 1
			ban 1h
		}
		zone kv-quota {
			key {http.request.header.K}
			quota 5 per day
		}
		zone kv-slots {
			key {http.request.header.K}
			concurrency 2
		}
		zone kv-adaptive {
			key {http.request.header.K}
			concurrency adaptive
		}
		zone kv-rate-quota {
			key {http.request.header.K}
			rate 10r/m
			burst 10
			quota 5 per day
		}
		zone kv-rate-slots {
			key {http.request.header.K}
			rate 10r/m
			burst 10
			concurrency 2
		}
		zone kv-plan {
			key {http.request.header.K}
			rate {http.request.header.R}
			burst 10
		}
	}
	respond "ok"
}`)
	get(t, tester, "/", 200, "ok", "K", "a", "R", "10r/m")
	get(t, tester, "/", 429, "", "K", "a", "R", "10r/m")
	common := "bucket key limit zone "
	for _, c := range []struct{ zone, want string }{
		{"kv-ban", common + "banned banned_for burst full_in tokens"},
		{"kv-quota", common + "quota"},
		{"kv-slots", common + "concurrency free in_flight"},
		{"kv-adaptive", common + "concurrency_adaptive"},
		{"kv-rate-quota", common + "burst full_in quota tokens"},
		{"kv-rate-slots", common + "burst concurrency free full_in in_flight tokens"},
		{"kv-plan", common + "full_in"},
	} {
		v := adminDo(t, tester, "GET", "/rate_limit/"+c.zone+"/a", 200)
		fields := make([]string, 0, len(v))
		for f := range v {
			fields = append(fields, f)
		}
		want := strings.Fields(c.want)
		slices.Sort(fields)
		slices.Sort(want)
		if !slices.Equal(fields, want) {
			t.Errorf("%s: fields %q, want %q", c.zone, fields, want)
		}
	}
	if v := adminDo(t, tester, "GET", "/rate_limit/kv-ban/a", 200); v["banned"] != true {
		t.Errorf("kv-ban: %v, want banned", v)
	}
}
