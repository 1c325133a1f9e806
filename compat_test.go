// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// The configs of github.com/mholt/caddy-ratelimit's README and tests,
// loaded through a real Caddy: they must limit the clients they limit
// there. Only the listener's port differs (9080, the tests' port), and the
// README's `distributed`, which is refused here (see TestLoadErrors).

// loopback is a client whose connections come from the loopback address
// 127.0.0.<n>, so that the server sees a client of its own.
func loopback(n int) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(n))}, Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, "127.0.0.1:9080")
		},
	}}
}

// sendExpect makes a request of the client and checks its status; header holds
// name/value pairs. It returns the response's headers.
func sendExpect(t *testing.T, c *http.Client, method, path string, want int, header ...string) http.Header {
	t.Helper()
	req, err := http.NewRequest(method, "http://localhost:9080"+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != want {
		t.Errorf("%s %s %q: status %d, want %d (RateLimit: %s)", method, path, header, resp.StatusCode, want, resp.Header.Get("RateLimit"))
	}
	return resp.Header
}

// resetBucket empties nothing and fills one bucket through the admin API,
// so that a zone name used by an earlier config starts afresh.
func resetBucket(t *testing.T, zone, key string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodDelete, "http://localhost:2999/rate_limit/"+url.PathEscape(zone)+"/"+url.PathEscape(key), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
		t.Fatalf("resetting %s/%s: status %d", zone, key, resp.StatusCode)
	}
}

const readmeJSON = `{
	"handler": "rate_limit",
	"rate_limits": {
		"static_example": {
			"match": [
				{"method": ["GET"]}
			],
			"key": "static",
			"window": "1m",
			"max_events": 100
		},
		"dynamic_example": {
			"key": "{http.request.remote.host}",
			"window": "5s",
			"max_events": 2
		}
	}
},
{
	"handler": "static_response",
	"body": "I'm behind the rate limiter!"
}`

const readmeCaddyfile = `:9080

rate_limit {
	zone static_example {
		key    static
		events 100
		window 1m
	}
	zone dynamic_example {
		key    {remote_host}
		events 2
		window 5s
	}
}

respond "I'm behind the rate limiter!"
`

// TestCaddyRatelimitREADME: 100 GET requests a minute across all clients,
// and 2 requests per client IP in 5 seconds.
// (The README's Caddyfile leaves out the JSON's matcher: there every
// method counts.)
func TestCaddyRatelimitREADME(t *testing.T) {
	check := func(t *testing.T, first int, getOnly bool) {
		resetBucket(t, "static_example", "static")
		// dynamic_example: each client IP has 2 requests.
		a, b := loopback(first), loopback(first+1)
		sendExpect(t, a, "GET", "/", 200)
		sendExpect(t, a, "GET", "/", 200)
		h := sendExpect(t, a, "GET", "/", 429)
		if h.Get("Retry-After") != "3" { // the next of 2 per 5s comes in 2.5s
			t.Errorf("Retry-After %q, want 3", h.Get("Retry-After"))
		}
		sendExpect(t, b, "GET", "/", 200)
		sendExpect(t, b, "POST", "/", 200)
		sendExpect(t, b, "POST", "/", 429)
		// static_example: one bucket of 100 GETs for all clients. 3 are
		// spent (4 if POSTs count); the rest go to other clients, and the
		// next is refused.
		spent, post := 4, 429
		if getOnly {
			spent, post = 3, 200
		}
		for i := range 100 - spent {
			sendExpect(t, loopback(first+2+i/2), "GET", "/", 200)
		}
		sendExpect(t, loopback(first+60), "GET", "/", 429)
		sendExpect(t, loopback(first+60), "POST", "/", post)
	}
	t.Run("json", func(t *testing.T) {
		loadJSON(t, jsonServer(readmeJSON))
		check(t, 2, true)
	})
	t.Run("caddyfile", func(t *testing.T) {
		startCaddy(t, "", readmeCaddyfile)
		check(t, 102, false)
	})
}

// caddy-ratelimit's TestRateLimits and TestCaddyfileRateLimits: 10 GET
// requests a minute for everyone. There the 11th waits 60s, for the
// oldest event to leave the window; here the bucket refills one request
// every 6s.
func TestCaddyRatelimitTestRateLimits(t *testing.T) {
	check := func(t *testing.T) {
		resetBucket(t, "zone1", "static")
		for i := range 10 {
			sendExpect(t, loopback(2+i), "GET", "/", 200)
		}
		h := sendExpect(t, loopback(20), "GET", "/", 429)
		if h.Get("Retry-After") != "6" {
			t.Errorf("Retry-After %q, want 6", h.Get("Retry-After"))
		}
		sendExpect(t, loopback(20), "POST", "/", 200)
	}
	t.Run("json", func(t *testing.T) {
		loadJSON(t, jsonServer(`{
	"handler": "rate_limit",
	"rate_limits": {
		"zone1": {
			"match": [{"method": ["GET"]}],
			"key": "static",
			"window": "60s",
			"max_events": 10
		}
	}
},
{
	"handler": "static_response",
	"status_code": 200
}`))
		check(t)
	})
	t.Run("caddyfile", func(t *testing.T) {
		startCaddy(t, "	order rate_limit before basicauth\n", `localhost:9080

rate_limit {
	zone zone1 {
		match {
			method GET
		}
		key static
		window 60s
		events 10
	}
}

respond 200
`)
		check(t)
	})
}

