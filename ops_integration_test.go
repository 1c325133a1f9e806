// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// opsSites are a local zone, a Redis zone, a dry-run zone and a zone whose
// handler exports no metrics, keyed by X-Forwarded-For. Zone names start
// with p: zones, and what they count, are shared by name.
func opsSites(p, redisAddr, body string) string {
	return fmt.Sprintf(`http://localhost:9080 {
	handle /local {
		rate_limit {
			zone %[3]s_local {
				rate 1r/m
				burst 2
			}
			store local {
				max_keys 8
			}
		}
		respond %[2]q
	}
	handle /redis {
		rate_limit {
			zone %[3]s_redis {
				rate 1r/m
				burst 2
			}
			store redis {
				address %[1]s
				timeout 100ms
			}
		}
		respond %[2]q
	}
	handle /dry {
		rate_limit {
			zone %[3]s_dry {
				rate 1r/m
				burst 1
				dry_run
			}
		}
		request_header X-Would-Deny {http.rate_limit.%[3]s_dry.would_deny}
		respond "{http.request.header.X-Would-Deny}"
	}
	handle /quiet {
		rate_limit {
			zone %[3]s_quiet {
				rate 1r/m
				burst 1
			}
			disable_metrics
		}
		respond %[2]q
	}
}
`, redisAddr, body, p)
}

const opsGlobal = `	servers {
		trusted_proxies static private_ranges 127.0.0.1/8 ::1/128
	}
`

// body is what the ops sites answer with status.
func body(status int) string {
	if status == http.StatusOK {
		return "ok"
	}
	return ""
}

// from is a request header pair that sets the client IP.
func from(ip string) []string { return []string{"X-Forwarded-For", ip} }

// scrape reads the rate_limit metrics from the admin endpoint, as a map
// from `name{labels}` to value.
func scrape(t *testing.T, tester *caddytest.Tester) map[string]float64 {
	t.Helper()
	resp, err := tester.Client.Get("http://localhost:2999/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := make(map[string]float64)
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, "caddy_rate_limit_") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		m[line[:i]] = v
	}
	return m
}

func wantMetric(t *testing.T, m map[string]float64, series string, want float64) {
	t.Helper()
	if got, ok := m[series]; !ok || got != want {
		t.Errorf("%s = %v (present %v), want %v", series, got, ok, want)
	}
}

func TestMetricsEndpoint(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, opsGlobal, opsSites("m", r.addr(), "ok"))
	// The latency histograms count every handler of the process.
	base := scrape(t, tester)
	localLatency := `caddy_rate_limit_store_latency_seconds_count{store="local"}`
	redisLatency := `caddy_rate_limit_store_latency_seconds_count{store="redis"}`

	// local: two allowed, one denied; ten more clients, so that max_keys 8
	// evicts some of the drained buckets.
	get(t, tester, "/local", 200, "ok", from("10.9.0.1")...)
	get(t, tester, "/local", 200, "ok", from("10.9.0.1")...)
	get(t, tester, "/local", 429, "", from("10.9.0.1")...)
	for i := range 10 {
		get(t, tester, "/local", 200, "ok", from(fmt.Sprintf("10.9.1.%d", i))...)
	}
	// redis: two allowed, two denied from the over-limit cache.
	for _, want := range []int{200, 200, 429, 429} {
		get(t, tester, "/redis", want, body(want), from("10.9.0.2")...)
	}
	// dry run: one allowed, two would have been denied.
	get(t, tester, "/dry", 200, "false", from("10.9.0.3")...)
	get(t, tester, "/dry", 200, "true", from("10.9.0.3")...)
	get(t, tester, "/dry", 200, "true", from("10.9.0.3")...)
	get(t, tester, "/quiet", 200, "ok", from("10.9.0.4")...)
	get(t, tester, "/quiet", 429, "", from("10.9.0.4")...)

	m := scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_local"}`, 12)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_local"}`, 1)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_redis"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_redis"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_over_limit_cache_hits_total{zone="m_redis"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_dry"}`, 1)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="dry_run_denied",zone="m_dry"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_dry"}`, 0)
	wantMetric(t, m, `caddy_rate_limit_keys{zone="m_local"}`, 8)
	wantMetric(t, m, `caddy_rate_limit_evictions_total{zone="m_local"}`, 3)
	wantMetric(t, m, `caddy_rate_limit_circuit_open`, base[`caddy_rate_limit_circuit_open`])
	wantMetric(t, m, redisLatency, base[redisLatency]+4)
	// Each decision once; /quiet exports nothing.
	wantMetric(t, m, localLatency, base[localLatency]+13+3)
	for series := range m {
		if strings.Contains(series, "m_quiet") {
			t.Errorf("%s: disable_metrics exports the zone", series)
		}
		if regexp.MustCompile(`10\.9\.|127\.0\.0\.1`).MatchString(series) {
			t.Errorf("%s: a label holds a client address", series)
		}
	}

	// Redis goes away: store errors are counted, fail_mode local decides,
	// and after three failures the circuit opens.
	r.kill()
	for _, want := range []int{200, 200, 429, 429} {
		get(t, tester, "/redis", want, body(want), from("10.9.0.5")...)
	}
	m = scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="store_error",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_store_errors_total{store="redis"}`, base[`caddy_rate_limit_store_errors_total{store="redis"}`]+4)
	wantMetric(t, m, `caddy_rate_limit_circuit_open`, base[`caddy_rate_limit_circuit_open`]+1)
	r.start()

	// A reload keeps the counters, and the metrics still show.
	reload(t, tester, opsGlobal, opsSites("m", r.addr(), "reloaded"))
	get(t, tester, "/local", 429, "", from("10.9.0.1")...)
	m = scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_local"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_redis"}`, 4)
}

