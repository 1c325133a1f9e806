// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// A zone with spill, beside one without, through the handler: a request
// its bucket cannot take goes on, uncharged by it, charged by the other
// zone, named in the placeholders, counted as spilled (never as a dry
// run) and logged at DEBUG; its headers tell the spilling zone's
// standing. The other zone still refuses, all or nothing: a request it
// refuses takes nothing from the zone with spill, and is not spilled.
func TestSpillThroughHandler(t *testing.T) {
	h := newTestHandler(t, `{"zones":[
		{"name":"spill-primary","key":"{http.request.header.X-Key}","rate":"1r/h","burst":2,"spill":true},
		{"name":"spill-per-ip","rate":"1r/h","burst":3}]}`)
	core, logs := observer.New(zapcore.DebugLevel)
	h.logger = zap.New(core)
	primary, perIP := h.Zones[0].state, h.Zones[1].state
	send := func(ip, key string) (int, http.Header, *caddy.Replacer) {
		t.Helper()
		req, rr := newRequest(ip, "X-Key", key)
		err := h.ServeHTTP(rr, req, okHandler)
		repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if err != nil {
			return statusOf(err), rr.Header(), repl
		}
		return rr.Code, rr.Header(), repl
	}
	spilled := func(repl *caddy.Replacer) string {
		zone, _ := repl.GetString("http.rate_limit.spilled")
		mine, _ := repl.Get("http.rate_limit.spill-primary.spilled")
		return fmt.Sprint(zone, "/", mine)
	}
	for i := range 2 {
		if code, hdr, repl := send("192.0.2.1", "k"); code != 200 || spilled(repl) != "/false" || remainingOf(t, hdr, "spill-primary") != 1-i {
			t.Fatalf("request %d: %d, spilled %s, RateLimit %q; want 200, /false and %d left", i, code, spilled(repl), hdr.Get("RateLimit"), 1-i)
		}
	}
	code, hdr, repl := send("192.0.2.1", "k")
	if code != 200 || spilled(repl) != "spill-primary/true" || hdr.Get("Retry-After") != "" {
		t.Fatalf("over the limit: %d, spilled %s, Retry-After %q; want 200 and spill-primary/true", code, spilled(repl), hdr.Get("Retry-After"))
	}
	// The headers tell the spilling zone's standing: nothing left.
	if remainingOf(t, hdr, "spill-primary") != 0 || remainingOf(t, hdr, "spill-per-ip") != 0 || hdr.Get("X-Ratelimit-Remaining") != "0" {
		t.Fatalf("spilled: RateLimit %q, X-RateLimit-Remaining %q; want nothing left in either", hdr.Get("RateLimit"), hdr.Get("X-Ratelimit-Remaining"))
	}
	if n := logs.FilterMessage("rate limit exceeded: the request goes on, spilled").FilterField(zap.String("zone", "spill-primary")).Len(); n != 1 {
		t.Fatalf("%d DEBUG lines of the spill, want 1", n)
	}
	// The per-IP zone refuses, and the zone with spill spills nothing.
	code, hdr, repl = send("192.0.2.1", "k")
	if code != 429 || hdr.Get("Retry-After") != "3600" || spilled(repl) != "/<nil>" {
		t.Fatalf("the per-IP zone empty: %d, Retry-After %q, spilled %s; want 429, 3600 and nothing", code, hdr.Get("Retry-After"), spilled(repl))
	}
	if name, _ := repl.GetString("http.rate_limit.exceeded.name"); name != "spill-per-ip" {
		t.Fatalf("refused by %q, want spill-per-ip", name)
	}
	// A key with tokens, refused by the per-IP zone: it takes nothing.
	if code, _, _ := send("192.0.2.1", "k2"); code != 429 {
		t.Fatalf("k2 from the empty IP: %d, want 429", code)
	}
	if code, hdr, _ := send("192.0.2.2", "k2"); code != 200 || remainingOf(t, hdr, "spill-primary") != 1 {
		t.Fatalf("k2 from another IP: %d, RateLimit %q; want 200 and 1 left: the refused request took nothing", code, hdr.Get("RateLimit"))
	}
	for _, c := range []struct {
		name      string
		got, want uint64
	}{
		{"primary allowed", primary.allowed.Load(), 3},
		{"primary spilled", primary.spilled.Load(), 1},
		{"primary denied", primary.denied.Load(), 0},
		{"primary dry_run_denied", primary.dryRunDenied.Load(), 0},
		{"per-IP allowed", perIP.allowed.Load(), 4},
		{"per-IP denied", perIP.denied.Load(), 2},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d, want %d", c.name, c.got, c.want)
		}
	}
}

