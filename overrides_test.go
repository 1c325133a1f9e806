// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// cacheTrust is the longest an instance's over-limit cache refuses by
// what Redis last said: a change made through another instance is seen
// within it ("within a second", disable_over_limit_cache's doc).
const cacheTrust = time.Second

// adminSend sends a request with a JSON body to the test Caddy's admin
// API, checks its status and decodes its answer.
func adminSend(t *testing.T, method, path, body string, want int) map[string]any {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, "http://"+adminAddr+path, r)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("%s %s %s: %d %s, want %d", method, path, body, resp.StatusCode, b, want)
	}
	var v map[string]any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s %s: %v: %s", method, path, err, b)
	}
	return v
}

// Two instances share one Redis: a key's own limit set through one
// instance's admin API decides the other's requests within a second,
// headers and Retry-After included; it ends by itself, or when removed;
// a decision is still one script call.
func TestOverridesAcrossInstances(t *testing.T) {
	r := startRedis(t)
	storeCfg := `{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"ovx:"}`
	zone := `{"name":"ov-shared","rate":"1r/m","burst":2}`
	// The other instance first: the admin API acts on the newest, Caddy.
	other := newTestHandler(t, `{"zones":[`+zone+`],"store":`+strings.Replace(storeCfg, `"timeout":"5s"`, `"timeout":"2s"`, 1)+`}`)
	loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[`+zone+`],"store":`+storeCfg+`},{"handler":"static_response","body":"ok"}`))
	limitOf := func(ip string) (int, string, string) {
		code, hdr := serve(other, ip)
		limit := hdr.Get("X-Ratelimit-Limit")
		if policy := hdr.Get("Ratelimit-Policy"); !strings.Contains(policy, ";q="+limit+";") {
			t.Fatalf("RateLimit-Policy %q, X-RateLimit-Limit %s: not the same limit", policy, limit)
		}
		return code, limit, hdr.Get("Retry-After")
	}

	// The other instance empties a key's burst of 2, and its over-limit
	// cache learns the refusal.
	const ip = "198.51.100.40"
	for i, want := range []int{200, 200, 429, 429} {
		if code, _, _ := limitOf(ip); code != want {
			t.Fatalf("request %d: %d, want %d", i, code, want)
		}
	}
	set := time.Now()
	v := adminSend(t, "PUT", "/rate_limit/ov-shared/"+ip+"/limit", `{"burst":10}`, 200)
	if v["rate"] != "1r/m" || v["burst"] != float64(10) || v["expires_in"] != nil {
		t.Fatalf("PUT answered %v, want the zone's rate, burst 10, no end", v)
	}
	// Within a second the other instance allows the new burst: 8 more. Its
	// cache trusts the refusal it learnt before the PUT for a second at
	// most: a request sent a second after the PUT began, once the PUT is
	// done, is decided by Redis, which has the key's own limit. (How soon
	// after the PUT a request is sent, and how late it is decided, is the
	// machine's: the test measures from the instants it sends at.)
	setDone := time.Now()
	allowed := 0
	for {
		sent := time.Now()
		code, limit, _ := limitOf(ip)
		if code == 200 {
			if limit != "10" {
				t.Fatalf("X-RateLimit-Limit %q under the key's own limit, want 10", limit)
			}
			allowed++
			continue
		}
		if allowed > 0 {
			break
		}
		if sent.After(set.Add(cacheTrust)) && sent.After(setDone) {
			t.Fatalf("the other instance refused a request sent %v after the key's burst was raised, want none after a second", sent.Sub(set))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if allowed != 8 {
		t.Fatalf("%d requests allowed after burst 2 was emptied and raised to 10, want 8", allowed)
	}

	// Retry-After under the key's own limit: 1r/h.
	const slow = "198.51.100.41"
	adminSend(t, "PUT", "/rate_limit/ov-shared/"+slow+"/limit", `{"rate":"1r/h","burst":1}`, 200)
	limitOf(slow)
	if code, limit, retry := limitOf(slow); code != 429 || limit != "1" || retry != "3600" {
		t.Fatalf("a key at 1r/h burst 1, second request: %d, limit %s, Retry-After %s; want 429, 1, 3600", code, limit, retry)
	}

	// Bad bodies, an unknown zone.
	for _, body := range []string{`{"bogus":1}`, `{"rate":"fast"}`, `{"burst":0}`, `{"expires_in":"0s"}`, `{}`, `not json`} {
		v := adminSend(t, "PUT", "/rate_limit/ov-shared/"+ip+"/limit", body, 400)
		if msg, _ := v["error"].(string); msg == "" {
			t.Fatalf("%s: no reason in %v", body, v)
		}
	}
	adminSend(t, "PUT", "/rate_limit/ov-nope/"+ip+"/limit", `{"burst":3}`, 404)

	// A limit that ends by itself: its key is gone from Redis, and the
	// zone's limit decides again.
	// (It lasts 3s: the requests under it must all be decided before its
	// end, which a loaded machine may take long to do.)
	const brief = "198.51.100.42"
	const lasts = 3 * time.Second
	put := time.Now()
	adminSend(t, "PUT", "/rate_limit/ov-shared/"+brief+"/limit", `{"burst":5,"expires_in":"3s"}`, 200)
	z := other.Zones[0]
	_, _, limitKey := redisKeysOf(other).BucketLimit(bucketField(z.Name, z.spec().Shape), brief)
	rc := newRedisClient(t, r.Addr())
	if ttl := rc.PTTL(context.Background(), limitKey).Val(); ttl <= 0 || ttl > lasts {
		t.Fatalf("the limit's key %s: PTTL %v, want up to %v", limitKey, ttl, lasts)
	}
	for i := range 6 {
		if code, limit, _ := limitOf(brief); code != map[bool]int{true: 200, false: 429}[i < 5] || limit != "5" {
			t.Fatalf("request %d under burst 5: %d, limit %s", i, code, limit)
		}
	}
	done := time.Now()
	if done.After(put.Add(lasts)) {
		t.Fatalf("the requests under the limit took %v, past its end", done.Sub(put))
	}
	// The limit's end, and the cache's trust in what the last request
	// learnt of it.
	time.Sleep(time.Until(later(put.Add(lasts), done.Add(cacheTrust)).Add(50 * time.Millisecond)))
	if n := rc.Exists(context.Background(), limitKey).Val(); n != 0 {
		t.Fatalf("the limit's key is still in Redis after its end")
	}
	if code, limit, _ := limitOf(brief); code != 429 || limit != "2" {
		t.Fatalf("after the limit's end: %d, limit %s; want 429 (its spent tokens stay spent), 2", code, limit)
	}
	if v := adminSend(t, "GET", "/rate_limit/ov-shared/"+brief, "", 200); v["override"] != nil || v["burst"] != float64(2) {
		t.Fatalf("after the limit's end the key reads %v, want the zone's burst and no override", v)
	}

	// Removed: the zone's limit decides again within a second.
	removed := time.Now()
	adminSend(t, "DELETE", "/rate_limit/ov-shared/"+ip+"/limit", "", 200)
	removedDone := time.Now()
	for {
		sent := time.Now()
		if _, limit, _ := limitOf(ip); limit == "2" {
			break
		}
		if sent.After(removed.Add(cacheTrust)) && sent.After(removedDone) {
			t.Fatalf("the other instance decided a request sent %v after the limit's removal by it, want none after a second", sent.Sub(removed))
		}
		time.Sleep(20 * time.Millisecond)
	}
	adminSend(t, "DELETE", "/rate_limit/ov-shared/"+ip+"/limit", "", 404)

	// One script call per decision, with or without the key's own limit.
	const fresh = "198.51.100.43"
	adminSend(t, "PUT", "/rate_limit/ov-shared/"+fresh+"/limit", `{"burst":100}`, 200)
	for _, key := range []string{fresh, "198.51.100.44"} {
		calls := r.Calls()
		code := 0
		for range 2 {
			code, _, _ = limitOf(key)
		}
		if n := r.Calls() - calls; n != 2 || code != 200 {
			t.Fatalf("key %s: %d calls to Redis for 2 allowed requests (last %d), want 2", key, n, code)
		}
	}
	list := adminSend(t, "GET", "/rate_limit/ov-shared/limits", "", 200)
	if got := list["overrides"].([]any); len(got) != 2 {
		t.Fatalf("the zone lists %v, want the 2 keys' own limits left", got)
	}
}

// With the Redis store, a key longer than 128 bytes (hashed) and the key
// of its hash's 32 hex digits, or of '#' and them, keep buckets and own
// limits apart, through a real Caddy; keys that start with '#' work like
// any other; and the list of own limits names each key so that the admin
// API finds its limit again, as the list of top keys does.
func TestRedisLongKeyApartFromItsHash(t *testing.T) {
	r := startRedis(t)
	loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[
		{"name":"ov-hashed","key":"{http.request.header.X-Key}","rate":"1r/m","burst":2}],
		"store":{"backend":"redis","addresses":["`+r.Addr()+`"],"timeout":"5s","key_prefix":"ovh:"}},
		{"handler":"static_response","body":"ok"}`))
	c := &http.Client{Timeout: 10 * time.Second}
	long := strings.Repeat("k", 200)
	digits := hashOf(long)
	keys := []string{long, digits, "#" + digits, "##" + digits, "#foo"}
	path := func(key string) string { return "/rate_limit/ov-hashed/" + url.PathEscape(key) }
	for _, key := range keys {
		for i, want := range []int{200, 200, 429} {
			if code, _, _ := hit(t, c, "/", "192.0.2.9", "X-Key", key); code != want {
				t.Fatalf("request %d of %.40q: %d, want %d: a bucket of its own, burst 2", i+1, key, code, want)
			}
		}
	}
	// Own limits: each key's, and none of the others'.
	bursts := map[string]float64{long: 5, digits: 3, "#" + digits: 4, "#foo": 6}
	for key, burst := range bursts {
		adminSend(t, "PUT", path(key)+"/limit", fmt.Sprintf(`{"burst":%g}`, burst), 200)
	}
	adminSend(t, "GET", path("##"+digits)+"/limit", "", 404)
	// spent checks the key's bucket as GET reads it: its burst, 2 tokens
	// spent.
	spent := func(key string, v map[string]any) {
		t.Helper()
		want := bursts[key]
		if want == 0 {
			want = 2 // the zone's
		}
		if v["key"] != key || v["burst"] != want || v["tokens"].(float64) > want-2+0.5 {
			t.Fatalf("%.40q reads %v, want burst %g with 2 tokens spent", key, v, want)
		}
	}
	for _, key := range keys {
		spent(key, adminSend(t, "GET", path(key), "", 200))
	}
	if code, _, _ := hit(t, c, "/", "192.0.2.9", "X-Key", digits); code != 200 {
		t.Fatalf("%s under its own burst of 3: %d", digits, code)
	}
	if code, _, _ := hit(t, c, "/", "192.0.2.9", "X-Key", "##"+digits); code != 429 {
		t.Fatalf("##%s, with the zone's limit: %d", digits, code)
	}
	// Listed as they are: each names its own limit.
	list := adminSend(t, "GET", "/rate_limit/ov-hashed/limits", "", 200)["overrides"].([]any)
	if len(list) != len(bursts) {
		t.Fatalf("the zone lists %v, want %d keys", list, len(bursts))
	}
	for _, o := range list {
		o := o.(map[string]any)
		key, _ := o["key"].(string)
		if o["burst"] != bursts[key] {
			t.Fatalf("listed %v, want the burst of %.40q: %g", o, key, bursts[key])
		}
		if v := adminSend(t, "GET", path(key)+"/limit", "", 200); v["burst"] != bursts[key] || v["key"] != key {
			t.Fatalf("GET of %.40q as listed: %v", key, v)
		}
	}
	// The top keys, but the long one, which the list holds cut short
	// (metrics.go's topKey).
	top := adminSend(t, "GET", "/rate_limit/ov-hashed/top", "", 200)["top"].([]any)
	named := 0
	for _, o := range top {
		if key := o.(map[string]any)["key"].(string); slices.Contains(keys[1:], key) {
			spent(key, adminSend(t, "GET", path(key), "", 200))
			named++
		}
	}
	if named != len(keys)-1 {
		t.Fatalf("top lists %v, want %d of the keys as they are", top, len(keys)-1)
	}
	// Removed, each alone.
	adminSend(t, "DELETE", path(long)+"/limit", "", 200)
	adminSend(t, "DELETE", path(long)+"/limit", "", 404)
	if v := adminSend(t, "GET", path(digits)+"/limit", "", 200); v["burst"] != float64(3) {
		t.Fatalf("%s after the long key's limit was removed: %v", digits, v)
	}
}

