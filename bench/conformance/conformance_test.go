// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package conformance checks the plugin's rate-limit headers with an
// RFC 9651 (structured fields) parser, github.com/dunglas/httpsfv, through
// a real Caddy, for many configs: rates, bursts up to 999999999999999,
// odd zone names, several zones and every headers mode. On every 429, the
// `t` of each zone that refused must not be later than Retry-After. It
// lives in the bench module so that the parser never enters the plugin's
// go.mod.
package conformance

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"github.com/dunglas/httpsfv"

	_ "github.com/caddy-tokenbucket/ratelimit"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
)

// A limit is one way of writing a zone's limit, and the burst it means.
type limit struct {
	fields map[string]any
	burst  int64
}

var limits = []limit{
	{map[string]any{"rate": "1r/s"}, 1},
	{map[string]any{"rate": "0.5r/s", "burst": 3}, 3},
	{map[string]any{"rate": "100/10s", "burst": 1}, 1},
	{map[string]any{"rate": "1000000000r/s", "burst": 999999999999999}, 999999999999999},
	{map[string]any{"rate": "1r/d", "burst": 36000}, 36000},
	{map[string]any{"rate": "3/7s"}, 3},
	{map[string]any{"rate": "2.5r/m"}, 3},
	{map[string]any{"rate": "0.001r/s", "burst": 2}, 2},
	{map[string]any{"window": "1m", "max_events": 100}, 100},
	{map[string]any{"window": "1s", "max_events": 999999999}, 999999999},
	{map[string]any{"window": "20000h", "max_events": 999999999999999}, 999999999999999},
	{map[string]any{"window": "100ms", "max_events": 1}, 1},
	{map[string]any{"window": "24h", "max_events": 5}, 5},
}

var names = []string{
	"plain", "api:v1", "api/v1", "api@host", `a "b" é%`, "tab\there", "日本",
	`back\slash`, "semi;colon=1", "comma, space", "{brace}", "%41",
}

var headerModes = []string{"", "both", "ietf", "legacy", "off"}

// A zone of a generated config, as the test reads its headers.
type zone struct {
	name        string
	burst, cost int64
}

