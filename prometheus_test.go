// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// The alerting rules and the Grafana dashboard of docs/prometheus are
// checked against what the plugin really exports: a real Prometheus
// scrapes a real Caddy under a little load, and every query of the
// dashboard and every alert of the rules must return series. A metric or
// a label renamed in metrics.go fails here, not on an operator's screen.
const (
	alertsFile     = "docs/prometheus/alerts.yml"
	alertsTestFile = "docs/prometheus/alerts_test.yml"
	dashboardFile  = "docs/prometheus/dashboard.json"
)

// requirePrometheus skips the test, loudly, when Prometheus is missing,
// and fails it in CI, where it must run.
func requirePrometheus(t *testing.T) {
	t.Helper()
	for _, bin := range []string{"prometheus", "promtool"} {
		if _, err := exec.LookPath(bin); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s not found: CI must run the Prometheus tests (apt-get install prometheus)", bin)
			}
			t.Skipf("PROMETHEUS TESTS SKIPPED: %s not found in PATH (apt-get install prometheus)", bin)
		}
	}
}

// The rules are valid, and their unit tests on synthetic series pass.
func TestPrometheusRules(t *testing.T) {
	requirePrometheus(t)
	for _, args := range [][]string{{"check", "rules", alertsFile}, {"test", "rules", alertsTestFile}} {
		out, err := exec.Command("promtool", args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "SUCCESS") {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// promSites are the zones the dashboard shows, each made to move its
// metrics: a local zone with a ban and a tiny max_keys, a Redis zone, a
// zone with count and a zone with delay.
func promSites(redisAddr string) string {
	return fmt.Sprintf(`http://localhost {
	handle /local {
		rate_limit {
			zone prom_local {
				rate 1r/m
				ban 1h
			}
			store local {
				max_keys 4
			}
		}
		respond "ok"
	}
	handle /redis {
		rate_limit {
			zone prom_redis {
				rate 1r/m
			}
			store redis {
				address %s
				timeout 5s
			}
		}
		respond "ok"
	}
	handle /count {
		rate_limit {
			zone prom_count {
				rate 1r/m
				burst 5
				count {
					status 401
				}
			}
		}
		respond "ok"
	}
	handle /delay {
		rate_limit {
			zone prom_delay {
				rate 20r/s
				burst 1
				delay 1s
			}
		}
		respond "ok"
	}
}
`, redisAddr)
}

// promZones is what the dashboard's zone variable stands for in the
// test: all its zones, as Grafana writes a multi-value selection.
const promZones = "prom_local|prom_redis|prom_count|prom_delay"

func TestPrometheusDashboardAndAlerts(t *testing.T) {
	requirePrometheus(t)
	r := startRedis(t)
	tester := startCaddy(t, opsGlobal, promSites(r.Addr()))
	p := startPrometheus(t, adminAddr)
	// The load comes after a first scrape, so that every counter rises
	// within what Prometheus has seen, and rates are above 0.
	waitFor(t, 30*time.Second, "a first scrape of Caddy", func() bool {
		return len(p.query(t, `caddy_rate_limit_requests_total{zone="prom_local"}`)) > 0
	})
	promLoad(t, tester, r)
	waitFor(t, 30*time.Second, "Prometheus to see the load", func() bool {
		return len(p.query(t, `caddy_rate_limit_circuit_open > 0`)) > 0 &&
			len(p.query(t, `caddy_rate_limit_evictions_total{zone="prom_local"} > 0`)) > 0 &&
			len(p.query(t, `caddy_rate_limit_delayed_total{zone="prom_delay", result="served"} > 0`)) > 0
	})
	t.Run("dashboard", func(t *testing.T) { checkDashboard(t, p) })
	t.Run("alerts", func(t *testing.T) { checkAlerts(t, p) })
}

// promLoad puts a little of everything through the zones: allowed and
// denied requests, a ban, evictions, a refund, a delay, over-limit cache
// hits, and store errors until the Redis breaker opens.
func promLoad(t *testing.T, tester *caddytest.Tester, r *redisServer) {
	get(t, tester, "/local", 200, "ok", from("10.8.0.1")...)
	get(t, tester, "/local", 429, "", from("10.8.0.1")...) // starts a ban
	for i := range 6 {                                     // max_keys 4: evicts
		get(t, tester, "/local", 200, "ok", from(fmt.Sprintf("10.8.1.%d", i))...)
	}
	get(t, tester, "/count", 200, "ok", from("10.8.0.3")...) // 200 is not counted: a refund
	get(t, tester, "/delay", 200, "ok", from("10.8.0.4")...)
	get(t, tester, "/delay", 200, "ok", from("10.8.0.4")...) // waits for its token
	for _, want := range []int{200, 429, 429} {              // the second 429 from the cache
		get(t, tester, "/redis", want, body(want), from("10.8.0.2")...)
	}
	r.Kill() // fail_mode local decides; three failures open the breaker
	for i := range 4 {
		get(t, tester, "/redis", 200, "ok", from(fmt.Sprintf("10.8.2.%d", i))...)
	}
}

// checkDashboard evaluates every query of the dashboard, and of its
// template variables, with the variables set to the test's values.
func checkDashboard(t *testing.T, p *promServer) {
	var d dashboard
	if err := json.Unmarshal(readFile(t, dashboardFile), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	vars := map[string]string{"$zone": promZones, "$instance": adminAddr, "$__rate_interval": "1m"}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		want := map[string]string{"zone": "prom_local", "instance": adminAddr}[v.Name]
		if got := p.labelValues(t, expand(t, v.Query, vars)); !slices.Contains(got, want) {
			t.Errorf("variable %s: %s gives %v, want %q among them", v.Name, v.Query, got, want)
		}
	}
	panels := d.allPanels()
	if len(panels) < 10 {
		t.Fatalf("%s: %d panels", dashboardFile, len(panels))
	}
	for _, panel := range panels {
		if panel.Type != "row" && (panel.Datasource.UID != "${datasource}" || len(panel.Targets) == 0) {
			t.Errorf("panel %q: datasource %q and %d queries, want ${datasource} and some", panel.Title, panel.Datasource.UID, len(panel.Targets))
		}
		for _, target := range panel.Targets {
			what := fmt.Sprintf("panel %q, query %s", panel.Title, target.RefID)
			result := p.query(t, expand(t, target.Expr, vars))
			if len(result) == 0 {
				t.Errorf("%s returns no series: %s", what, target.Expr)
			}
			wantLabels(t, what, result, legendLabels.FindAllStringSubmatch(target.Legend, -1))
		}
	}
}

// checkAlerts evaluates every alert of the rules as Prometheus loaded
// them. An alert's expression is a condition that holds only when
// something is wrong, so it is evaluated with each comparison made a
// bool comparison (`x > bool 0.1`), which keeps every series it compares:
// each metric, label and label value the alert reads must be there, and
// the labels its annotations print too. Prometheus must also have
// evaluated each rule without error, and the four alerts the load
// provokes must be pending (or firing).
func checkAlerts(t *testing.T, p *promServer) {
	rules := p.rules(t)
	if len(rules) < 5 {
		t.Fatalf("Prometheus loaded %d alerting rules from %s", len(rules), alertsFile)
	}
	for _, rule := range rules {
		if rule.Health != "ok" || rule.LastError != "" {
			t.Errorf("%s: health %s: %s", rule.Name, rule.Health, rule.LastError)
		}
		expr := comparisonsAsBool(rule.Query)
		result := p.query(t, expr)
		if len(result) == 0 {
			t.Errorf("%s returns no series: %s", rule.Name, expr)
		}
		for _, text := range rule.Annotations {
			wantLabels(t, rule.Name, result, annotationLabels.FindAllStringSubmatch(text, -1))
		}
	}
	provoked := []string{"RateLimitStoreErrors", "RateLimitCircuitOpen", "RateLimitZoneNearMaxKeys", "RateLimitZoneEvicting"}
	waitFor(t, 30*time.Second, fmt.Sprintf("alerts %v", provoked), func() bool {
		active := p.activeAlerts(t)
		return !slices.ContainsFunc(provoked, func(name string) bool { return !active[name] })
	})
}

var (
	legendLabels     = regexp.MustCompile(`\{\{\s*(\w+)\s*\}\}`)
	annotationLabels = regexp.MustCompile(`\$labels\.(\w+)`)
)

// wantLabels checks that every series has the labels a legend or an
// annotation prints.
func wantLabels(t *testing.T, what string, result []promSeries, labels [][]string) {
	t.Helper()
	for _, l := range labels {
		for _, s := range result {
			if _, ok := s.Metric[l[1]]; !ok {
				t.Errorf("%s: series %v lacks the label %s it prints", what, s.Metric, l[1])
				break
			}
		}
	}
}

// expand sets a dashboard query's variables, and fails on one it does
// not know.
func expand(t *testing.T, expr string, vars map[string]string) string {
	t.Helper()
	for k, v := range vars {
		expr = strings.ReplaceAll(expr, k, v)
	}
	if strings.Contains(expr, "$") {
		t.Errorf("query %q has a variable the test does not set", expr)
	}
	return expr
}

// comparisonsAsBool turns each comparison of a PromQL expression (outside
// label matchers and strings) into its bool form.
func comparisonsAsBool(expr string) string {
	var b strings.Builder
	depth, quoted := 0, false
	for i := 0; i < len(expr); i++ {
		c := expr[i]
		switch {
		case quoted && c == '\\':
			b.WriteByte(c)
			i++
			c = expr[i]
		case quoted:
			quoted = c != '"'
		case c == '"':
			quoted = true
		case c == '{':
			depth++
		case c == '}':
			depth--
		case depth == 0 && strings.IndexByte("<>=!", c) >= 0:
			b.WriteByte(c)
			if i+1 < len(expr) && expr[i+1] == '=' {
				b.WriteByte('=')
				i++
			}
			b.WriteString(" bool")
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

func TestComparisonsAsBool(t *testing.T) {
	for in, want := range map[string]string{
		`a{x!="y",z=~"<>"} > 0.9`:             `a{x!="y",z=~"<>"} > bool 0.9`,
		`(a >= 1) < 3 * b and c{s="\""} == 1`: `(a >= bool 1) < bool 3 * b and c{s="\""} == bool 1`,
		`a != b`:                              `a != bool b`,
		`rate(a[5m])`:                         `rate(a[5m])`,
	} {
		if got := comparisonsAsBool(in); got != want {
			t.Errorf("comparisonsAsBool(%s) = %s, want %s", in, got, want)
		}
	}
}

// A dashboard is what the test reads of a Grafana dashboard's JSON.
type dashboard struct {
	Panels     []dashboardPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query string `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	Title      string `json:"title"`
	Type       string `json:"type"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID  string `json:"refId"`
		Expr   string `json:"expr"`
		Legend string `json:"legendFormat"`
	} `json:"targets"`
	Panels []dashboardPanel `json:"panels"` // a collapsed row's
}

// allPanels is the dashboard's panels, those in collapsed rows too.
func (d *dashboard) allPanels() []dashboardPanel {
	var all []dashboardPanel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...)
	}
	return all
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A promServer is a prometheus process of a test.
type promServer struct {
	addr string
	out  *bytes.Buffer
}

// startPrometheus starts a Prometheus on a free port, keeping its data
// in a temporary directory, that scrapes target's /metrics every second
// and evaluates the alerting rules every second. It is killed when the
// test ends.
func startPrometheus(t *testing.T, target string) *promServer {
	t.Helper()
	rules, err := filepath.Abs(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	config := writeFile(t, dir, "prometheus.yml", fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - %q
scrape_configs:
  - job_name: caddy
    static_configs:
      - targets: [%q]
`, rules, target))
	p := &promServer{addr: "127.0.0.1:" + strconv.Itoa(freePort(t, 0)), out: new(bytes.Buffer)}
	cmd := exec.Command("prometheus", "--config.file="+config, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+p.addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = p.out, p.out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting prometheus: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus output:\n%s", p.out)
		}
	})
	waitFor(t, 30*time.Second, "prometheus to be ready", func() bool {
		resp, err := http.Get("http://" + p.addr + "/-/ready")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	})
	return p
}

// A promSeries is a series of an instant query's result.
type promSeries struct {
	Metric map[string]string `json:"metric"`
}

// api GETs a path of Prometheus's HTTP API and decodes its data into v.
func (p *promServer) api(t *testing.T, path string, v any) {
	t.Helper()
	resp, err := http.Get("http://" + p.addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	if answer.Status != "success" {
		t.Fatalf("GET %s: %s", path, answer.Error)
	}
	if err := json.Unmarshal(answer.Data, v); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// query evaluates expr now, and returns the series of its vector.
func (p *promServer) query(t *testing.T, expr string) []promSeries {
	t.Helper()
	var data struct {
		ResultType string       `json:"resultType"`
		Result     []promSeries `json:"result"`
	}
	p.api(t, "/api/v1/query?query="+url.QueryEscape(expr), &data)
	if data.ResultType != "vector" {
		t.Fatalf("%s: a %s, want a vector", expr, data.ResultType)
	}
	return data.Result
}

// labelValues is what a Grafana label_values(<selector>, <label>)
// variable query lists.
func (p *promServer) labelValues(t *testing.T, variable string) []string {
	t.Helper()
	m := regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`).FindStringSubmatch(variable)
	if m == nil {
		t.Fatalf("variable query %q: want label_values(<selector>, <label>)", variable)
	}
	var values []string
	p.api(t, "/api/v1/label/"+m[2]+"/values?match[]="+url.QueryEscape(m[1]), &values)
	return values
}

// A promRule is an alerting rule as Prometheus loaded it.
type promRule struct {
	Name        string            `json:"name"`
	Query       string            `json:"query"`
	Type        string            `json:"type"`
	Health      string            `json:"health"`
	LastError   string            `json:"lastError"`
	Annotations map[string]string `json:"annotations"`
}

// rules is the alerting rules Prometheus loaded.
func (p *promServer) rules(t *testing.T) []promRule {
	t.Helper()
	var data struct {
		Groups []struct {
			Rules []promRule `json:"rules"`
		} `json:"groups"`
	}
	p.api(t, "/api/v1/rules?type=alert", &data)
	var rules []promRule
	for _, g := range data.Groups {
		rules = append(rules, g.Rules...)
	}
	return rules
}

// activeAlerts is the names of the alerts pending or firing.
func (p *promServer) activeAlerts(t *testing.T) map[string]bool {
	t.Helper()
	var data struct {
		Alerts []struct {
			Labels map[string]string `json:"labels"`
		} `json:"alerts"`
	}
	p.api(t, "/api/v1/alerts", &data)
	active := make(map[string]bool)
	for _, a := range data.Alerts {
		active[a.Labels["alertname"]] = true
	}
	return active
}