// The local store's keys' own limits through a real Caddy's admin API:
// set, read, listed, bounded by max_overrides, kept across a reload,
// removed; keys as GET addresses them.
func TestAdminOverridesLocal(t *testing.T) {
	site := func(body string) string {
		return jsonServer(`{"handler":"rate_limit","zones":[
			{"name":"ov-local","rate":"1r/m","burst":2,"max_overrides":2},
			{"name":"ov-slots","key":"{http.request.header.X-Key}","concurrency":3}]},
			{"handler":"static_response","body":"` + body + `"}`)
	}
	loadJSON(t, site("ok"))
	c := &http.Client{Timeout: 10 * time.Second}
	v := adminSend(t, "PUT", "/rate_limit/ov-local/2001:db8:5::1/limit", `{"rate":"10r/m","burst":5,"expires_in":"1h"}`, 200)
	if v["bucket"] != "2001:db8:5::/64" || v["burst"] != float64(5) || v["expires_in"].(float64) < 3590 {
		t.Fatalf("PUT answered %v", v)
	}
	for i := range 6 { // another address of the /64
		if code, _, _ := hit(t, c, "/", "2001:db8:5::2"); code != map[bool]int{true: 200, false: 429}[i < 5] {
			t.Fatalf("request %d of the network with burst 5: %d", i, code)
		}
	}
	v = adminSend(t, "GET", "/rate_limit/ov-local/2001:db8:5::%2F64", "", 200)
	if o, _ := v["override"].(map[string]any); o == nil || o["burst"] != float64(5) || v["burst"] != float64(5) || v["tokens"].(float64) > 0.5 {
		t.Fatalf("GET of the network: %v, want its own limit, burst 5 and no token", v)
	}
	adminSend(t, "PUT", "/rate_limit/ov-local/%6Cimits/limit", `{"burst":3}`, 200) // the key "limits"
	if v := adminSend(t, "GET", "/rate_limit/ov-local/limits", "", 200); len(v["overrides"].([]any)) != 2 {
		t.Fatalf("the zone lists %v, want 2", v)
	}
	if v := adminSend(t, "PUT", "/rate_limit/ov-local/third/limit", `{"burst":3}`, 409); !strings.Contains(v["error"].(string), "max_overrides") {
		t.Fatalf("409 says %v", v)
	}
	adminSend(t, "PUT", "/rate_limit/ov-local/limits/limit", `{"burst":4}`, 200) // changing one is no more
	adminSend(t, "PUT", "/rate_limit/ov-slots/k/limit", `{"burst":4}`, 400)
	adminSend(t, "PUT", "/rate_limit/ov-local/k/limit", `{"burst":1,"rate":"1r/s","cost":2}`, 400)

	// A reload keeps them, and the buckets under them.
	loadJSON(t, site("reloaded"))
	if v := adminSend(t, "GET", "/rate_limit/ov-local/2001:db8:5::1/limit", "", 200); v["burst"] != float64(5) {
		t.Fatalf("after a reload: %v", v)
	}
	if code, body, _ := hit(t, c, "/", "2001:db8:5::3"); code != 429 || body != "" {
		t.Fatalf("after a reload the emptied network got %d %q, want 429", code, body)
	}
	adminSend(t, "DELETE", "/rate_limit/ov-local/2001:db8:5::1/limit", "", 200)
	adminSend(t, "DELETE", "/rate_limit/ov-local/2001:db8:5::1/limit", "", 404)
	adminSend(t, "GET", "/rate_limit/ov-local/2001:db8:5::1/limit", "", 404)
}