// A zone with spill in dry run spills nothing: it tells what it would
// refuse, as any zone in dry run, and its spill placeholders say that it
// spilled nothing, as a zone's that took the request do (false, and
// none named), rather than being unknown.
func TestSpillInDryRun(t *testing.T) {
	h := newTestHandler(t, `{"dry_run":true,"zones":[{"name":"spill-dry","rate":"1r/h","burst":1,"spill":true}]}`)
	for i := range 2 {
		req, rr := newRequest("192.0.2.1")
		if err := h.ServeHTTP(rr, req, okHandler); err != nil {
			t.Fatal(err)
		}
		repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		zone, _ := repl.Get("http.rate_limit.spilled")
		mine, _ := repl.Get("http.rate_limit.spill-dry.spilled")
		would, _ := repl.Get("http.rate_limit.spill-dry.would_deny")
		if zone != "" || mine != false || would != (i == 1) {
			t.Fatalf("request %d: spilled %#v and %#v, would_deny %v; want \"\", false and %v", i, zone, mine, would, i == 1)
		}
	}
	if st := h.Zones[0].state; st.spilled.Load() != 0 || st.dryRunDenied.Load() != 1 {
		t.Fatalf("spilled %d, dry_run_denied %d; want 0 and 1", st.spilled.Load(), st.dryRunDenied.Load())
	}
}

// spill's Caddyfile errors.
func TestSpillCaddyfileErrors(t *testing.T) {
	zone := func(lines string) string {
		return "rate_limit {\n\tzone primary {\n\t\trate 100/m\n" + lines + "\t}\n}"
	}
	for _, tc := range []struct{ name, input, wantErr string }{
		{"an argument", zone("\t\tspill yes\n"), "wrong argument count"},
		{"with delay", zone("\t\tspill\n\t\tdelay 1s\n"), "spill cannot go with delay"},
		{"with concurrency adaptive", zone("\t\tspill\n\t\tconcurrency adaptive\n"), "spill cannot go with concurrency adaptive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want %q", err, tc.wantErr)
			}
		})
	}
	checkValidate(t, `{"zones":[{"name":"a","rate":"1r/s","spill":true,"delay":"1s"}]}`, "spill cannot go with delay")
}

// spillSite is docs/usage.md's config: the zone primary spills what it
// cannot take to a fallback upstream, whose own zone, in a second
// rate_limit that reads the placeholder, limits the fallback too. The
// responses say which upstream answered and what the placeholders held.
func spillSite(name, primary, fallback, storeCfg string) string {
	return fmt.Sprintf(`http://localhost {
	route {
		rate_limit {
			zone primary-%[1]s {
				key {http.request.header.Authorization}
				rate 3/h
				spill
			}
			%[4]s
		}
		rate_limit {
			zone fallback-%[1]s {
				match {
					vars {http.rate_limit.spilled} primary-%[1]s
				}
				key {http.request.header.Authorization}
				rate 2/h
			}
			%[4]s
		}
	}
	@spilled vars {http.rate_limit.spilled} primary-%[1]s
	reverse_proxy @spilled %[3]s {
		header_down X-Upstream fallback
		header_down X-Spilled "{http.rate_limit.primary-%[1]s.spilled} {http.rate_limit.spilled}"
	}
	reverse_proxy %[2]s {
		header_down X-Upstream primary
		header_down X-Spilled "{http.rate_limit.primary-%[1]s.spilled} {http.rate_limit.spilled}"
	}
}
`, name, strings.TrimPrefix(primary, "http://"), strings.TrimPrefix(fallback, "http://"), storeCfg)
}

