// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Burst and cost read from JSON as numbers, as strings of digits, or as
// strings with placeholders, and write back as they were given.
func TestZoneJSONPlaceholders(t *testing.T) {
	for _, tc := range []struct {
		in, out string
		burst   int64
		vars    string // burstVar's template
	}{
		{`{"name":"a","rate":"1r/s","burst":10}`, `{"name":"a","rate":"1r/s","burst":10}`, 10, ""},
		{`{"name":"a","rate":"1r/s","burst":"10"}`, `{"name":"a","rate":"1r/s","burst":10}`, 10, ""},
		{`{"name":"a","rate":"{p_rate}","burst":"{p_burst}","cost":"{http.request.header.X-Cost}"}`,
			`{"name":"a","rate":"{p_rate}","burst":"{p_burst}","cost":"{http.request.header.X-Cost}"}`, 0, "{p_burst}"},
	} {
		var z Zone
		if err := json.Unmarshal([]byte(tc.in), &z); err != nil {
			t.Fatalf("%s: %v", tc.in, err)
		}
		if z.Burst != tc.burst || z.burstVar.template != tc.vars {
			t.Errorf("%s: burst %d, template %q; want %d, %q", tc.in, z.Burst, z.burstVar.template, tc.burst, tc.vars)
		}
		out, err := json.Marshal(&z)
		if err != nil {
			t.Fatal(err)
		}
		if string(out) != tc.out {
			t.Errorf("%s: marshals as %s, want %s", tc.in, out, tc.out)
		}
	}
	for _, tc := range []struct{ in, wantErr string }{
		{`{"name":"a","rate":"1r/s","burst":true}`, "invalid burst true"},
		{`{"name":"a","rate":"1r/s","cost":"ten"}`, "invalid cost 'ten': expected a whole number"},
		{`{"name":"a","rate":"1r/s","bogus":1}`, `unknown field "bogus"`},
	} {
		var z Zone
		if err := json.Unmarshal([]byte(tc.in), &z); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: error %v, want %q", tc.in, err, tc.wantErr)
		}
	}
}

// Validate checks the shape of templates for JSON users, as the
// Caddyfile does.
func TestValidatePlaceholders(t *testing.T) {
	for _, tc := range []struct{ zone, wantErr string }{
		{`{"name":"a","rate":"{r}x"}`, "invalid rate '{r}x': expected a rate such as 10r/s, or placeholders such as {plan_rate}"},
		{`{"name":"a","rate":"{r","burst":2}`, "invalid rate '{r': placeholder not closed"},
		{`{"name":"a","rate":"1r/s","burst":"{b}0x"}`, "invalid burst '{b}0x': expected a whole number"},
		{`{"name":"a","rate":"1r/s","cost":"{}"}`, "invalid cost '{}': empty placeholder"},
		{`{"name":"a","burst":"{b}"}`, "rate is required with placeholders in burst or cost"},
		{`{"name":"a","rate":"{r}","burst":2,"cost":3}`, "cost 3 exceeds burst 2"},
		{`{"name":"a","window":"1m","max_events":2,"cost":"{c}"}`, "need rate and burst, not window and max_events"},
		{`{"name":"a","concurrency":2,"burst":"{b}"}`, "burst needs a rate"},
	} {
		var h Handler
		if err := json.Unmarshal([]byte(`{"zones":[`+tc.zone+`]}`), &h); err != nil {
			t.Fatalf("%s: %v", tc.zone, err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%s: error %v, want %q", tc.zone, err, tc.wantErr)
		}
	}
}

// Templates that are neither numbers nor placeholders fail the Caddyfile
// with the file and line.
func TestCaddyfilePlaceholderErrors(t *testing.T) {
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"burst word", "rate_limit {\n\tzone a {\n\t\trate {plan_rate}\n\t\tburst ten\n\t}\n}",
			"invalid burst 'ten': expected a whole number, or placeholders such as {plan_burst}", 4},
		{"burst unclosed", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tburst {plan_burst\n\t}\n}",
			"invalid burst '{plan_burst': placeholder not closed", 4},
		{"cost text around", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tburst 5\n\t\tcost x{c}\n\t}\n}",
			"invalid cost 'x{c}': expected a whole number, or placeholders such as {plan_cost}", 5},
		{"rate text around", "rate_limit {\n\tzone a {\n\t\trate {n}r/x\n\t}\n}",
			"invalid rate '{n}r/x': expected a rate such as 10r/s, or placeholders such as {plan_rate}", 3},
		{"rate nested", "rate_limit {\n\tzone a {\n\t\trate {a{b}}\n\t}\n}",
			"invalid rate '{a{b}}': '{' inside a placeholder", 3},
		{"one-line burst", "rate_limit {client_ip} {plan_rate} {b}}", "invalid burst '{b}}': '}' without its '{'", 1},
		{"burst with events", "rate_limit {\n\tzone a {\n\t\twindow 1m\n\t\tevents 2\n\t\tburst {b}\n\t}\n}",
			"events is already the burst", 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want %q", err, tc.wantErr)
			}
			if suffix := fmt.Sprintf(", at Testfile:%d", tc.line); !strings.HasSuffix(err.Error(), suffix) {
				t.Errorf("error %q does not end in %q", err, suffix)
			}
		})
	}
}