// Each change of a key's own limit is logged at INFO with the zone, the
// limit and the admin client; the key only with log_key.
func TestOverrideAudit(t *testing.T) {
	for _, logKey := range []bool{false, true} {
		h := newTestHandler(t, `{"zones":[{"name":"ov-audit","rate":"1r/s"}],"log_key":`+strconv.FormatBool(logKey)+`}`)
		core, logs := observer.New(zapcore.InfoLevel)
		h.logger = zap.New(core)
		for _, method := range []string{"PUT", "DELETE"} {
			req := httptest.NewRequest(method, "/rate_limit/ov-audit/secret-key/limit", strings.NewReader(`{"rate":"5r/s","expires_in":"1m"}`))
			req.RemoteAddr = "192.0.2.77:4444"
			if err := (adminAPI{}).serve(httptest.NewRecorder(), req); err != nil {
				t.Fatal(err)
			}
		}
		entries := logs.All()
		if len(entries) != 2 {
			t.Fatalf("%d log lines for a set and a removal, want 2", len(entries))
		}
		set := entries[0].ContextMap()
		if entries[0].Level != zapcore.InfoLevel || set["zone"] != "ov-audit" || set["rate"] != "5r/s" || set["burst"] != int64(1) ||
			set["admin_remote"] != "192.0.2.77:4444" || set["expires"] == nil {
			t.Fatalf("the set's log line: %s %v", entries[0].Message, set)
		}
		for _, e := range entries {
			if _, has := e.ContextMap()["key"]; has != logKey {
				t.Fatalf("log_key %v: the line %q has the key: %v", logKey, e.Message, has)
			}
		}
	}
}

