// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Zone names are global: a zone keeps its buckets across config loads
// while its name, rate and burst stay the same. Every test below therefore
// uses zone names of its own.

// rateLimitHeaders are all the headers the handler may set.
var rateLimitHeaders = []string{
	"X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset",
	"Ratelimit-Policy", "Ratelimit", "Retry-After",
}

// checkHeaders asserts each rate-limit header: those in want must have
// exactly that one value ("?" for any value), the others must be absent.
func checkHeaders(t *testing.T, step string, h http.Header, want map[string]string) {
	t.Helper()
	for _, name := range rateLimitHeaders {
		got := h.Values(name)
		w, ok := want[name]
		switch {
		case !ok && len(got) > 0:
			t.Errorf("%s: %s: %q, want no header", step, name, got)
		case ok && len(got) != 1:
			t.Errorf("%s: %s: %q, want one value", step, name, got)
		case ok && w != "?" && got[0] != w:
			t.Errorf("%s: %s: %q, want %q", step, name, got[0], w)
		}
	}
}

// checkReset asserts that X-Ratelimit-Reset is the Unix second, rounded
// up, at which the bucket is full again: debt after the bucket's first
// request, which was sent between from and to.
func checkReset(t *testing.T, step string, h http.Header, from, to time.Time, debt time.Duration) {
	t.Helper()
	reset, err := strconv.ParseInt(h.Get("X-Ratelimit-Reset"), 10, 64)
	if err != nil {
		t.Errorf("%s: X-Ratelimit-Reset: %v", step, err)
		return
	}
	lo, hi := from.Add(debt).Unix(), to.Add(debt).Unix()+1
	if reset < lo || reset > hi {
		t.Errorf("%s: X-Ratelimit-Reset %d, want %d to %d (now is %d)", step, reset, lo, hi, time.Now().Unix())
	}
}

// TestBurstThen429 spends a bucket of 3 that refills one token a minute
// and checks every header along the way.
func TestBurstThen429(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	rate_limit {client_ip} 1r/m 3
	respond "ok"
}
`)
	// The bucket's debt starts with the first request: each token is
	// worth a minute, and the headers count from there.
	from := time.Now()
	h := get(t, tester, "/", 200, "ok")
	to := time.Now()
	for i := 1; ; i++ {
		step := fmt.Sprintf("request %d", i)
		debt := time.Duration(i) * time.Minute
		checkHeaders(t, step, h, map[string]string{
			"X-Ratelimit-Limit":     "3",
			"X-Ratelimit-Remaining": strconv.Itoa(3 - i),
			"X-Ratelimit-Reset":     "?",
			"Ratelimit-Policy":      `"default";q=3;w=180`,
			"Ratelimit":             fmt.Sprintf(`"default";r=%d;t=60`, 3-i), // the next token
		})
		checkReset(t, step, h, from, to, debt)
		if i == 3 {
			break
		}
		h = get(t, tester, "/", 200, "ok")
	}

	for i := 4; i <= 5; i++ {
		step := fmt.Sprintf("request %d", i)
		h := get(t, tester, "/", 429, "")
		checkHeaders(t, step, h, map[string]string{
			"X-Ratelimit-Limit":     "3",
			"X-Ratelimit-Remaining": "0",
			"X-Ratelimit-Reset":     "?",
			"Ratelimit-Policy":      `"default";q=3;w=180`,
			"Ratelimit":             `"default";r=0;t=60`,
			"Retry-After":           "60",
		})
		checkReset(t, step, h, from, to, 3*time.Minute)
	}
}

// TestHeaderModes checks that `headers` picks the header families, and
// that Retry-After comes with every 429 whatever the mode.
func TestHeaderModes(t *testing.T) {
	tester := startCaddy(t, "", `http://localhost {
	handle /both {
		rate_limit {
			zone hm_both {
				rate 1r/m
				burst 1
			}
		}
		respond "ok"
	}
	handle /legacy {
		rate_limit {
			zone hm_legacy {
				rate 1r/m
				burst 1
			}
			headers legacy
		}
		respond "ok"
	}
	handle /ietf {
		rate_limit {
			zone hm_ietf {
				rate 1r/m
				burst 1
			}
			headers ietf
		}
		respond "ok"
	}
	handle /off {
		rate_limit {
			zone hm_off {
				rate 1r/m
				burst 1
			}
			headers off
		}
		respond "ok"
	}
}
`)
	legacy := func(remaining string) map[string]string {
		return map[string]string{"X-Ratelimit-Limit": "1", "X-Ratelimit-Remaining": remaining, "X-Ratelimit-Reset": "?"}
	}
	ietf := func(zone string) map[string]string {
		return map[string]string{
			"Ratelimit-Policy": fmt.Sprintf(`"%s";q=1;w=60`, zone),
			"Ratelimit":        fmt.Sprintf(`"%s";r=0;t=60`, zone),
		}
	}
	merge := func(ms ...map[string]string) map[string]string {
		out := make(map[string]string)
		for _, m := range ms {
			for k, v := range m {
				out[k] = v
			}
		}
		return out
	}
	retry := map[string]string{"Retry-After": "60"}
	for _, tc := range []struct {
		path            string
		allowed, denied map[string]string
	}{
		{path: "/both", allowed: merge(legacy("0"), ietf("hm_both")), denied: merge(legacy("0"), ietf("hm_both"), retry)},
		{path: "/legacy", allowed: legacy("0"), denied: merge(legacy("0"), retry)},
		{path: "/ietf", allowed: ietf("hm_ietf"), denied: merge(ietf("hm_ietf"), retry)},
		{path: "/off", allowed: map[string]string{}, denied: retry},
	} {
		h := get(t, tester, tc.path, 200, "ok")
		checkHeaders(t, tc.path+" allowed", h, tc.allowed)
		h = get(t, tester, tc.path, 429, "")
		checkHeaders(t, tc.path+" denied", h, tc.denied)
	}
}

func TestSFString(t *testing.T) {
	for name, want := range map[string]string{
		"api.v1_x-y": `"api.v1_x-y"`,
		"api:v1 /@":  `"api:v1 /@"`,
		`a"b\c`:      `"a\"b\\c"`,
		"100%":       `"100%25"`,
		"é\t\x7f":    `"%C3%A9%09%7F"`,
	} {
		if got := sfString(name); got != want {
			t.Errorf("sfString(%q) = %s, want %s", name, got, want)
		}
	}
	// Distinct names stay distinct: '%' is itself encoded.
	if sfString("é") == sfString("%C3%A9") {
		t.Error("é and %C3%A9 give the same sf-string")
	}
}

// A quota's X-RateLimit-Reset is its window's end, exactly, on every
// store: a day that ends at midnight in New York, request after request.
func TestQuotaResetIsTheWindowsEnd(t *testing.T) {
	r := startRedis(t)
	zone := `{"zones":[{"name":"reset-ny","key":"static","quota":100,"quota_period":"day","timezone":"America/New_York"}]`
	for _, tc := range []struct{ name, config string }{
		{"local", zone + `}`},
		{"redis", zone + `,"store":{"backend":"redis","addresses":["` + r.Addr() + `"],"timeout":"5s","key_prefix":"rny:"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, tc.config)
			for i := range 20 {
				end := h.Zones[0].quota.Window(time.Now()).End
				_, hdr := serve(h, "192.0.2.1")
				if got, want := hdr.Get("X-Ratelimit-Reset"), strconv.FormatInt(end.Unix(), 10); got != want {
					t.Fatalf("request %d: X-RateLimit-Reset %s, want %s, the window's end", i, got, want)
				}
			}
		})
	}
}