// caddy-ratelimit's TestDistinctZonesAndKeys: zones by method, keys by
// path, each counted on its own.
func TestCaddyRatelimitDistinctZonesAndKeys(t *testing.T) {
	loadJSON(t, jsonServer(`{
	"handler": "rate_limit",
	"rate_limits": {
		"zone1": {
			"match": [{"method": ["GET"]}],
			"key": "{http.request.orig_uri.path}",
			"window": "60s",
			"max_events": 10
		},
		"zone2": {
			"match": [{"method": ["DELETE"]}],
			"key": "{http.request.orig_uri.path}",
			"window": "60s",
			"max_events": 10
		}
	}
},
{
	"handler": "static_response",
	"status_code": 200
}`))
	for _, method := range []string{"GET", "DELETE"} {
		for _, path := range []string{"/path1", "/path2"} {
			for i := range 10 {
				sendExpect(t, loopback(2+i), method, path, 200)
			}
			sendExpect(t, loopback(2), method, path, 429)
		}
	}
}

// TestWindowZonesShareBuckets checks who shares a bucket in zones written
// with window and events, against zones in this plugin's own syntax.
func TestWindowZonesShareBuckets(t *testing.T) {
	check := func(t *testing.T, sfx string) {
		a, b := loopback(2), loopback(3)
		// No key: one bucket for all clients.
		sendExpect(t, a, "GET", "/nokey"+sfx, 200)
		sendExpect(t, b, "GET", "/nokey"+sfx, 429)

		// A key that expands to nothing: one shared bucket, not an
		// exemption; the native zone exempts it.
		sendExpect(t, a, "GET", "/empty"+sfx, 200)
		sendExpect(t, b, "GET", "/empty"+sfx, 429)
		sendExpect(t, a, "GET", "/empty"+sfx, 200, "X-Key", "k1")
		sendExpect(t, a, "GET", "/empty"+sfx, 429, "X-Key", "k1")
		sendExpect(t, a, "GET", "/empty"+sfx, 200, "X-Key", "k2")
		for range 3 {
			sendExpect(t, a, "GET", "/native_empty"+sfx, 200)
		}

		// IPv6 addresses are not grouped by /64 unless ipv6_prefix says.
		sendExpect(t, a, "GET", "/v6"+sfx, 200, "X-Forwarded-For", "2001:db8::1")
		sendExpect(t, a, "GET", "/v6"+sfx, 200, "X-Forwarded-For", "2001:db8::2")
		sendExpect(t, a, "GET", "/v6"+sfx, 429, "X-Forwarded-For", "2001:db8::1")
		sendExpect(t, a, "GET", "/v6_64"+sfx, 200, "X-Forwarded-For", "2001:db8::1")
		sendExpect(t, a, "GET", "/v6_64"+sfx, 429, "X-Forwarded-For", "2001:db8::2")
		sendExpect(t, a, "GET", "/native_v6"+sfx, 200, "X-Forwarded-For", "2001:db8::1")
		sendExpect(t, a, "GET", "/native_v6"+sfx, 429, "X-Forwarded-For", "2001:db8::2")

		// IPv4 addresses are each their own client in both.
		sendExpect(t, a, "GET", "/v6"+sfx, 200, "X-Forwarded-For", "198.51.100.1")
		sendExpect(t, a, "GET", "/v6"+sfx, 200, "X-Forwarded-For", "198.51.100.2")
		sendExpect(t, a, "GET", "/v6"+sfx, 429, "X-Forwarded-For", "198.51.100.1")
	}

	t.Run("json", func(t *testing.T) {
		zone := func(name, key, extra string) string {
			if key != "" {
				key = `"key": "` + key + `", `
			}
			return fmt.Sprintf(`"%s_j": {"match": [{"path": ["/%[1]s_j"]}], %s"window": "1m", "max_events": 1%s}`, name, key, extra)
		}
		loadJSON(t, jsonServer(`{
	"handler": "rate_limit",
	"rate_limits": {`+strings.Join([]string{
			zone("nokey", "", ""),
			zone("empty", "{http.request.header.X-Key}", ""),
			zone("v6", "{http.vars.client_ip}", ""),
			zone("v6_64", "{http.vars.client_ip}", `, "ipv6_prefix": 64`),
		}, ",\n")+`},
	"zones": [
		{"name": "native_empty_j", "match": [{"path": ["/native_empty_j"]}], "key": "{http.request.header.X-Key}", "rate": "1r/m"},
		{"name": "native_v6_j", "match": [{"path": ["/native_v6_j"]}], "rate": "1r/m"}
	]
},
{"handler": "static_response", "body": "ok"}`))
		check(t, "_j")
	})

	t.Run("caddyfile", func(t *testing.T) {
		zone := func(name, body string) string {
			return fmt.Sprintf("\t\tzone %s_c {\n\t\t\tmatch {\n\t\t\t\tpath /%[1]s_c\n\t\t\t}\n%s\t\t}\n", name, body)
		}
		window := "\t\t\twindow 1m\n\t\t\tevents 1\n"
		startCaddy(t, "\tservers {\n\t\ttrusted_proxies static 127.0.0.0/8\n\t}\n", "http://localhost:9080 {\n\trate_limit {\n"+
			zone("nokey", window)+
			zone("empty", "\t\t\tkey {header.X-Key}\n"+window)+
			zone("v6", "\t\t\tkey {client_ip}\n"+window)+
			zone("v6_64", "\t\t\tkey {client_ip}\n\t\t\tipv6_prefix 64\n"+window)+
			zone("native_empty", "\t\t\tkey {header.X-Key}\n\t\t\trate 1r/m\n")+
			zone("native_v6", "\t\t\trate 1r/m\n")+
			"\t}\n\trespond \"ok\"\n}\n")
		check(t, "_c")
	})
}