// The docs' config through a real Caddy, on the local store and on Redis,
// with upstreams that answer as OpenAI's API does: a key's first 3
// requests go to the primary, the next 2 spill to the fallback, whose own
// zone then refuses the sixth with its 429. The primary zone counts 3
// allowed and 3 spilled (the sixth too: it let it go on), none refused.
func TestSpillThroughCaddy(t *testing.T) {
	r := startRedis(t)
	primary, fallback := startLLMUpstream(t), startLLMUpstream(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n\t\t\t\taddress " + r.Addr() + "\n\t\t\t\ttimeout 5s\n\t\t\t\tkey_prefix spill:\n\t\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tester := startCaddy(t, "", spillSite(tc.name, primary.URL, fallback.URL, tc.store))
			base := scrape(t, tester)
			want := []struct {
				code              int
				upstream, spilled string
			}{
				{200, "primary", "false"},
				{200, "primary", "false"},
				{200, "primary", "false"},
				{200, "fallback", "true primary-" + tc.name},
				{200, "fallback", "true primary-" + tc.name},
				{429, "", ""},
			}
			for i, w := range want {
				path := "/json?tokens=5"
				if i%2 == 1 {
					path = "/sse?tokens=5"
				}
				code, h, body := llmGet(t, "sk-spill", path)
				if code != w.code || h.Get("X-Upstream") != w.upstream || h.Get("X-Spilled") != w.spilled {
					t.Fatalf("request %d: %d, upstream %q, spilled %q; want %d, %q, %q (%q)", i, code, h.Get("X-Upstream"), h.Get("X-Spilled"), w.code, w.upstream, w.spilled, body)
				}
				if i >= 3 && i < 5 && remainingOf(t, h, "fallback-"+tc.name) != 4-i {
					t.Fatalf("request %d: RateLimit %q, want %d left in the fallback's zone", i, h.Get("RateLimit"), 4-i)
				}
				if code == 429 && h.Get("Retry-After") != "1800" {
					t.Fatalf("request %d: Retry-After %q, want 1800 (a token at 2/h)", i, h.Get("Retry-After"))
				}
			}
			m := scrape(t, tester)
			series := func(zone, result string) string {
				return fmt.Sprintf(`caddy_rate_limit_requests_total{limit=%q,result=%q,zone=%q}`, map[bool]string{true: "3/h burst 3", false: "2/h burst 2"}[strings.HasPrefix(zone, "primary")], result, zone)
			}
			for _, c := range []struct {
				zone, result string
				n            float64
			}{
				{"primary-" + tc.name, "allowed", 3},
				{"primary-" + tc.name, "spilled", 3},
				{"primary-" + tc.name, "denied", 0},
				{"primary-" + tc.name, "dry_run_denied", 0},
				{"fallback-" + tc.name, "allowed", 2},
				{"fallback-" + tc.name, "denied", 1},
			} {
				wantMetric(t, m, series(c.zone, c.result), base[series(c.zone, c.result)]+c.n)
			}
			info, err := adminGet(t, http.MethodGet, "/rate_limit/primary-"+tc.name)
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(info["spill"], info["requests"].(map[string]any)["spilled"]) != "true 3" {
				t.Fatalf("the admin API's zone: %v", info)
			}
		})
	}
}