// BenchmarkHeadersWritten is what the headers cost a response, net/http's
// part included: after the handler, the header map is copied and
// written, as net/http does when it writes the status. "both" and "off"
// are the handler with and without its headers; "static" sets the same
// five fields to fixed values with Header.Set, as Caddy's header handler
// does, with no limiter; "none" neither. both − off is what our headers
// cost, static − none what five fields cost whoever sets them.
func BenchmarkHeadersWritten(b *testing.B) {
	static := [][2]string{
		{"X-Ratelimit-Limit", "1000000"}, {"X-Ratelimit-Remaining", "999999"}, {"X-Ratelimit-Reset", "1796233036"},
		{"Ratelimit-Policy", `"z";q=1000000;w=1`}, {"Ratelimit", `"z";r=999999;t=1`},
	}
	for _, tc := range []struct{ name, config string }{
		{"both", `{"zones":[{"name":"z","rate":"1000000000r/s"}]}`},
		{"off", `{"headers":"off","zones":[{"name":"z","rate":"1000000000r/s"}]}`},
		{"static", ""},
		{"none", ""},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var h *Handler
			if tc.config != "" {
				h = newTestHandler(b, tc.config)
				h.logger = zap.NewNop()
			}
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			vars := map[string]any{"client_ip": "192.0.2.1"}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			out := bufio.NewWriter(io.Discard)
			b.ReportAllocs()
			for b.Loop() {
				w := &headerSink{h: http.Header{"Server": {"Caddy"}, "Content-Type": {"text/plain; charset=utf-8"}}}
				switch {
				case h != nil:
					if err := h.ServeHTTP(w, req, next); err != nil {
						b.Fatal(err)
					}
				case tc.name == "static":
					for _, f := range static {
						w.h.Set(f[0], f[1])
					}
				}
				if err := w.h.Clone().Write(out); err != nil {
					b.Fatal(err)
				}
				out.Flush()
			}
		})
	}
}

// Seconds round up without wrapping around, up to the longest duration.
func TestCeilSecondsLongest(t *testing.T) {
	longest := gcra.AddSat(math.MaxInt64, time.Second) // the longest a sum of durations gives
	if got := ceilSeconds(longest - 1); got != int64(longest/time.Second) {
		t.Errorf("ceilSeconds(longest-1) = %d, want %d", got, longest/time.Second)
	}
}