func TestHeadersConform(t *testing.T) {
	defer caddy.Stop()
	rng := rand.New(rand.NewPCG(1, 2))
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	var loaded, denials, checkedT int
	for i := range 150 {
		zones := map[string]zone{}
		var handler []any
		for j := range 1 + rng.IntN(4) {
			l := limits[rng.IntN(len(limits))]
			z := zone{name: fmt.Sprintf("%s #%d.%d", names[rng.IntN(len(names))], i, j), burst: l.burst, cost: 1}
			cfg := map[string]any{"name": z.name, "key": "static"}
			for k, v := range l.fields {
				cfg[k] = v
			}
			if rng.IntN(2) == 0 { // the first request takes the whole bucket
				z.cost = l.burst
				cfg["cost"] = z.cost
			}
			zones[z.name] = z
			handler = append(handler, cfg)
		}
		mode := headerModes[rng.IntN(len(headerModes))]
		h := map[string]any{"handler": "rate_limit", "zones": handler, "headers": mode, "jitter": []float64{0, 0.3, 5}[rng.IntN(3)]}
		// Each config on a port of its own: the old server's shutdown
		// must not touch the new one's connections.
		port := freePort(t)
		if err := load(port, h); err != nil {
			t.Fatalf("config %d: %v", i, err)
		}
		loaded++
		for n := range 3 {
			step := fmt.Sprintf("config %d (headers %q), request %d", i, mode, n+1)
			resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
			if err != nil {
				cfg, _ := json.Marshal(h)
				t.Fatalf("%s: %v\n%s", step, err, cfg)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			retryAfter := int64(-1)
			switch resp.StatusCode {
			case http.StatusOK:
			case http.StatusTooManyRequests:
				denials++
				retryAfter = intHeader(t, step, resp.Header, "Retry-After")
				if retryAfter < 1 {
					t.Errorf("%s: Retry-After %d", step, retryAfter)
				}
			default:
				t.Fatalf("%s: status %d", step, resp.StatusCode)
			}
			if mode != "ietf" && mode != "off" {
				for _, name := range []string{"X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset"} {
					intHeader(t, step, resp.Header, name)
				}
			}
			if mode != "legacy" && mode != "off" {
				checkPolicy(t, step, resp.Header, zones)
				checkedT += checkRateLimit(t, step, resp.Header, zones, retryAfter)
			} else if resp.Header.Get("RateLimit") != "" || resp.Header.Get("RateLimit-Policy") != "" {
				t.Errorf("%s: RateLimit headers in mode %q", step, mode)
			}
		}
	}
	t.Logf("%d configs, %d denials, %d refusing zones whose t was checked against Retry-After", loaded, denials, checkedT)
	if denials < 100 || checkedT < 50 {
		t.Errorf("too few denials (%d) or checked refusals (%d) to say much", denials, checkedT)
	}
}

// members parses a header as an RFC 9651 List of Items whose values are
// zone names, and returns them by zone.
func members(t *testing.T, step string, hdr http.Header, field string, zones map[string]zone) map[string]*httpsfv.Params {
	t.Helper()
	list, err := httpsfv.UnmarshalList(hdr.Values(field))
	if err != nil {
		t.Errorf("%s: %s %q: %v", step, field, hdr.Values(field), err)
		return nil
	}
	out := map[string]*httpsfv.Params{}
	for _, m := range list {
		item, ok := m.(httpsfv.Item)
		s, isString := item.Value.(string)
		if !ok || !isString {
			t.Errorf("%s: %s member %v is not a String item", step, field, m)
			continue
		}
		name, err := url.PathUnescape(s) // non-printable bytes and '%' are percent-encoded
		if _, known := zones[name]; err != nil || !known {
			t.Errorf("%s: %s names %q, which is no zone", step, field, s)
			continue
		}
		out[name] = item.Params
	}
	if len(out) != len(zones) {
		t.Errorf("%s: %s has %d zones, want %d: %q", step, field, len(out), len(zones), hdr.Values(field))
	}
	return out
}

func checkPolicy(t *testing.T, step string, hdr http.Header, zones map[string]zone) {
	for name, p := range members(t, step, hdr, "RateLimit-Policy", zones) {
		if q := param(t, step, p, "q"); q != zones[name].burst {
			t.Errorf("%s: zone %q: q=%d, want the burst, %d", step, name, q, zones[name].burst)
		}
		if w := param(t, step, p, "w"); w < 0 {
			t.Errorf("%s: zone %q: w=%d", step, name, w)
		}
	}
}

// checkRateLimit checks the RateLimit header and, on a 429 (retryAfter
// >= 0), that each zone that refused has t <= Retry-After. It returns how
// many refusing zones it checked.
func checkRateLimit(t *testing.T, step string, hdr http.Header, zones map[string]zone, retryAfter int64) int {
	checked := 0
	for name, p := range members(t, step, hdr, "RateLimit", zones) {
		r, tt := param(t, step, p, "r"), param(t, step, p, "t")
		z := zones[name]
		if r < 0 || r > z.burst || tt < 0 {
			t.Errorf("%s: zone %q: r=%d t=%d with burst %d", step, name, r, tt, z.burst)
		}
		if retryAfter >= 0 && r < z.cost {
			checked++
			if tt > retryAfter {
				t.Errorf("%s: zone %q refused with t=%d, later than Retry-After %d", step, name, tt, retryAfter)
			}
		}
	}
	if retryAfter >= 0 && checked == 0 {
		t.Errorf("%s: a 429 whose RateLimit shows no zone short of tokens: %q", step, hdr.Values("RateLimit"))
	}
	return checked
}

// param is an Integer parameter of an item.
func param(t *testing.T, step string, p *httpsfv.Params, name string) int64 {
	t.Helper()
	v, ok := p.Get(name)
	n, isInt := v.(int64)
	if !ok || !isInt {
		t.Errorf("%s: parameter %s is %v, want an Integer", step, name, v)
		return -1
	}
	return n
}

// intHeader parses a header as an RFC 9651 Integer item without
// parameters, as Retry-After's delay-seconds and X-RateLimit-* are.
func intHeader(t *testing.T, step string, hdr http.Header, name string) int64 {
	t.Helper()
	item, err := httpsfv.UnmarshalItem(hdr.Values(name))
	n, ok := item.Value.(int64)
	if err != nil || !ok || len(item.Params.Names()) > 0 {
		t.Errorf("%s: %s %q is not an Integer: %v", step, name, hdr.Values(name), err)
		return -1
	}
	if s := strconv.FormatInt(n, 10); s != hdr.Get(name) {
		t.Errorf("%s: %s %q is not plain digits", step, name, hdr.Get(name))
	}
	return n
}

// load runs one handler, then a 200 "ok", on 127.0.0.1:port.
func load(port int, handler map[string]any) error {
	cfg, err := json.Marshal(map[string]any{
		"admin":   map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
		"apps": map[string]any{"http": map[string]any{
			"grace_period": "1s",
			"servers": map[string]any{"conformance": map[string]any{
				"listen":          []string{fmt.Sprintf("127.0.0.1:%d", port)},
				"automatic_https": map[string]any{"disable": true},
				"routes":          []any{map[string]any{"handle": []any{handler, map[string]any{"handler": "static_response", "body": "ok"}}}},
			}},
		}},
	})
	if err != nil {
		return err
	}
	return caddy.Load(cfg, true)
}

func freePort(t *testing.T) int { return redistest.FreePort(t, 0) }

// A zone with a rate and concurrency has two policies of its name: the
// rate's, in requests (the draft's default unit), and the slots', whose
// quota unit is concurrent requests (qu, registered since draft -08), so
// that no client reads a limit on requests in flight as a request quota.
// Its RateLimit item counts the slots free, with no reset.
func TestConcurrencyPolicyConforms(t *testing.T) {
	defer caddy.Stop()
	port := freePort(t)
	h := map[string]any{"handler": "rate_limit", "headers": "ietf", "zones": []any{
		map[string]any{"name": "api", "key": "static", "rate": "10r/m", "concurrency": 3},
		map[string]any{"name": "slots", "key": "static", "concurrency": 2},
	}}
	if err := load(port, h); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	policies, err := httpsfv.UnmarshalList(resp.Header.Values("RateLimit-Policy"))
	if err != nil {
		t.Fatalf("RateLimit-Policy %q: %v", resp.Header.Values("RateLimit-Policy"), err)
	}
	items, err := httpsfv.UnmarshalList(resp.Header.Values("RateLimit"))
	if err != nil {
		t.Fatalf("RateLimit %q: %v", resp.Header.Values("RateLimit"), err)
	}
	// name, q, qu ("" for none), w (-1 for none), in the header's order;
	// then each RateLimit item's name, r and whether it has t.
	var got []string
	for _, m := range policies {
		item := m.(httpsfv.Item)
		q, _ := item.Params.Get("q")
		qu, _ := item.Params.Get("qu")
		w, hasW := item.Params.Get("w")
		got = append(got, fmt.Sprintf("%v q=%v qu=%v w=%v/%v", item.Value, q, qu, w, hasW))
	}
	for _, m := range items {
		item := m.(httpsfv.Item)
		r, _ := item.Params.Get("r")
		_, hasT := item.Params.Get("t")
		got = append(got, fmt.Sprintf("%v r=%v t=%v", item.Value, r, hasT))
	}
	want := []string{
		"api q=10 qu=<nil> w=60/true",
		"api q=3 qu=concurrent-requests w=<nil>/false",
		"slots q=2 qu=concurrent-requests w=<nil>/false",
		"api r=9 t=true",
		"api r=2 t=false",
		"slots r=1 t=false",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the policies and items read\n%q\nwant\n%q", got, want)
	}
}
