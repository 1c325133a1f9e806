// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"math"
	"net/http"
	"slices"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// runResult is one run of a scenario behind one limiter.
type runResult struct {
	start   time.Time
	reqs    []request
	samples []sample
	work    []work
	M       measures
}

// measures are a run's figures. The window is from the scenario's warm
// up to its end, or to the change it makes (load falling, upstream
// slowing).
type measures struct {
	P50, P99 float64 // ms: admitted (200) responses that ended in the window
	Goodput  float64 // admitted per second in the window, over the upstream's capacity
	Refused  float64 // the share of responses in the window that were refusals (503, 429)
	Limit    float64 // the adaptive limit's median in the window; 0 without one
	// The upstream's own time: how long a request held a worker on
	// average in the window (its service time and the scheduler's
	// delays), in ms; and the admitted requests per second over the
	// capacity that time gives.
	Own, GoodputOwn float64
	// After the load falls: the share of refusals among the requests sent
	// from a second after the fall, and the refusals in that second, while
	// the requests of the clients that left still hold their places.
	RefusedAfter      float64 `json:",omitempty"`
	RefusedTransition float64 `json:",omitempty"`
	// After the upstream slows: the seconds until every later one-second
	// window's admitted p99 is under 3× the new service time (-1: never),
	// and the admitted p99 and goodput from 3 s after the change on.
	Recovery     float64 `json:",omitempty"`
	P99After     float64 `json:",omitempty"`
	GoodputAfter float64 `json:",omitempty"`
	OwnAfter     float64 `json:",omitempty"`
	// With critical clients: the share of their responses in the window
	// that were refusals, their admitted p50 and p95 (ms), and the share
	// of the other clients' responses that were refusals.
	CriticalRefused float64 `json:",omitempty"`
	CriticalP50     float64 `json:",omitempty"`
	CriticalP95     float64 `json:",omitempty"`
	OthersRefused   float64 `json:",omitempty"`
}

func (r *runResult) measure(s scenario) {
	end := s.load.length
	if s.load.fallAt > 0 {
		end = s.load.fallAt
	}
	if s.SlowAt > 0 {
		end = s.SlowAt
	}
	lat := r.admitted(s.Warm, end)
	r.M = measures{P50: ms(benchkit.Quantile(lat, .5)), P99: ms(benchkit.Quantile(lat, .99)),
		Goodput: float64(len(lat)) / (end - s.Warm).Seconds() / s.capacity(),
		Refused: r.refused(s.Warm, end), Limit: r.medianLimit(s.Warm, end), Own: r.own(s.Warm, end)}
	r.M.GoodputOwn = float64(len(lat)) / (end - s.Warm).Seconds() / (float64(s.Workers) / r.M.Own * 1000)
	if s.load.fallAt > 0 {
		r.refusedAfterFall(s.load.fallAt)
	}
	if s.load.critical > 0 {
		critical := r.admittedOf(true, s.Warm, end)
		r.M.CriticalP50, r.M.CriticalP95 = ms(benchkit.Quantile(critical, .5)), ms(benchkit.Quantile(critical, .95))
		r.M.CriticalRefused, r.M.OthersRefused = r.refusedOf(true, s.Warm, end), r.refusedOf(false, s.Warm, end)
	}
	if s.SlowAt > 0 {
		after := r.admitted(s.SlowAt+3*time.Second, s.load.length)
		r.M.P99After = ms(benchkit.Quantile(after, .99))
		r.M.GoodputAfter = float64(len(after)) / (s.load.length - s.SlowAt - 3*time.Second).Seconds() / (float64(s.Workers) / s.SlowTo.Seconds())
		r.M.Recovery = r.recovery(s.SlowAt, s.load.length, 3*s.SlowTo)
		r.M.OwnAfter = r.own(s.SlowAt+3*time.Second, s.load.length)
	}
}

func refusal(status int) bool {
	return status == http.StatusServiceUnavailable || status == http.StatusTooManyRequests
}

// admitted are the latencies of the 200s that ended in [from, to), sorted.
func (r *runResult) admitted(from, to time.Duration) []time.Duration {
	return r.admittedWhere(func(request) bool { return true }, from, to)
}

// admittedOf is admitted, of the critical clients' requests or of the
// others'.
func (r *runResult) admittedOf(critical bool, from, to time.Duration) []time.Duration {
	return r.admittedWhere(func(q request) bool { return q.critical == critical }, from, to)
}