// A zone keeps at most maxPlans limits, answers 500 for a value that
// makes no valid limit, and logs each refused value once.
func TestPlansBoundedAndLoggedOnce(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"plans-bound","key":"{http.request.header.X-Key}",
		"rate":"{http.request.header.X-Rate}","cost":"{http.request.header.X-Cost}"}]}`)
	logs := observePlanLogs(h)
	serveRate := func(rate, cost string) int {
		code, _ := serve(h, "192.0.2.1", "X-Key", "k"+rate, "X-Rate", rate, "X-Cost", cost)
		return code
	}
	for i := range maxPlans {
		if code := serveRate(fmt.Sprintf("%dr/m", 1000+i), "1"); code != http.StatusOK {
			t.Fatalf("limit %d: %d", i+1, code)
		}
	}
	for range 3 {
		if code := serveRate("5000r/m", "1"); code != http.StatusInternalServerError {
			t.Fatalf("limit %d: %d, want 500", maxPlans+1, code)
		}
		if code := serveRate("1000r/m", "1"); code != http.StatusOK {
			t.Fatalf("a known limit: %d", code)
		}
	}
	for _, bad := range [][2]string{{"lots", "1"}, {"", "1"}, {"10r/m", "11"}, {"10r/m", "-1"}} {
		for range 3 {
			if code := serveRate(bad[0], bad[1]); code != http.StatusInternalServerError {
				t.Fatalf("rate %q cost %q: %d, want 500", bad[0], bad[1], code)
			}
		}
	}
	refusals := logs.FilterMessage("rate limit: no valid limit for the request: answered 500")
	if n := refusals.FilterField(zap.String("rate", "5000r/m")).Len(); n != 1 {
		t.Errorf("the limit beyond the %d logged %d times, want once", maxPlans, n)
	}
	if n := refusals.FilterField(zap.String("rate", "lots")).Len(); n != 1 {
		t.Errorf("rate 'lots' logged %d times, want once", n)
	}
	if n := refusals.FilterField(zap.String("cost", "11")).Len(); n != 1 {
		t.Errorf("cost 11 (above the burst) logged %d times, want once", n)
	}
	if n := refusals.Len(); n != 5 {
		t.Errorf("%d refusals logged, want 5: one per distinct value", n)
	}
}

// The RateLimit headers show each request's own limit.
func TestPlanHeaders(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"plan-hdr","key":"{http.request.header.X-Key}",
		"rate":"{http.request.header.X-Rate}","burst":"{http.request.header.X-Burst}"}]}`)
	_, hdr := serve(h, "192.0.2.1", "X-Key", "a", "X-Rate", "6000r/m", "X-Burst", "200")
	if got, want := hdr.Get("Ratelimit-Policy"), `"plan-hdr";q=200;w=2`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := hdr.Get("Ratelimit"), `"plan-hdr";r=199;t=1`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	if got := hdr.Get("X-Ratelimit-Limit"); got != "200" {
		t.Errorf("X-RateLimit-Limit %q, want 200", got)
	}
	_, hdr = serve(h, "192.0.2.1", "X-Key", "b", "X-Rate", "60r/m", "X-Burst", "10")
	if got, want := hdr.Get("Ratelimit-Policy"), `"plan-hdr";q=10;w=10`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
}