// The limit of an empty key answers 400, whatever the method: it is not
// the zone's info. (Caddy's admin endpoint redirects a path with // to
// its cleaned form, that of another key; the handler does not rely on
// it.)
func TestOverrideEmptyKey(t *testing.T) {
	newTestHandler(t, `{"zones":[{"name":"ov-empty","rate":"1r/s"}]}`)
	for _, method := range []string{"PUT", "GET", "DELETE"} {
		req := httptest.NewRequest(method, "/rate_limit/ov-empty//limit", strings.NewReader(`{"burst":3}`))
		err := (adminAPI{}).serve(httptest.NewRecorder(), req)
		if ae, ok := errors.AsType[caddy.APIError](err); !ok || ae.HTTPStatus != 400 || !strings.Contains(ae.Err.Error(), "key") {
			t.Errorf("%s of an empty key's limit: %v, want 400 with the reason", method, err)
		}
	}
}

// A PUT and a DELETE of one key's own limit at once, on two instances of
// one Redis, leave the limit and the zone's list in agreement, whichever
// wins: the key's limit is read if and only if it is listed, and
// max_overrides counts it. On Redis Cluster too, where the limit and the
// list are in different slots.
func TestConcurrentOverrideChanges(t *testing.T) {
	r := startRedis(t)
	nodes := startCluster(t)
	for name, addrs := range map[string]string{
		"redis":   strconv.Quote(r.Addr()),
		"cluster": strconv.Quote(nodes[0].Addr()) + "," + strconv.Quote(nodes[1].Addr()) + "," + strconv.Quote(nodes[2].Addr()),
	} {
		t.Run(name, func(t *testing.T) {
			config := func(timeout string) string {
				return `{"zones":[{"name":"ov-race","rate":"10r/m","burst":5,"max_overrides":1}],
					"store":{"backend":"redis","addresses":[` + addrs + `],"timeout":"` + timeout + `"}}`
			}
			// Other timeouts: stores of their own, on clients of their own.
			a, b := newTestHandler(t, config("2s")), newTestHandler(t, config("3s"))
			z, race, other := a.Zones[0], store.Key{Text: "race"}, store.Key{Text: "other"}
			o, err := z.overrideOf(limitBody{Burst: new(int64(9))}, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			for round := range 100 {
				done := make(chan error, 2)
				go func() { done <- a.store.SetOverride(ctx, time.Now(), z.index, race, o) }()
				go func() {
					_, err := b.store.DeleteOverride(ctx, time.Now(), z.index, race)
					done <- err
				}()
				for range 2 {
					if err := <-done; err != nil {
						t.Fatalf("round %d: %v", round, err)
					}
				}
				_, has, err := a.store.Override(ctx, z.index, race)
				if err != nil {
					t.Fatal(err)
				}
				list, err := b.store.Overrides(ctx, z.index)
				if err != nil {
					t.Fatal(err)
				}
				n, err := a.store.OverrideCount(ctx, z.index)
				if err != nil {
					t.Fatal(err)
				}
				if listed := len(list) == 1 && list[0].Key == race.Text; has != listed || n != len(list) {
					t.Fatalf("round %d: the key has its own limit: %v; listed: %v (%v), counted %d", round, has, listed, list, n)
				}
				// max_overrides 1: another key's limit is refused while
				// this key has one.
				err = b.store.SetOverride(ctx, time.Now(), z.index, other, o)
				if has != errors.Is(err, store.ErrTooManyOverrides) || !has && err != nil {
					t.Fatalf("round %d: with the key's own limit %v, another key's PUT: %v", round, has, err)
				}
				if !has {
					if _, err := a.store.DeleteOverride(ctx, time.Now(), z.index, other); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
	}
}

// In a zone whose cost comes with each request, a key's own burst may be
// below a request's cost, which no PUT could check. Such a request is
// answered 500, as one whose plan has a cost above its burst, on each
// store: not a 429 whose headers promise tokens. It spends nothing, bans
// no one, and waits for nothing; the key's cheaper requests pass.
func TestCostAboveOwnBurst(t *testing.T) {
	eachStore(t, func(t *testing.T, backend, storeCfg string) {
		zone := func(name, extra string) string {
			return `{"name":"` + name + `-` + backend + `","rate":"100r/m","burst":100,"cost":"{http.request.header.X-Cost}",` + extra + `}`
		}
		banZone, delayZone := "ov-costban-"+backend, "ov-costdelay-"+backend
		loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[`+zone("ov-costban", `"ban":"1h"`)+`,`+zone("ov-costdelay", `"delay":"10s"`)+`],"store":`+storeCfg+`},
			{"handler":"static_response","body":"ok"}`))
		get := func(ip, cost string) (int, http.Header) {
			t.Helper()
			req, _ := http.NewRequest(http.MethodGet, siteIPURL+"/", nil)
			req.Header.Set("X-Forwarded-For", ip)
			req.Header.Set("X-Cost", cost)
			resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode, resp.Header
		}
		for zone, ip := range map[string]string{banZone: "198.51.100.70", delayZone: "198.51.100.71"} {
			adminSend(t, "PUT", "/rate_limit/"+zone+"/"+ip+"/limit", `{"burst":5}`, 200)
			for i := range 2 {
				if code, hdr := get(ip, "10"); code != 500 || hdr.Get("Retry-After") != "" || hdr.Get("Ratelimit") != "" {
					t.Fatalf("%s, request %d: cost 10 under the key's own burst 5: %d, headers %v; want 500 and no rate-limit headers", zone, i, code, hdr)
				}
			}
			if code, _ := get(ip, "1"); code != 200 {
				t.Fatalf("%s: a request of cost 1 after those: %d, want 200 (nothing spent, no ban)", zone, code)
			}
			if v := adminSend(t, "GET", "/rate_limit/"+zone+"/"+ip, "", 200); v["tokens"].(float64) < 3.9 || v["burst"] != float64(5) {
				t.Fatalf("%s: the key's bucket reads %v, want 4 of its 5 tokens", zone, v)
			}
		}
	})

	// The zone logs it, at most once a minute.
	h := newTestHandler(t, `{"zones":[{"name":"ov-costlog","rate":"100r/m","burst":100,"cost":"{http.request.header.X-Cost}"}]}`)
	core, logs := observer.New(zapcore.ErrorLevel)
	h.logger = zap.New(core)
	z := h.Zones[0]
	o, err := z.overrideOf(limitBody{Burst: new(int64(5))}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := h.store.SetOverride(context.Background(), time.Now(), z.index, z.keyFor("192.0.2.70"), o); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if code, _ := serve(h, "192.0.2.70", "X-Cost", "10"); code != 500 {
			t.Fatalf("cost 10 under the key's own burst 5: %d, want 500", code)
		}
	}
	if e := logs.All(); len(e) != 1 || e[0].ContextMap()["cost"] != int64(10) || e[0].ContextMap()["burst"] != int64(5) || e[0].ContextMap()["zone"] != "ov-costlog" {
		t.Fatalf("logged %v, want one line with the zone, the cost and the burst", e)
	}
}

// A PUT under a name that zones with different limits share (one per
// site, say) sets the key's own limit in all of them or in none: a body
// that one zone refuses (400), or a zone with its max_overrides already
// (409), leaves the others unchanged, through the API and the CLI alike;
// PUTs of many keys at once into a zone with room for one leave every
// zone of the name listing the same key.
func TestPutLimitAllOrNothing(t *testing.T) {
	eachStore(t, func(t *testing.T, backend, storeCfg string) {
		name := "ov-dup-" + backend
		loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[{"name":"`+name+`","rate":"10r/m","burst":20}],"store":`+storeCfg+`},
			{"handler":"rate_limit","zones":[{"name":"`+name+`","rate":"10r/m","burst":30,"cost":5,"max_overrides":1}],"store":`+storeCfg+`},
			{"handler":"static_response","body":"ok"}`))
		limit := func(key string) string { return "/rate_limit/" + name + "/" + key + "/limit" }
		// listed is the keys each zone of the name lists.
		listed := func() [][]string {
			t.Helper()
			var out [][]string
			for _, z := range adminSend(t, "GET", "/rate_limit/"+name+"/limits", "", 200)["zones"].([]any) {
				var keys []string
				for _, o := range z.(map[string]any)["overrides"].([]any) {
					keys = append(keys, o.(map[string]any)["key"].(string))
				}
				out = append(out, keys)
			}
			return out
		}

		const refused = "198.51.100.80"
		if v := adminSend(t, "PUT", limit(refused), `{"burst":3}`, 400); !strings.Contains(v["error"].(string), "cost 5 exceeds burst 3") {
			t.Fatalf("400 says %v", v)
		}
		cli := caddycmd.Commands()["rate-limit"]
		root := &cobra.Command{Use: "rate-limit"}
		cli.CobraFunc(root)
		root.SetOut(io.Discard)
		root.SetErr(io.Discard)
		root.SetArgs([]string{"limit", name, refused, "--burst", "3", "--address", adminAddr})
		if err := root.Execute(); err == nil || !strings.Contains(err.Error(), "400") {
			t.Fatalf("caddy rate-limit limit with a burst below a zone's cost: %v, want the 400", err)
		}
		adminSend(t, "GET", limit(refused), "", 404)
		c := &http.Client{Timeout: 10 * time.Second}
		for i := range 5 {
			if code, _, _ := hit(t, c, "/", refused); code != 200 {
				t.Fatalf("request %d of the key whose own limit was refused: %d, want 200", i, code)
			}
		}

		// Eight keys at once; the second zone has room for one.
		codes := make(chan int, 8)
		for i := range 8 {
			go func() {
				req, _ := http.NewRequest("PUT", "http://"+adminAddr+limit("198.51.100."+strconv.Itoa(90+i)), strings.NewReader(`{"burst":40}`))
				resp, err := c.Do(req)
				if err != nil {
					codes <- 0
					return
				}
				resp.Body.Close()
				codes <- resp.StatusCode
			}()
		}
		won := 0
		for range 8 {
			switch code := <-codes; code {
			case 200:
				won++
			case 409:
			default:
				t.Errorf("a PUT of one of 8 keys at once: %d, want 200 or 409", code)
			}
		}
		lists := listed()
		if won != 1 || len(lists) != 2 || len(lists[0]) != 1 || !slices.Equal(lists[0], lists[1]) {
			t.Fatalf("%d of 8 PUTs at once set the key's own limit; the zones list %v; want 1, the same key in both", won, lists)
		}
		adminSend(t, "PUT", limit(refused), `{"burst":40}`, 409)
		adminSend(t, "PUT", limit(lists[0][0]), `{"burst":50}`, 200) // changing one is no more
		if after := listed(); !slices.Equal(after[0], lists[0]) || !slices.Equal(after[1], lists[0]) {
			t.Fatalf("after a 409 and a change, the zones list %v, want %v in both", after, lists[0])
		}
	})

	// A zone whose store fails the change once the checks have passed
	// (its Redis refuses scripts): the zone set before it gets back what
	// the key had there, its own limit or none.
	t.Run("a store that fails", func(t *testing.T) {
		noScripts := startRedis(t, "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-evalsha", "-eval")
		const name = "ov-dup-fails"
		loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[{"name":"`+name+`","rate":"10r/m","burst":20}],"store":`+storeJSON()+`},
			{"handler":"rate_limit","zones":[{"name":"`+name+`","rate":"10r/m","burst":30}],"store":`+storeJSON(noScripts.Addr())+`},
			{"handler":"static_response","body":"ok"}`))
		first := lookupZones(name)[0]
		if first.h.storeName != "local" {
			t.Fatalf("the first zone of the name is on %s, want the local store", first.h.storeName)
		}
		own := func(key string) (store.Override, bool) {
			t.Helper()
			o, ok, err := first.h.store.Override(context.Background(), first.z.index, first.z.adminKey(key))
			if err != nil {
				t.Fatal(err)
			}
			return o, ok
		}
		adminSend(t, "PUT", "/rate_limit/"+name+"/198.51.100.98/limit", `{"burst":7}`, 502)
		if o, ok := own("198.51.100.98"); ok {
			t.Fatalf("after a 502 the first zone has the key's own limit %+v, want none", o)
		}
		had, err := first.z.overrideOf(limitBody{Burst: new(int64(4))}, time.Now())
		if err == nil {
			err = first.h.store.SetOverride(context.Background(), time.Now(), first.z.index, first.z.adminKey("198.51.100.99"), had)
		}
		if err != nil {
			t.Fatal(err)
		}
		adminSend(t, "PUT", "/rate_limit/"+name+"/198.51.100.99/limit", `{"burst":7}`, 502)
		if o, ok := own("198.51.100.99"); !ok || o.Burst != 4 {
			t.Fatalf("after a 502 the first zone has the key's own limit %+v (%v), want the burst 4 it had", o, ok)
		}
	})
}

// When a key's own limit ends, its bucket is carried back to the zone's
// limit alike on each store, and a GET before the key's next request
// reads it so: the token it spent under its own limit stays spent, and
// the zone's burst holds the rest.
func TestOverrideEndCarriesBucketBack(t *testing.T) {
	eachStore(t, func(t *testing.T, backend, storeCfg string) {
		zone := "ov-end-" + backend
		loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[
			{"name":"`+zone+`","rate":"10r/m","burst":10,"usage":{"json":"usage.total_tokens"}}],"store":`+storeCfg+`},
			{"handler":"static_response","body":"ok"}`))
		c := &http.Client{Timeout: 10 * time.Second}
		const ip = "198.51.100.60"
		adminSend(t, "PUT", "/rate_limit/"+zone+"/"+ip+"/limit", `{"rate":"1r/h","burst":1,"expires_in":"1s"}`, 200)
		if code, _, _ := hit(t, c, "/", ip); code != 200 {
			t.Fatalf("the request under the key's own limit: %d, want 200", code)
		}
		time.Sleep(1300 * time.Millisecond)
		v := adminSend(t, "GET", "/rate_limit/"+zone+"/"+ip, "", 200)
		if tokens, _ := v["tokens"].(float64); v["override"] != nil || v["burst"] != float64(10) || tokens < 8.99 || tokens > 9.01 {
			t.Fatalf("after the key's own limit ended it reads %v, want 9 tokens of the zone's 10 and no own limit", v)
		}
		for i := range 10 {
			if code, _, _ := hit(t, c, "/", ip); code != map[bool]int{true: 200, false: 429}[i < 9] {
				t.Fatalf("request %d after the key's own limit ended: %d", i, code)
			}
		}
	})
}