func (r *runResult) admittedWhere(of func(request) bool, from, to time.Duration) []time.Duration {
	var out []time.Duration
	for _, q := range r.reqs {
		if q.status == http.StatusOK && q.done >= from && q.done < to && of(q) {
			out = append(out, q.latency())
		}
	}
	slices.Sort(out)
	return out
}

// refused is the share of refusals among the responses that ended in
// [from, to).
func (r *runResult) refused(from, to time.Duration) float64 {
	return r.refusedWhere(func(request) bool { return true }, from, to)
}

// refusedOf is refused, among the critical clients' responses or the
// others'.
func (r *runResult) refusedOf(critical bool, from, to time.Duration) float64 {
	return r.refusedWhere(func(q request) bool { return q.critical == critical }, from, to)
}

func (r *runResult) refusedWhere(of func(request) bool, from, to time.Duration) float64 {
	all, refused := 0, 0
	for _, q := range r.reqs {
		if q.status != 0 && q.done >= from && q.done < to && of(q) {
			all++
			if refusal(q.status) {
				refused++
			}
		}
	}
	return float64(refused) / float64(max(all, 1))
}

// own is the mean time a request held one of the upstream's workers, of
// those that ended in [from, to), in ms.
func (r *runResult) own(from, to time.Duration) float64 {
	var sum time.Duration
	n := 0
	for _, w := range r.work {
		if at := w.end.Sub(r.start); at >= from && at < to {
			sum += w.took
			n++
		}
	}
	return ms(sum) / float64(max(n, 1))
}

// medianLimit is the adaptive limit's median in [from, to), 0 without one.
func (r *runResult) medianLimit(from, to time.Duration) float64 {
	var ls []float64
	for _, s := range r.samples {
		if s.at >= from && s.at < to {
			ls = append(ls, s.limit)
		}
	}
	if len(ls) == 0 {
		return 0
	}
	return benchkit.Median(ls)
}

// refusedAfterFall sets the share of refusals among the requests sent
// from a second after the load fell at at, and the refusals in that
// second, while the requests of the clients that left finish.
func (r *runResult) refusedAfterFall(at time.Duration) {
	sent, refused := 0, 0
	for _, q := range r.reqs {
		switch {
		case q.sent < at:
		case q.sent < at+time.Second:
			if refusal(q.status) {
				r.M.RefusedTransition++
			}
		default:
			sent++
			if refusal(q.status) {
				refused++
			}
		}
	}
	r.M.RefusedAfter = float64(refused) / float64(max(sent, 1))
}

// recovery is the time from at until the end of the last one-second
// window (in steps of 250ms, up to end) whose admitted p99 is over bound;
// 0 when none is.
func (r *runResult) recovery(at, end, bound time.Duration) float64 {
	last := at
	for t := at; t+time.Second <= end; t += 250 * time.Millisecond {
		if benchkit.Quantile(r.admitted(t, t+time.Second), .99) > bound {
			last = t + time.Second
		}
	}
	if last+time.Second > end {
		return -1
	}
	return (last - at).Seconds()
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// scenarioResult holds a scenario's runs, by limiter.
type scenarioResult struct {
	scenario
	Runs map[string][]*runResult
}

func (sr *scenarioResult) add(limiter string, r *runResult) {
	if sr.Runs == nil {
		sr.Runs = make(map[string][]*runResult)
	}
	sr.Runs[limiter] = append(sr.Runs[limiter], r)
}

// medians are the median of each measure over a limiter's rounds.
func (sr *scenarioResult) medians(limiter string) measures {
	runs := sr.Runs[limiter]
	var out measures
	dst := out.fields()
	for i := range dst {
		xs := make([]float64, len(runs))
		for j, r := range runs {
			xs[j] = *r.M.fields()[i]
		}
		*dst[i] = benchkit.Median(xs)
	}
	return out
}

// fields are the measures, each once.
func (m *measures) fields() []*float64 {
	return []*float64{&m.P50, &m.P99, &m.Goodput, &m.Refused, &m.Limit, &m.Own, &m.GoodputOwn,
		&m.RefusedAfter, &m.RefusedTransition, &m.Recovery, &m.P99After, &m.GoodputAfter, &m.OwnAfter,
		&m.CriticalRefused, &m.CriticalP50, &m.CriticalP95, &m.OthersRefused}
}

// typical is a limiter's round whose admitted p99 is the median's.
func (sr *scenarioResult) typical(limiter string) *runResult {
	runs := slices.Clone(sr.Runs[limiter])
	slices.SortFunc(runs, func(a, b *runResult) int {
		return int(math.Copysign(1, a.M.P99-b.M.P99))
	})
	return runs[len(runs)/2]
}
