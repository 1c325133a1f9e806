// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		json    string
		wantErr string // empty: valid
	}{
		{name: "minimal", json: `{"zones":[{"name":"a","rate":"1r/s"}]}`},
		{
			name: "every field",
			json: `{"zones":[{"name":"api.v1_x-y","key":"{http.request.header.X-Api-Key}","rate":"100/10s","burst":200,"cost":200,` +
				`"match":[{"path":["/api/*"]}],"ipv4_prefix":32,"ipv6_prefix":128}],` +
				`"store":{"backend":"local","max_keys":10},"headers":"ietf","jitter":1,"log_key":true}`,
		},
		{name: "headers empty means both", json: `{"zones":[{"name":"a","rate":"1r/s"}],"headers":""}`},
		{name: "no zones", json: `{}`, wantErr: "no zones"},
		{name: "empty zones", json: `{"zones":[]}`, wantErr: "no zones"},
		{name: "null zone", json: `{"zones":[null]}`, wantErr: "zone is null"},
		{name: "missing name", json: `{"zones":[{"rate":"1r/s"}]}`, wantErr: "name is required"},
		// Any name caddy-ratelimit accepts, but the empty one.
		{name: "name with space", json: `{"zones":[{"name":"a b","rate":"1r/s"}]}`},
		{name: "name with quote", json: `{"zones":[{"name":"a\"b","rate":"1r/s"}]}`},
		{name: "name with non-ASCII letter", json: `{"zones":[{"name":"zoné","rate":"1r/s"}]}`},
		{name: "names with : / @ % { }", json: `{"rate_limits":{"api:v1":{"window":"1s","max_events":1},"api/v1":{"window":"1s","max_events":1},` +
			`"api@host":{"window":"1s","max_events":1},"100%{x}":{"window":"1s","max_events":1}}}`},
		{name: "empty name in rate_limits", json: `{"rate_limits":{"":{"window":"1s","max_events":1}}}`, wantErr: "name is required"},

		// caddy-ratelimit's JSON.
		{
			name: "caddy-ratelimit README example",
			json: `{"rate_limits":{"static_example":{"match":[{"method":["GET"]}],"key":"static","window":"1m","max_events":100},` +
				`"dynamic_example":{"key":"{http.request.remote.host}","window":"5s","max_events":2}},"jitter":0.2,"sweep_interval":"1m"}`,
		},
		{name: "rate_limits and zones", json: `{"zones":[{"name":"b","rate":"1r/s"}],"rate_limits":{"a":{"window":"1s","max_events":1}}}`},
		{
			name:    "name in both",
			json:    `{"zones":[{"name":"a","rate":"1r/s"}],"rate_limits":{"a":{"window":"1s","max_events":1}}}`,
			wantErr: "zone a is both in zones and in rate_limits",
		},
		{
			name:    "other name inside rate_limits",
			json:    `{"rate_limits":{"a":{"name":"b","window":"1s","max_events":1}}}`,
			wantErr: "rate_limits: zone a has the name 'b'",
		},
		{name: "null in rate_limits", json: `{"rate_limits":{"a":null}}`, wantErr: "rate_limits: zone a is null"},
		{name: "max_events 0", json: `{"rate_limits":{"a":{"window":"1m","max_events":0}}}`, wantErr: "zone a: max_events is required with window, and at least 1"},
		{name: "max_events missing", json: `{"rate_limits":{"a":{"window":"1m"}}}`, wantErr: "zone a: max_events is required with window"},
		{name: "max_events negative", json: `{"rate_limits":{"a":{"window":"1m","max_events":-1}}}`, wantErr: "zone a: invalid max_events -1: must be at least 1"},
		{name: "window missing", json: `{"rate_limits":{"a":{"max_events":10}}}`, wantErr: "zone a: invalid window 0s: must be a positive duration"},
		{name: "window negative", json: `{"rate_limits":{"a":{"window":"-1s","max_events":10}}}`, wantErr: "zone a: invalid window -1s"},
		{name: "neither window nor rate", json: `{"rate_limits":{"a":{"key":"static"}}}`, wantErr: "zone a: rate is required (or window and max_events, concurrency or quota)"},
		{name: "window and rate", json: `{"zones":[{"name":"a","rate":"1r/s","window":"1s","max_events":1}]}`, wantErr: "zone a: use either rate and burst or window and max_events"},
		{name: "window and burst", json: `{"zones":[{"name":"a","burst":5,"window":"1s","max_events":1}]}`, wantErr: "zone a: use either rate and burst or window and max_events"},
		{name: "max_events of 16 digits", json: `{"rate_limits":{"a":{"window":"1000h","max_events":1000000000000000}}}`, wantErr: "zone a: invalid burst 1000000000000000"},
		{name: "window too long to refill", json: `{"rate_limits":{"a":{"window":"1000000h","max_events":1}}}`, wantErr: "takes more than 100 years to refill"},
		{name: "window too fast", json: `{"rate_limits":{"a":{"window":"1ns","max_events":999999999999999}}}`, wantErr: "more than"},
		{name: "distributed", json: `{"rate_limits":{"a":{"window":"1s","max_events":1}},"distributed":{}}`, wantErr: `'distributed' is a github.com/mholt/caddy-ratelimit option: use "store": {"backend": "redis"`},
		{name: "storage", json: `{"rate_limits":{"a":{"window":"1s","max_events":1}},"storage":{"module":"file_system"}}`, wantErr: `'storage' is a github.com/mholt/caddy-ratelimit option`},
		{name: "negative sweep_interval", json: `{"rate_limits":{"a":{"window":"1s","max_events":1}},"sweep_interval":"-1s"}`, wantErr: "invalid sweep_interval -1s"},
		{name: "missing rate", json: `{"zones":[{"name":"a"}]}`, wantErr: "zone a: rate is required"},
		{name: "zero rate", json: `{"zones":[{"name":"a","rate":"0r/s"}]}`, wantErr: "zone a: invalid rate '0r/s': must be positive"},
		{name: "negative rate", json: `{"zones":[{"name":"a","rate":"-1/1s"}]}`, wantErr: "zone a: invalid rate '-1/1s': must be positive"},
		{name: "bad rate unit", json: `{"zones":[{"name":"a","rate":"10r/x"}]}`, wantErr: "zone a: invalid rate '10r/x': unknown unit 'x'"},
		{name: "negative burst", json: `{"zones":[{"name":"a","rate":"1r/s","burst":-1}]}`, wantErr: "zone a: invalid burst -1: must be at least 1"},
		{name: "burst of 15 digits", json: `{"zones":[{"name":"a","rate":"1000000000r/s","burst":999999999999999}]}`},
		{
			name:    "burst of 16 digits",
			json:    `{"zones":[{"name":"a","rate":"1000000000r/s","burst":1000000000000000}]}`,
			wantErr: "zone a: invalid burst 1000000000000000: at most 999999999999999, the largest integer the RateLimit headers can carry",
		},
		{
			name:    "default burst of 16 digits",
			json:    `{"zones":[{"name":"a","rate":"1e16/100000h"}]}`,
			wantErr: "zone a: invalid rate '1e16/100000h': 1e+16 is too large a default burst: set a burst of at most 999999999999999",
		},
		{name: "negative cost", json: `{"zones":[{"name":"a","rate":"1r/s","cost":-2}]}`, wantErr: "zone a: invalid cost -2: must be at least 1"},
		{name: "cost above burst", json: `{"zones":[{"name":"a","rate":"1r/s","burst":2,"cost":3}]}`, wantErr: "zone a: cost 3 exceeds burst 2"},
		{name: "cost above default burst", json: `{"zones":[{"name":"a","rate":"2.5r/s","cost":4}]}`, wantErr: "zone a: cost 4 exceeds burst 3"},
		{name: "ipv4_prefix 33", json: `{"zones":[{"name":"a","rate":"1r/s","ipv4_prefix":33}]}`, wantErr: "zone a: invalid ipv4_prefix 33"},
		{name: "ipv4_prefix negative", json: `{"zones":[{"name":"a","rate":"1r/s","ipv4_prefix":-1}]}`, wantErr: "zone a: invalid ipv4_prefix -1"},
		{name: "ipv6_prefix 129", json: `{"zones":[{"name":"a","rate":"1r/s","ipv6_prefix":129}]}`, wantErr: "zone a: invalid ipv6_prefix 129"},
		{name: "ipv6_prefix negative", json: `{"zones":[{"name":"a","rate":"1r/s","ipv6_prefix":-64}]}`, wantErr: "zone a: invalid ipv6_prefix -64"},
		{
			name:    "refill beyond 100 years",
			json:    `{"zones":[{"name":"a","rate":"1r/d","burst":40000}]}`,
			wantErr: "zone a: burst 40000 at rate 1r/d takes more than 100 years to refill",
		},
		{
			name:    "duplicate names",
			json:    `{"zones":[{"name":"a","rate":"1r/s"},{"name":"b","rate":"1r/s"},{"name":"a","rate":"2r/s"}]}`,
			wantErr: "duplicate zone name 'a'",
		},
		{name: "concurrency only", json: `{"zones":[{"name":"a","concurrency":4,"lease":"30s"}]}`},
		{name: "concurrency and rate", json: `{"zones":[{"name":"a","rate":"1r/s","concurrency":4}]}`},
		{name: "negative concurrency", json: `{"zones":[{"name":"a","concurrency":-1}]}`, wantErr: "zone a: invalid concurrency -1"},
		{name: "lease without concurrency", json: `{"zones":[{"name":"a","rate":"1r/s","lease":"10s"}]}`, wantErr: "zone a: lease needs concurrency"},
		{name: "negative lease", json: `{"zones":[{"name":"a","concurrency":1,"lease":"-1s"}]}`, wantErr: "zone a: invalid lease -1s"},
		{name: "cost without a rate", json: `{"zones":[{"name":"a","concurrency":1,"cost":2}]}`, wantErr: "zone a: cost needs a rate"},
		{name: "bad headers", json: `{"zones":[{"name":"a","rate":"1r/s"}],"headers":"all"}`, wantErr: "invalid headers 'all'"},
		{name: "negative jitter", json: `{"zones":[{"name":"a","rate":"1r/s"}],"jitter":-0.1}`, wantErr: "invalid jitter -0.1"},
		{name: "jitter above 1", json: `{"zones":[{"name":"a","rate":"1r/s"}],"jitter":1.5}`},
		{name: "jitter of 100", json: `{"zones":[{"name":"a","rate":"1r/s"}],"jitter":100}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkValidate(t, tc.json, tc.wantErr)
		})
	}
}

// Validate must not fill in defaults: JSON users' configs stay as written
// until Provision.
func TestValidateChangesNothing(t *testing.T) {
	in := `{"zones":[{"name":"a","rate":"1r/s"}]}`
	var h Handler
	if err := json.Unmarshal([]byte(in), &h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := toJSON(t, &h); got != in {
		t.Errorf("after Validate: %s, want %s", got, in)
	}
}

func TestParseRate(t *testing.T) {
	for _, tc := range []struct {
		in         string
		wantPerSec float64
		wantN      float64
		wantErr    string
	}{
		{in: "10r/s", wantPerSec: 10, wantN: 10},
		{in: "10/s", wantPerSec: 10, wantN: 10},
		{in: "0.5r/s", wantPerSec: 0.5, wantN: 0.5},
		{in: "30r/m", wantPerSec: 0.5, wantN: 30},
		{in: "3/m", wantPerSec: 0.05, wantN: 3},
		{in: "3600r/h", wantPerSec: 1, wantN: 3600},
		{in: "86400r/d", wantPerSec: 1, wantN: 86400},
		{in: "100/10s", wantPerSec: 10, wantN: 100},
		{in: "100r/10s", wantPerSec: 10, wantN: 100},
		{in: "1/500ms", wantPerSec: 2, wantN: 1},
		{in: "3r/1m30s", wantPerSec: 3.0 / 90, wantN: 3},
		{in: "7/2d", wantPerSec: 7.0 / (2 * 86400), wantN: 7},
		{in: "1e3r/s", wantPerSec: 1000, wantN: 1000},
		{in: "abc", wantErr: "expected <n>r/s, <n>r/m, <n>r/h or <n>/<duration>"},
		{in: "10", wantErr: "expected <n>r/s"},
		{in: "", wantErr: "expected <n>r/s"},
		{in: "r/s", wantErr: "'' is not a number"},
		{in: "10rr/s", wantErr: "'10r' is not a number"},
		{in: "ten/s", wantErr: "'ten' is not a number"},
		{in: "NaN/s", wantErr: "'NaN' is not a number"},
		{in: "Inf/s", wantErr: "'Inf' is not a number"},
		{in: "1e999/s", wantErr: "'1e999' is not a number"},
		{in: "0r/s", wantErr: "must be positive"},
		{in: "-1r/s", wantErr: "must be positive"},
		{in: "10r/x", wantErr: "unknown unit 'x'"},
		{in: "10r/", wantErr: "unknown unit ''"},
		{in: "10r/sec", wantErr: "unknown unit 'sec'"},
		{in: "10/0s", wantErr: "interval '0s' must be positive"},
		{in: "10/-1m", wantErr: "interval '-1m' must be positive"},
		{in: "1/99999999999999h", wantErr: "interval '99999999999999h' is too long"},
		{in: "1/9999999999999d", wantErr: "interval '9999999999999d' is too long"},
		{in: "1/1e3s", wantErr: "unknown unit '1e3s'"},
	} {
		perSec, n, err := parseRate(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("parseRate(%q): error %v, want one containing %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("parseRate(%q): unexpected error: %v", tc.in, err)
			continue
		}
		if math.Abs(perSec-tc.wantPerSec) > 1e-12*tc.wantPerSec || n != tc.wantN {
			t.Errorf("parseRate(%q) = %v/s, n=%v; want %v/s, n=%v", tc.in, perSec, n, tc.wantPerSec, tc.wantN)
		}
	}
}

// A key that is exactly one request header is read from the header,
// without the replacer: it must expand to what the replacer gives, for a
// field missing, sent once, sent empty or sent twice, whatever the case
// of its name in the template.
func TestHeaderKeyAsReplacer(t *testing.T) {
	for _, tmpl := range []string{"{http.request.header.X-API-Key}", "{http.request.header.x-api-key}"} {
		h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"hk","key":%q,"rate":"10r/s"}]}`, tmpl))
		z := h.Zones[0]
		if z.keyKind != keyHeader {
			t.Fatalf("%s: key kind %d, want keyHeader", tmpl, z.keyKind)
		}
		viaReplacer := *z
		viaReplacer.keyKind = keyTemplate
		for _, vals := range [][]string{nil, {"k1"}, {""}, {"k1", "k2"}, {"10.0.0.1"}} {
			req := httptest.NewRequest(http.MethodGet, "/", nil)
			for _, v := range vals {
				req.Header.Add("X-Api-Key", v)
			}
			caddyhttp.NewTestReplacer(req)
			got, gotOK := z.bucketKey(req)
			want, wantOK := viaReplacer.bucketKey(req)
			if got != want || gotOK != wantOK {
				t.Errorf("%s with %q: %v %v, replacer gives %v %v", tmpl, vals, got, gotOK, want, wantOK)
			}
		}
	}
	for _, tmpl := range []string{"{http.request.header.X}-{http.request.host}", "{http.request.header.X}}", `{http.request.header.X\}`, "x{y}"} {
		h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"hk2","key":%q,"rate":"10r/s"}]}`, tmpl))
		if k := h.Zones[0].keyKind; k != keyTemplate {
			t.Errorf("%s: key kind %d, want keyTemplate", tmpl, k)
		}
	}
}

// A key that is exactly one other placeholder is its value, read without
// the replacer's search of a template: the same string as the template
// gives, for a placeholder unknown, without a value, of a string, of a
// number.
func TestPlaceholderKeyAsReplacer(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"pk","key":"{http.vars.tenant}","rate":"10r/s"}]}`)
	z := h.Zones[0]
	if z.keyKind != keyPlaceholder {
		t.Fatalf("key kind %d, want keyPlaceholder", z.keyKind)
	}
	viaReplacer := *z
	viaReplacer.keyKind = keyTemplate
	for _, v := range []any{nil, "", "t1", 42, "10.0.0.1"} {
		req, _ := newRequest("192.0.2.1")
		if v != nil {
			caddyhttp.SetVar(req.Context(), "tenant", v)
		}
		got, gotOK := z.bucketKey(req)
		want, wantOK := viaReplacer.bucketKey(req)
		if got != want || gotOK != wantOK {
			t.Errorf("%v: %v %v, the replacer gives %v %v", v, got, gotOK, want, wantOK)
		}
	}
	for tmpl, want := range map[string]keyKind{"{http.request.header.}": keyPlaceholder, "{http.rate_limit.json.model}": keyPlaceholder, "{}": keyTemplate, "{": keyTemplate} {
		if k, _ := keyKindOf(tmpl); k != want {
			t.Errorf("%s: key kind %d, want %d", tmpl, k, want)
		}
	}
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
		resp, err := http.Get("http://" + adminAddr + "/rate_limit/" + url.PathEscape(name))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), fmt.Sprintf(`"name":%q`, name)) {
			t.Errorf("admin API for zone %s: %d %s", name, resp.StatusCode, body)
		}
	}
	resp, err := http.Get("http://" + adminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, series := range []string{
		`caddy_rate_limit_requests_total{result="denied",zone="a \"b\" é%"} 1`,
		`caddy_rate_limit_requests_total{result="allowed",zone="api/v1"} 1`,
	} {
		if !strings.Contains(withoutLimit(string(body)), series) {
			t.Errorf("metrics lack %s", series)
		}
	}
}