// adminDo sends a request to the admin API and decodes its JSON answer.
func adminDo(t *testing.T, tester *caddytest.Tester, method, path string, wantStatus int) map[string]any {
	t.Helper()
	req, _ := http.NewRequest(method, "http://localhost:2999"+path, nil)
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
	tester := startCaddy(t, opsGlobal, opsSites("a", r.addr(), "ok"))

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
			b = adminDo(t, tester, "GET", "/rate_limit/"+tc.zone+"/2001%3Adb8%3A7%3A%3A%2F64", 200)
			if b["bucket"] != "2001:db8:7::/64" {
				t.Fatalf("escaped key: bucket %v", b)
			}

			top := adminDo(t, tester, "GET", "/rate_limit/"+tc.zone+"/top", 200)
			items := top["top"].([]any)
			first := items[0].(map[string]any)
			if len(items) != 2 || first["key"] != "2001:db8:7::/64" || first["denials"] != 5.0 {
				t.Fatalf("top %v", top)
			}

			// Reset: the flooder is served again, with a full bucket.
			b = adminDo(t, tester, "DELETE", "/rate_limit/"+tc.zone+"/2001:db8:7::1", 200)
			if b["tokens"] != 2.0 || b["full_in"] != 0.0 {
				t.Fatalf("after reset: %v", b)
			}
			get(t, tester, tc.path, 200, "ok", from("2001:db8:7::1")...)

			// Errors are JSON, with the right status.
			e := adminDo(t, tester, "GET", "/rate_limit/nope/1.2.3.4", 404)
			if !strings.Contains(fmt.Sprint(e["error"]), `unknown zone "nope"`) {
				t.Fatalf("unknown zone: %v", e)
			}
			adminDo(t, tester, "POST", "/rate_limit/"+tc.zone+"/1.2.3.4", 405)
			adminDo(t, tester, "DELETE", "/rate_limit/"+tc.zone+"/top", 405)
		})
	}

	// The Redis store's bucket is unreadable while Redis is down.
	r.kill()
	start := time.Now()
	e := adminDo(t, tester, "GET", "/rate_limit/a_redis/10.9.2.1", 502)
	if !strings.Contains(fmt.Sprint(e["error"]), "reading the bucket") || time.Since(start) > 2*time.Second {
		t.Fatalf("redis down: %v after %v", e, time.Since(start))
	}
}