// TestOddZoneNames loads the names caddy-ratelimit accepts and this
// plugin once refused, and finds them in the headers, the admin API and
// the metrics.
func TestOddZoneNames(t *testing.T) {
	loadJSON(t, jsonServer(`{
	"handler": "rate_limit",
	"rate_limits": {
		"api:v1": {"key": "static", "window": "1m", "max_events": 2},
		"api/v1": {"key": "static", "window": "1m", "max_events": 2},
		"api@host": {"key": "static", "window": "1m", "max_events": 2},
		"a \"b\" é%": {"key": "static", "window": "1m", "max_events": 1}
	}
},
{"handler": "static_response", "body": "ok"}`))

	h := sendExpect(t, loopback(2), "GET", "/", 200)
	wantPolicy := `"a \"b\" %C3%A9%25";q=1;w=60, "api/v1";q=2;w=60, "api:v1";q=2;w=60, "api@host";q=2;w=60`
	if got := h.Get("RateLimit-Policy"); got != wantPolicy {
		t.Errorf("RateLimit-Policy %s, want %s", got, wantPolicy)
	}
	h = sendExpect(t, loopback(2), "GET", "/", 429)
	if got, want := h.Get("RateLimit"), `"a \"b\" %C3%A9%25";r=0;t=60, "api/v1";r=1;t=30, "api:v1";r=1;t=30, "api@host";r=1;t=30`; got != want {
		t.Errorf("RateLimit %s, want %s", got, want)
	}

	for _, name := range []string{"api:v1", "api/v1", "api@host", `a "b" é%`} {
		resp, err := http.Get("http://localhost:2999/rate_limit/" + url.PathEscape(name))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), fmt.Sprintf(`"name":%q`, name)) {
			t.Errorf("admin API for zone %s: %d %s", name, resp.StatusCode, body)
		}
	}
	resp, err := http.Get("http://localhost:2999/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, series := range []string{
		`caddy_rate_limit_requests_total{result="denied",zone="a \"b\" é%"} 1`,
		`caddy_rate_limit_requests_total{result="allowed",zone="api/v1"} 1`,
	} {
		if !strings.Contains(string(body), series) {
			t.Errorf("metrics lack %s", series)
		}
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

// TestJitterCap: a jitter of any size adds at most one full refill.
func TestJitterCap(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"jitter_cap","rate":"1r/m","burst":1}],"jitter":100}`)
	serve(h, "192.0.2.1")
	longer := false
	for range 20 {
		status, hdr := serve(h, "192.0.2.1")
		if status != 429 {
			t.Fatalf("status %d, want 429", status)
		}
		var secs int
		fmt.Sscan(hdr.Get("Retry-After"), &secs)
		if secs < 60 || secs > 120 {
			t.Errorf("Retry-After %d, want 60 to 120: the wait plus at most one refill", secs)
		}
		longer = longer || secs > 61
	}
	if !longer {
		t.Error("jitter 100 never lengthened Retry-After")
	}
}

// TestDenialLogOfItsOwn: Caddy's log config keeps this module's DEBUG
// denial lines, as the README shows for users of caddy-ratelimit's INFO
// lines.
func TestDenialLogOfItsOwn(t *testing.T) {
	file := filepath.Join(t.TempDir(), "rate_limit.log")
	tester := startCaddy(t, fmt.Sprintf(`	log rate_limit {
		include http.handlers.rate_limit
		level DEBUG
		output file %s
	}
`, file), `http://localhost:9080 {
	rate_limit {
		zone own_log {
			rate 1r/m
			burst 1
		}
	}
	respond "ok"
}
`)
	get(t, tester, "/", 200, "ok")
	get(t, tester, "/", 429, "")
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(file)
		if strings.Contains(string(b), `"msg":"rate limit exceeded"`) && strings.Contains(string(b), `"zone":"own_log"`) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no denial in %s: %s", file, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// loadJSON loads a JSON config into the test Caddy and waits until only
// its listener is left.
func loadJSON(t *testing.T, config string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(config, "json")
	if t.Failed() {
		t.FailNow()
	}
	waitOneListener(t, 9080)
	return tester
}
