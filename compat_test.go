// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The configs of github.com/mholt/caddy-ratelimit's README and tests,
// loaded through a real Caddy: they must limit the clients they limit
// there. Only the listener differs (the tests' HTTP port), and the
// README's `distributed`, which is refused here (see TestLoadErrors).

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

const readmeCaddyfile = `http://

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
		reset := time.Now()
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
		// A token comes back every 600ms: by the refusal, what the time
		// since the reset gave back goes through too (on a loaded
		// machine, the 100 requests take seconds), and no more.
		last := loopback(first + 60)
		for extra := 0; ; extra++ {
			sent := time.Now()
			if code := statusFrom(t, last, "GET"); code == 429 {
				break
			} else if code != 200 || extra+1 > int(sent.Sub(reset)/(600*time.Millisecond)) {
				t.Fatalf("GET %d past the bucket of 100, %v after its reset: %d, want 429", extra+1, sent.Sub(reset), code)
			}
		}
		// A POST counts in the Caddyfile's zone: refused, unless a
		// token came back since the refusal.
		if code := statusFrom(t, last, "POST"); code != post && (getOnly || code != 200) {
			t.Fatalf("POST after the refusal: %d, want %d", code, post)
		}
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
		startCaddy(t, "	order rate_limit before basicauth\n", `http://localhost

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
		startCaddy(t, "\tservers {\n\t\ttrusted_proxies static 127.0.0.0/8\n\t}\n", "http://localhost {\n\trate_limit {\n"+
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

// statusFrom is the status of a request of / by the method, from the
// client c.
func statusFrom(t *testing.T, c *http.Client, method string) int {
	t.Helper()
	req, err := http.NewRequest(method, siteURL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}