// Plans through a real Caddy, with a map of the client's plan: free and
// pro keys at their own limits in one zone, a plan change that carries
// the bucket over clamped to the new burst, and a bad value answered 500
// and logged once; on each store.
func TestPlansThroughCaddy(t *testing.T) {
	r := startRedis(t)
	nodes := startCluster(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\ttimeout 5s\n\t\t\tkey_prefix plans:\n\t\t}", r.Addr())},
		{"cluster", fmt.Sprintf("store redis {\n\t\t\taddress %s %s %s\n\t\t\ttimeout 5s\n\t\t}", nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			global := fmt.Sprintf("\tlog {\n\t\toutput file %s\n\t\tformat json\n\t}\n", logFile)
			tester := startCaddy(t, global, fmt.Sprintf(`http://localhost {
	map {http.request.header.X-Plan} {plan_rate} {plan_burst} {
		pro     5r/m  5
		broken  lots  5
		default 1r/m  2
	}
	rate_limit {
		zone plans-%s {
			key   {http.request.header.X-API-Key}
			rate  {plan_rate}
			burst {plan_burst}
		}
		%s
	}
	respond "ok"
}
`, tc.name, tc.store))
			zone := `"plans-` + tc.name + `"`
			call := func(key, plan string, want int, wantRetry string) http.Header {
				t.Helper()
				hdr := get(t, tester, "/", want, map[int]string{200: "ok"}[want], "X-API-Key", key, "X-Plan", plan)
				if want == http.StatusTooManyRequests && hdr.Get("Retry-After") != wantRetry {
					t.Fatalf("%s on %s: Retry-After %q, want %q", key, plan, hdr.Get("Retry-After"), wantRetry)
				}
				return hdr
			}
			// Pro: 5 at once, a token every 12s.
			for range 5 {
				if hdr := call("pro-key", "pro", 200, ""); hdr.Get("Ratelimit-Policy") != zone+";q=5;w=60" {
					t.Fatalf("pro policy %q", hdr.Get("Ratelimit-Policy"))
				}
			}
			call("pro-key", "pro", 429, "12")
			// Free, in the same zone: 2 at once, a token a minute.
			for range 2 {
				if hdr := call("free-key", "free", 200, ""); hdr.Get("Ratelimit-Policy") != zone+";q=2;w=120" {
					t.Fatalf("free policy %q", hdr.Get("Ratelimit-Policy"))
				}
			}
			call("free-key", "free", 429, "60")
			// The free key turns pro: its empty bucket stays empty, now
			// owing a whole pro bucket (60s) rather than 120s…
			hdr := call("free-key", "pro", 429, "12")
			if got := hdr.Get("Ratelimit"); got != zone+";r=0;t=12" {
				t.Fatalf("after the change, RateLimit %q", got)
			}
			// …and free, back again, finds its bucket empty too: a change
			// of plan hands back no tokens.
			call("free-key", "free", 429, "60")

			// The admin API tells when the bucket is full again, and
			// leaves out the tokens and burst, which depend on the plan
			// of a request it does not have, for a key it knows and for
			// one never seen.
			v := adminDo(t, tester, http.MethodGet, "/rate_limit/plans-"+tc.name+"/free-key", http.StatusOK)
			if fullIn, _ := v["full_in"].(float64); fullIn <= 110 || fullIn > 120 {
				t.Errorf("admin API: full_in %v, want free's whole bucket, 120s", v["full_in"])
			}
			for _, key := range []string{"free-key", "never-seen"} {
				v := adminDo(t, tester, http.MethodGet, "/rate_limit/plans-"+tc.name+"/"+key, http.StatusOK)
				for _, field := range []string{"tokens", "burst"} {
					if got, ok := v[field]; ok {
						t.Errorf("admin API, key %s: %s %v, for a limit that comes with each request", key, field, got)
					}
				}
			}
			if tc.name == "redis" {
				hash, field := bucketName(t, "plans:", "plans-redis", "", 0, "free-key")
				if got := r.CLI("HEXISTS", hash, field); strings.TrimSpace(got) != "1" {
					t.Fatalf("the free key's bucket is not in Redis: HEXISTS said %q", got)
				}
			}

			// A value that makes no limit: 500, logged once.
			for range 3 {
				call("broken-key", "broken", 500, "")
			}
			data, err := os.ReadFile(logFile)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(string(data), `"rate":"lots"`); n != 1 {
				t.Errorf("rate 'lots' logged %d times, want once:\n%s", n, data)
			}
		})
	}
}

// observePlanLogs records what h's first zone logs of the limits it
// refuses.
func observePlanLogs(h *Handler) *observer.ObservedLogs {
	core, logs := observer.New(zapcore.DebugLevel)
	h.Zones[0].plans.logger = zap.New(core)
	return logs
}

// A key that emptied its bucket on one plan (owing 10s), sent once with
// a plan whose bucket refills in 2s, and back on the first, has no token
// back, on every store: a change of plan keeps the fraction of the bucket
// owed.
func TestPlanFlipHandsBackNoTokens(t *testing.T) {
	r := startRedis(t)
	zone := `{"zones":[{"name":"flip","key":"static","rate":"{http.vars.rate}","burst":"{http.vars.burst}"}]`
	for _, tc := range []struct{ name, config string }{
		{"local", zone + `}`},
		{"redis", zone + `,"store":{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"flip:"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, tc.config)
			send := func(rate string) (int, http.Header) {
				req, rr := newRequest("192.0.2.1")
				caddyhttp.SetVar(req.Context(), "rate", rate)
				caddyhttp.SetVar(req.Context(), "burst", "10")
				if err := h.ServeHTTP(rr, req, okHandler); err != nil {
					return statusOf(err), rr.Header()
				}
				return rr.Code, rr.Header()
			}
			for i := range 10 {
				if code, _ := send("1r/s"); code != 200 {
					t.Fatalf("free request %d: %d", i, code)
				}
			}
			if code, _ := send("5r/s"); code != 429 {
				t.Fatalf("on the 2s plan: %d, want 429: the bucket is empty on any plan", code)
			}
			code, hdr := send("1r/s")
			if code != 429 || hdr.Get("X-Ratelimit-Remaining") != "0" {
				t.Fatalf("back on the first plan: %d with %s tokens left, want 429 and 0", code, hdr.Get("X-Ratelimit-Remaining"))
			}
			if retry, _ := strconv.Atoi(hdr.Get("Retry-After")); retry < 1 {
				t.Fatalf("Retry-After %q", hdr.Get("Retry-After"))
			}
		})
	}
}