// eachStore runs f for the local store and for a Redis store of its own,
// with the store's name and its JSON.
func eachStore(t *testing.T, f func(t *testing.T, backend, storeCfg string)) {
	r := startRedis(t)
	for _, backend := range []string{"local", "redis"} {
		t.Run(backend, func(t *testing.T) {
			storeCfg := storeJSON()
			if backend == "redis" {
				storeCfg = storeJSON(r.Addr())
			}
			f(t, backend, storeCfg)
		})
	}
}

// A key's own limit through a real Caddy's admin API, on each store: the
// bodies out of the zone's bounds answer 400 with the reason, the zone's max_overrides 409, and caddy_rate_limit_overrides
// counts the zone's keys with their own limit.
func TestOverrideBoundsAndMetric(t *testing.T) {
	r := startRedis(t)
	rc := newRedisClient(t, r.Addr())
	for _, backend := range []string{"local", "redis"} {
		t.Run(backend, func(t *testing.T) {
			zone := "ov-bounds-" + backend
			storeCfg := storeJSON()
			if backend == "redis" {
				storeCfg = `{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"ovb:"}`
			}
			tester := loadJSON(t, jsonServer(`{"handler":"rate_limit","zones":[
				{"name":"`+zone+`","rate":"10r/m","burst":4,"cost":2,"max_overrides":2}],"store":`+storeCfg+`},
				{"handler":"static_response","body":"ok"}`))
			path := func(key string) string { return "/rate_limit/" + zone + "/" + key + "/limit" }
			for body, reason := range map[string]string{
				`{"burst":1000000000000000}`:     "at most 999999999999999",
				`{"burst":1}`:                    "cost 2 exceeds burst 1",
				`{"burst":3,"expires_in":"-1s"}`: "must be positive",
				`{"burst":3,"expires_in":-1}`:    "must be positive",
			} {
				v := adminSend(t, "PUT", path("k"), body, 400)
				if msg, _ := v["error"].(string); !strings.Contains(msg, reason) {
					t.Errorf("PUT %s: %q, want the reason %q", body, msg, reason)
				}
			}

			overrides := func() float64 {
				t.Helper()
				series := `caddy_rate_limit_overrides{zone="` + zone + `"}`
				v, ok := scrape(t, tester)[series]
				if !ok {
					t.Fatalf("no %s", series)
				}
				return v
			}
			if n := overrides(); n != 0 {
				t.Fatalf("%v keys with their own limit before any was set", n)
			}
			adminSend(t, "PUT", path("a"), `{"burst":8}`, 200)
			adminSend(t, "PUT", path("b"), `{"burst":6,"expires_in":"1h"}`, 200)
			if v := adminSend(t, "PUT", path("c"), `{"burst":6}`, 409); !strings.Contains(v["error"].(string), "max_overrides") {
				t.Fatalf("409 says %v", v)
			}
			adminSend(t, "PUT", path("a"), `{"burst":10}`, 200) // changing one is no more
			if n := overrides(); n != 2 {
				t.Fatalf("caddy_rate_limit_overrides %v after 2 were set and a third refused, want 2", n)
			}
			adminSend(t, "GET", path("c"), "", 404)
			adminSend(t, "DELETE", path("a"), "", 200)
			if n := overrides(); n != 1 {
				t.Fatalf("caddy_rate_limit_overrides %v after one of 2 was removed, want 1", n)
			}
			adminSend(t, "PUT", path("c"), `{"burst":6}`, 200) // room again
			if backend == "redis" {
				// The refused one left nothing in Redis: the zone lists b
				// and c.
				perSec, _, _ := parseRate("10r/m")
				list := rediswire.Keys{Prefix: "ovb:"}.Limits(bucketField(zone, gcra.NewLimit(perSec, 4)))
				if n := rc.ZCard(context.Background(), list).Val(); n != 2 {
					t.Fatalf("the zone's list of keys with their own limit holds %d, want 2", n)
				}
			}
		})
	}
}

// later is the later of two instants.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
