// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/topn"
	"github.com/caddyserver/caddy/v2/caddytest"
)

// opsSites are a local zone, a Redis zone, a dry-run zone and a zone whose
// handler exports no metrics, keyed by X-Forwarded-For. Zone names start
// with p: zones, and what they count, are shared by name.
func opsSites(p, redisAddr, body string) string {
	return fmt.Sprintf(`http://localhost {
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
				timeout 5s
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
	return scrapeAt(t, tester.Client, adminAddr)
}

// scrapeAt is scrape of the Caddy whose admin API listens at admin.
func scrapeAt(t *testing.T, c *http.Client, admin string) map[string]float64 {
	t.Helper()
	resp, err := c.Get("http://" + admin + "/metrics")
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
	// A zone's series are found by its name alone too, when no other zone
	// of that name has them: the limit label tells apart zones of one name.
	seen := make(map[string]int)
	for series := range m {
		seen[withoutLimit(series)]++
	}
	for series, v := range m {
		if short := withoutLimit(series); seen[short] == 1 {
			m[short] = v
		}
	}
	return m
}

// withoutLimit is s without its series' limit labels.
func withoutLimit(s string) string { return limitLabel.ReplaceAllString(s, "") }

var limitLabel = regexp.MustCompile(`limit="[^"]*",?`)

func wantMetric(t *testing.T, m map[string]float64, series string, want float64) {
	t.Helper()
	if got, ok := m[series]; !ok || got != want {
		t.Errorf("%s = %v (present %v), want %v", series, got, ok, want)
	}
}

func TestMetricsEndpoint(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, opsGlobal, opsSites("m", r.Addr(), "ok"))
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
	wantMetric(t, m, `caddy_rate_limit_max_keys{zone="m_local"}`, 8)
	// fail_mode local's buckets for the Redis zone: the default max_keys.
	wantMetric(t, m, `caddy_rate_limit_max_keys{zone="m_redis"}`, defaultMaxKeys)
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
	r.Kill()
	for _, want := range []int{200, 200, 429, 429} {
		get(t, tester, "/redis", want, body(want), from("10.9.0.5")...)
	}
	m = scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="store_error",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_redis"}`, 4)
	wantMetric(t, m, `caddy_rate_limit_store_errors_total{store="redis"}`, base[`caddy_rate_limit_store_errors_total{store="redis"}`]+4)
	wantMetric(t, m, `caddy_rate_limit_circuit_open`, base[`caddy_rate_limit_circuit_open`]+1)
	r.Start()

	// A reload keeps the counters and the buckets (10.9.1.9 has one of
	// its two tokens left), and the metrics still show.
	reload(t, tester, opsGlobal, opsSites("m", r.Addr(), "reloaded"))
	get(t, tester, "/local", 200, "reloaded", from("10.9.1.9")...)
	get(t, tester, "/local", 429, "", from("10.9.1.9")...)
	m = scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="denied",zone="m_local"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_requests_total{result="allowed",zone="m_redis"}`, 4)
}

const opsGlobal = `	servers {
		trusted_proxies static private_ranges 127.0.0.1/8 ::1/128
	}
`

// Long keys are kept short in a zone's heavy-hitter sketch, and stay
// distinct.
func TestTopKeyLong(t *testing.T) {
	long := strings.Repeat("x", 1<<20)
	top := topn.New(4, keepKey)
	top.Add(topKey(store.Key{Text: long + "a"}))
	top.Add(topKey(store.Key{Text: long + "b"}))
	top.Add(topKey(store.Key{Text: long + "a"}))
	list := top.List()
	if len(list) != 2 || list[0].Count != 2 || len(list[0].Key.Text) > topKeyMax+8 {
		t.Fatalf("long keys: %d entries, first %d long with %d", len(list), len(list[0].Key.Text), list[0].Count)
	}
}
