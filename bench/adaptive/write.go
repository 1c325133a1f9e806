// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// report is what a whole run writes.
type report struct {
	Name      string `json:"-"`
	Began     time.Time
	Seconds   float64
	Rounds    int
	Backoff   time.Duration
	Note      string
	Machine   machineInfo
	Scenarios []*scenarioResult
}

type machineInfo struct {
	Cores                 int
	CPU, Go, Commit       string
	LoadBefore, LoadAfter string
}

func machine() machineInfo {
	m := machineInfo{Cores: runtime.NumCPU(), Go: runtime.Version(), LoadBefore: loadavg()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output(); err == nil {
		m.Commit = strings.TrimSpace(string(out))
		if exec.Command("git", "diff", "--quiet", "HEAD", "--", "..").Run() != nil {
			m.Commit += " plus uncommitted changes"
		}
	}
	return m
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

// write writes <name>.md, <name>.json and the plots into dir.
func (rep *report) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var b strings.Builder
	rep.header(&b)
	for _, sr := range rep.Scenarios {
		file := rep.Name + "_" + sr.ID + ".png"
		if err := plotScenario(sr, filepath.Join(dir, file)); err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
		sr.section(&b, file)
	}
	if err := os.WriteFile(filepath.Join(dir, rep.Name+".md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, rep.Name+".json"), append(js, '\n'), 0o644)
}

func (rep *report) header(b *strings.Builder) {
	m := rep.Machine
	fmt.Fprintf(b, "# `concurrency adaptive` under load\n\n")
	fmt.Fprintf(b, "Written by `%s` on %s: %d rounds of each run, %.0f s in all. ", strings.TrimSpace("bench/adaptive/run.sh "+os.Getenv("ADAPTIVE_ARGS")), rep.Began.Format("2006-01-02 15:04 UTC"), rep.Rounds, rep.Seconds)
	fmt.Fprintf(b, "Machine: %d cores (%s), %s, commit %s; load average %s before, %s after.", m.Cores, m.CPU, m.Go, m.Commit, m.LoadBefore, m.LoadAfter)
	if rep.Note != "" {
		fmt.Fprintf(b, " Note: %s.", rep.Note)
	}
	fmt.Fprintf(b, "\n\nA test upstream (in the load generator's process) works on a fixed number of requests at once, each for a set time (a sleep), and queues the others first come, first served. ")
	fmt.Fprintf(b, "Caddy, built from this repository, proxies to it (`reverse_proxy`), behind `rate_limit` with one zone `key static` and `concurrency adaptive` (min 4, max 1000), or a fixed `concurrency 8`, or no limiter; in the priority scenario, also `concurrency adaptive` with `priority {header.X-Priority}` and `reserve critical 25%%`, which the critical clients' `X-Priority: critical` names. ")
	fmt.Fprintf(b, "Closed-loop clients each send a request, read the whole response, and send the next; a refused client (503 or 429) sends its next request %s; a critical client sends its next 60 ms after any answer. ", backoffWords(rep.Backoff))
	fmt.Fprintf(b, "Latency is the client's, from sending to the end of the response. Everything shares the machine's cores: the clients, the upstream and Caddy. ")
	fmt.Fprintf(b, "Each figure is the median of the rounds; the per-round values follow. The plots show the round with the median p99.\n\n")
	rep.goals(b)
}

func backoffWords(d time.Duration) string {
	if d == 0 {
		return "at once"
	}
	return "after " + d.String()
}

// goals is the table of the goals and what the runs measured.
func (rep *report) goals(b *strings.Builder) {
	find := func(id string) *scenarioResult {
		for _, sr := range rep.Scenarios {
			if sr.ID == id {
				return sr
			}
		}
		return nil
	}
	fmt.Fprintf(b, "| measure | goal | measured |\n|---|---|---|\n")
	if sr := find("8-workers"); sr != nil {
		a, n := sr.medians("adaptive"), sr.medians("no limiter")
		fmt.Fprintf(b, "| 8 workers: admitted p50, p99 | ≤ 50 ms, ≤ 150 ms | %.1f ms, %.1f ms (no limiter: %.1f ms, %.1f ms) |\n", a.P50, a.P99, n.P50, n.P99)
		fmt.Fprintf(b, "| 8 workers: goodput | ≥ 0.85 of 400/s | %.3f (%.3f of what the upstream could serve in its own time, %.1f ms) |\n", a.Goodput, a.GoodputOwn, a.Own)
	}
	if sr := find("32-workers"); sr != nil {
		a, f := sr.medians("adaptive"), sr.medians("concurrency 8")
		fmt.Fprintf(b, "| 32 workers: goodput | ≥ 0.85 of 1600/s | %.3f (%.3f of what the upstream could serve in its own time, %.1f ms; a fixed `concurrency 8`: %.3f; no limiter: %.3f) |\n",
			a.Goodput, a.GoodputOwn, a.Own, f.Goodput, sr.medians("no limiter").Goodput)
	}
	if sr := find("load-falls"); sr != nil {
		a := sr.medians("adaptive")
		fmt.Fprintf(b, "| load falls to 4 clients: shed | < 1%% | %.2f%% from 1 s after the fall (%.0f requests shed in the first second, while the requests of the clients that left finish) |\n", 100*a.RefusedAfter, a.RefusedTransition)
	}
	if sr := find("priority"); sr != nil {
		p, a := sr.medians("adaptive, reserve critical 25%"), sr.medians("adaptive")
		fmt.Fprintf(b, "| 64 clients of the lowest class, 4 critical: with `reserve critical 25%%`, critical shed; p95 | ≤ 5%%; < 100 ms | %.2f%%; %.1f ms (the lowest class: %.1f%% shed) |\n", 100*p.CriticalRefused, p.CriticalP95, 100*p.OthersRefused)
		fmt.Fprintf(b, "| the same: goodput | ≥ 0.6 of 400/s | %.3f |\n", p.Goodput)
		fmt.Fprintf(b, "| the same without classes: critical shed | like the rest | %.1f%% (the lowest class: %.1f%%) |\n", 100*a.CriticalRefused, 100*a.OthersRefused)
	}
	if sr := find("upstream-slows"); sr != nil {
		a := sr.medians("adaptive")
		fmt.Fprintf(b, "| upstream slows to 60 ms: admitted p99 back under 180 ms | within 3 s | after %.2f s; p99 %.1f ms from 3 s on, the upstream's own time %.1f ms (no limiter: %.1f ms) |\n",
			a.Recovery, a.P99After, a.OwnAfter, sr.medians("no limiter").P99After)
	}
	b.WriteString("\n")
}

// section writes a scenario's table and plot.
func (sr *scenarioResult) section(b *strings.Builder, plot string) {
	fmt.Fprintf(b, "## %s\n\n", sr.Title)
	extra := ""
	switch {
	case sr.load.fallAt > 0:
		extra = " refused from 1 s after the fall | refused in the first second |"
	case sr.SlowAt > 0:
		extra = " p99 back under 180 ms after | p99 from 3 s after | goodput from 3 s after |"
	case sr.load.critical > 0:
		extra = " critical shed | critical p50 | critical p95 | the lowest class shed |"
	}
	fmt.Fprintf(b, "| limiter | admitted p50 | admitted p99 | goodput | upstream's own time | goodput of its own capacity | refused | limit (median) |%s p99 per round |\n", extra)
	fmt.Fprintf(b, "|---|---:|---:|---:|---:|---:|---:|---:|%s---|\n", strings.Repeat("---:|", strings.Count(extra, "|")))
	for _, lim := range sr.Limiters {
		m := sr.medians(lim)
		fmt.Fprintf(b, "| %s | %.1f ms | %.1f ms | %.3f | %.1f ms | %.3f | %.1f%% | %s |", lim, m.P50, m.P99, m.Goodput, m.Own, m.GoodputOwn, 100*m.Refused, limitWords(lim, m.Limit))
		switch {
		case sr.load.fallAt > 0:
			fmt.Fprintf(b, " %.2f%% | %.0f |", 100*m.RefusedAfter, m.RefusedTransition)
		case sr.SlowAt > 0:
			fmt.Fprintf(b, " %s | %.1f ms | %.3f |", recoveryWords(m.Recovery), m.P99After, m.GoodputAfter)
		case sr.load.critical > 0:
			fmt.Fprintf(b, " %.2f%% | %.1f ms | %.1f ms | %.1f%% |", 100*m.CriticalRefused, m.CriticalP50, m.CriticalP95, 100*m.OthersRefused)
		}
		var per []string
		for _, r := range sr.Runs[lim] {
			per = append(per, fmt.Sprintf("%.1f", r.M.P99))
		}
		fmt.Fprintf(b, " %s ms |\n", strings.Join(per, ", "))
	}
	fmt.Fprintf(b, "\nMeasured from %v to %s. Goodput is admitted requests per second over the upstream's capacity (%.0f/s); the upstream's own time is how long a request held one of its workers on average (its %v sleep, and what the scheduler added on this busy machine), and the last goodput is over the capacity that time gives.\n\n![%s](%s)\n\n", sr.Warm, sr.windowEnd(), sr.capacity(), sr.Service, sr.Title, plot)
}

func (sr *scenarioResult) windowEnd() string {
	switch {
	case sr.load.fallAt > 0:
		return sr.load.fallAt.String() + " (the fall)"
	case sr.SlowAt > 0:
		return sr.SlowAt.String() + " (the slowdown)"
	}
	return sr.load.length.String()
}

func limitWords(limiter string, l float64) string {
	switch limiter {
	case "adaptive", "adaptive, reserve critical 25%":
		return fmt.Sprintf("%.0f", l)
	case "concurrency 8":
		return "8"
	}
	return "–"
}

func recoveryWords(s float64) string {
	if s < 0 {
		return "never"
	}
	return fmt.Sprintf("%.2f s", s)
}