// The config, one rate_limit and no limit on the fallback: the
// headers of a spilled response tell the primary zone's standing.
func TestSpillHeadersThroughCaddy(t *testing.T) {
	primary, fallback := startLLMUpstream(t), startLLMUpstream(t)
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone primary-alone {
			key {http.request.header.Authorization}
			rate 1/h
			spill
		}
	}
	@spilled vars {http.rate_limit.spilled} primary-alone
	reverse_proxy @spilled %s {
		header_down X-Upstream fallback
	}
	reverse_proxy %s {
		header_down X-Upstream primary
	}
}
`, strings.TrimPrefix(fallback.URL, "http://"), strings.TrimPrefix(primary.URL, "http://")))
	for i, upstream := range []string{"primary", "fallback", "fallback"} {
		code, h, body := llmGet(t, "sk-alone", "/json?tokens=5")
		if code != 200 || h.Get("X-Upstream") != upstream || remainingOf(t, h, "primary-alone") != 0 || h.Get("Retry-After") != "" {
			t.Fatalf("request %d: %d %q from %q, RateLimit %q, Retry-After %q; want 200 from %s and 0 left",
				i, code, body, h.Get("X-Upstream"), h.Get("RateLimit"), h.Get("Retry-After"), upstream)
		}
	}
}

// softOutageSite has a route per way a zone may never refuse, each on a
// Redis store at addr with fail_mode closed: /spill (a zone with spill,
// whose fallback answers "fallback"), /dry (a zone in dry run), /dry-all
// (a handler in dry run) and /mixed (a zone with spill beside one that
// refuses). The responses say what the placeholders held.
func softOutageSite(addr string) string {
	store := "store redis {\n\t\t\t\taddress " + addr + "\n\t\t\t\ttimeout 200ms\n\t\t\t\tfail_mode closed\n\t\t\t}"
	return fmt.Sprintf(`http://localhost {
	handle /spill {
		rate_limit {
			zone soft-spill {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
				spill
			}
			%[1]s
		}
		@spilled vars {http.rate_limit.spilled} soft-spill
		respond @spilled "fallback {http.rate_limit.soft-spill.spilled}" 200
		respond "primary {http.rate_limit.soft-spill.spilled}" 200
	}
	handle /dry {
		rate_limit {
			zone soft-dry {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
				dry_run
			}
			%[1]s
		}
		respond "primary {http.rate_limit.soft-dry.would_deny} {http.rate_limit.would_deny}" 200
	}
	handle /dry-all {
		rate_limit {
			dry_run
			zone soft-dry-all {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
			}
			%[1]s
		}
		respond "primary {http.rate_limit.soft-dry-all.would_deny}" 200
	}
	handle /mixed {
		rate_limit {
			zone soft-mixed-spill {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
				spill
			}
			zone soft-mixed-hard {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
			}
			%[1]s
		}
		respond "primary" 200
	}
}
`, store)
}

// With its Redis stopped, then frozen, and fail_mode closed, a zone that
// never refuses never refuses: closed takes the unknown for over its
// limit, so a zone with spill spills (the fallback route takes the
// request, counted spilled) and a zone in dry run, or a handler in dry
// run, lets it through as a would-be refusal (counted dry_run_denied);
// each counts the store's error too. A request that a zone which
// refuses applies to still gets closed's 503, and spills nothing.
func TestSoftZonesWhenRedisFails(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, "", softOutageSite(r.Addr()))
	for _, fault := range []string{"stopped", "frozen"} {
		t.Run(fault, func(t *testing.T) {
			if fault == "stopped" {
				r.Kill()
			} else {
				// Frozen once the store uses Redis again, so that its
				// calls time out rather than the breaker answering.
				r.Start()
				deadline := time.Now().Add(20 * time.Second)
				for {
					if _, _, body := llmGetAt(t, siteURL, "/spill", "X-Key", "probe"); body == "primary false" {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the store did not use Redis again after its restart")
					}
					time.Sleep(50 * time.Millisecond)
				}
				r.Pause()
				defer r.Resume()
			}
			base := scrape(t, tester)
			const n = 3
			for _, c := range []struct{ path, want string }{
				{"/spill", "fallback true"},
				{"/dry", "primary true soft-dry"},
				{"/dry-all", "primary true"},
			} {
				for i := range n {
					code, _, body := llmGetAt(t, siteURL, c.path, "X-Key", "k-"+fault)
					if code != 200 || body != c.want {
						t.Fatalf("%s, request %d: %d %q, want 200 %q", c.path, i, code, body, c.want)
					}
				}
			}
			for i := range n {
				if code, _, body := llmGetAt(t, siteURL, "/mixed", "X-Key", "k-"+fault); code != 503 {
					t.Fatalf("/mixed, request %d: %d %q, want fail_mode closed's 503", i, code, body)
				}
			}
			m := scrape(t, tester)
			series := func(zone, result string) string {
				return fmt.Sprintf(`caddy_rate_limit_requests_total{limit="1r/m burst 2",result=%q,zone=%q}`, result, zone)
			}
			for _, c := range []struct {
				zone, result string
				n            float64
			}{
				{"soft-spill", "spilled", n},
				{"soft-spill", "store_error", n},
				{"soft-spill", "allowed", 0},
				{"soft-dry", "dry_run_denied", n},
				{"soft-dry", "store_error", n},
				{"soft-dry", "allowed", 0},
				{"soft-dry-all", "dry_run_denied", n},
				{"soft-dry-all", "store_error", n},
				{"soft-mixed-spill", "spilled", 0},
				{"soft-mixed-spill", "store_error", n},
				{"soft-mixed-hard", "store_error", n},
			} {
				wantMetric(t, m, series(c.zone, c.result), base[series(c.zone, c.result)]+c.n)
			}
		})
	}
}
