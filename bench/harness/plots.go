// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Colours per run of the noisy-neighbour scenario, and for "before".
var runColors = []color.Color{
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, // no limiter: red
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, // local: blue
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, // redis: green
}
var grey = color.RGBA{R: 0x80, G: 0x80, B: 0x80, A: 0xff}

func logY(p *plot.Plot, lo, hi float64) {
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = benchkit.MsTicks{}
	// Room at the top for the legend.
	p.Y.Min, p.Y.Max = lo/1.3, hi*5
}

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.Title.Padding = vg.Points(14)
	p.Legend.YOffs = -vg.Points(16)
	p.Legend.XOffs = vg.Points(6)
	p.X.Label.Text = x
	p.Y.Label.Text = y
	p.Add(plotter.NewGrid())
	return p
}

func msf(d time.Duration) float64 { return float64(d) / 1e6 }

var pctls = []struct {
	name string
	q    float64
}{{"p50", .50}, {"p75", .75}, {"p90", .90}, {"p95", .95}, {"p99", .99}, {"p99.9", .999}}

// plotPercentiles draws the well-behaved users' latency percentiles
// during the flood, per run, with the no-flood latency for reference.
func plotPercentiles(res []*noisyResult, p params, file string) error {
	runs := typical(res)
	pl := newPlot(fmt.Sprintf("Well-behaved users' latency during a %d req/s flood", p.floodRate),
		"percentile", "latency (ms, log scale)")
	names := make([]string, len(pctls))
	for i, q := range pctls {
		names[i] = q.name
	}
	pl.NominalX(names...)
	lo, hi := math.Inf(1), 0.0
	add := func(label string, lats []time.Duration, c color.Color, dashed bool) error {
		s := slices.Clone(lats)
		slices.Sort(s)
		if len(s) == 0 {
			return nil
		}
		xys := make(plotter.XYs, len(pctls))
		for i, q := range pctls {
			v := max(msf(benchkit.Quantile(s, q.q)), 0.01)
			xys[i] = plotter.XY{X: float64(i), Y: v}
			lo, hi = min(lo, v), max(hi, v)
		}
		l, sc, err := plotter.NewLinePoints(xys)
		if err != nil {
			return err
		}
		l.Color, sc.Color = c, c
		l.Width = vg.Points(2)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		sc.Shape = draw.CircleGlyph{}
		pl.Add(l, sc)
		pl.Legend.Add(label, l, sc)
		return nil
	}
	if len(runs) > 0 {
		var before []time.Duration
		for _, r := range runs {
			before = append(before, r.usersBefore(p)...)
		}
		if err := add("before the flood (all runs)", before, grey, true); err != nil {
			return err
		}
	}
	for i, r := range runs {
		if err := add(r.Name, r.usersDuring(p), runColors[i%len(runColors)], false); err != nil {
			return err
		}
	}
	logY(pl, lo, hi)
	pl.Legend.Top, pl.Legend.Left = true, true
	return pl.Save(8*vg.Inch, 5*vg.Inch, file)
}

// plotTimeline draws the users' p95 latency over time, per run.
func plotTimeline(res []*noisyResult, p params, file string) error {
	runs := typical(res)
	pl := newPlot("Well-behaved users' p95 latency as the flood starts",
		fmt.Sprintf("seconds since start (flood from %gs to %gs; %v buckets)", p.warm.Seconds(), (p.warm+p.flood).Seconds(), p.bucket),
		"p95 latency (ms, log scale)")
	lo, hi := math.Inf(1), 0.0
	end := p.warm + p.flood
	n := int(end / p.bucket)
	for i, r := range runs {
		buckets := make([][]time.Duration, n)
		for _, h := range r.users {
			if b := int(h.at / p.bucket); b >= 0 && b < n {
				buckets[b] = append(buckets[b], h.lat)
			}
		}
		var xys plotter.XYs
		for b, lats := range buckets {
			if len(lats) == 0 {
				continue
			}
			slices.Sort(lats)
			v := max(msf(benchkit.Quantile(lats, .95)), 0.01)
			lo, hi = min(lo, v), max(hi, v)
			xys = append(xys, plotter.XY{X: (float64(b) + 0.5) * p.bucket.Seconds(), Y: v})
		}
		if len(xys) == 0 {
			continue
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return err
		}
		l.Color = runColors[i%len(runColors)]
		l.Width = vg.Points(2)
		pl.Add(l)
		pl.Legend.Add(r.Name, l)
	}
	if hi == 0 {
		return nil
	}
	logY(pl, lo, hi)
	for _, t := range []time.Duration{p.warm, end} {
		l, err := plotter.NewLine(plotter.XYs{{X: t.Seconds(), Y: pl.Y.Min}, {X: t.Seconds(), Y: pl.Y.Max}})
		if err != nil {
			return err
		}
		l.Color = grey
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		pl.Add(l)
	}
	pl.X.Min, pl.X.Max = 0, end.Seconds()
	step := 1
	if end > 12*time.Second {
		step = 2
	}
	var ticks []plot.Tick
	for t := 0; t <= int(end.Seconds()); t++ {
		tick := plot.Tick{Value: float64(t)}
		if t%step == 0 {
			tick.Label = strconv.Itoa(t)
		}
		ticks = append(ticks, tick)
	}
	pl.X.Tick.Marker = plot.ConstantTicks(ticks)
	pl.Legend.Top, pl.Legend.Left = true, true
	return pl.Save(8*vg.Inch, 5*vg.Inch, file)
}

// groupedBars adds side-by-side bars, one series per entry of series,
// each bar labelled with its value.
func groupedBars(pl *plot.Plot, names []string, series []plotter.Values, format func(float64) string) error {
	w := vg.Points(40)
	for i, vals := range series {
		b, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return err
		}
		b.Color = plotutil.Color(i)
		b.LineStyle.Width = 0
		off := vg.Length(float64(i)-float64(len(series)-1)/2) * w
		b.Offset = off
		pl.Add(b)
		pl.Legend.Add(names[i], b)

		var xys plotter.XYs
		var labels []string
		for j, v := range vals {
			if v == 0 {
				continue
			}
			xys = append(xys, plotter.XY{X: float64(j), Y: v})
			labels = append(labels, format(v))
		}
		if len(xys) == 0 {
			continue
		}
		l, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: labels})
		if err != nil {
			return err
		}
		for k := range l.TextStyle {
			l.TextStyle[k].XAlign = -0.5
		}
		l.Offset = vg.Point{X: off, Y: vg.Points(3)}
		pl.Add(l)
	}
	return nil
}

// plotThroughput draws req/s relative to the baseline, allowed and denied
// paths side by side per implementation.
func plotThroughput(rs []*tpResult, file string) error {
	impls := []string{"rate_limit local", "rate_limit redis", "caddy-ratelimit v0.1.0"}
	pl := newPlot("Requests/s relative to Caddy `respond` without a limiter (wrk, same run)",
		"", "ratio to baseline (median of rounds)")
	pl.NominalX(impls...)
	top := 1.0
	var series []plotter.Values
	for _, path := range []string{"allowed", "denied"} {
		vals := make(plotter.Values, len(impls))
		for j, impl := range impls {
			for _, r := range rs {
				if r.Impl == impl && r.Path == path {
					vals[j] = r.RatioRPS
					top = max(top, r.RatioRPS)
				}
			}
		}
		series = append(series, vals)
	}
	if err := groupedBars(pl, []string{"allowed path", "denied path"}, series,
		func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }); err != nil {
		return err
	}
	one, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: 1}, {X: float64(len(impls)) - 0.5, Y: 1}})
	if err != nil {
		return err
	}
	one.Color = grey
	one.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	pl.Add(one)
	pl.X.Min, pl.X.Max = -0.6, float64(len(impls))-0.4
	pl.Y.Min, pl.Y.Max = 0, top*1.3
	pl.Legend.Top, pl.Legend.Left = true, true
	return pl.Save(8*vg.Inch, 4.5*vg.Inch, file)
}

// plotMemory draws Caddy's RSS before and after the distinct keys.
func plotMemory(ms []*memResult, keys int, file string) error {
	pl := newPlot(fmt.Sprintf("Caddy's resident memory after %s distinct keys", humanCount(float64(keys))), "", "VmRSS (MiB, after a forced GC)")
	names := make([]string, len(ms))
	idle, after := make(plotter.Values, len(ms)), make(plotter.Values, len(ms))
	top := 0.0
	for i, m := range ms {
		names[i] = m.Impl
		idle[i], after[i] = float64(m.RSSIdle)/1024, float64(m.RSSAfter)/1024
		top = max(top, after[i])
	}
	pl.NominalX(names...)
	if err := groupedBars(pl, []string{"idle", "after the keys"}, []plotter.Values{idle, after},
		func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) + " MiB" }); err != nil {
		return err
	}
	pl.X.Min, pl.X.Max = -0.6, float64(len(ms))-0.4
	pl.Y.Min, pl.Y.Max = 0, top*1.3
	pl.Legend.Top, pl.Legend.Left = true, true
	return pl.Save(7*vg.Inch, 4.5*vg.Inch, file)
}

func writePlots(rep *report, out string) ([]string, error) {
	var files []string
	save := func(name string, f func(string) error) error {
		file := filepath.Join(out, name)
		if err := f(file); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		files = append(files, name)
		return nil
	}
	if len(rep.Noisy) > 0 {
		if err := save("noisy_percentiles.png", func(f string) error { return plotPercentiles(rep.Noisy, rep.Params, f) }); err != nil {
			return nil, err
		}
		if err := save("noisy_timeline.png", func(f string) error { return plotTimeline(rep.Noisy, rep.Params, f) }); err != nil {
			return nil, err
		}
	}
	if len(rep.Throughput) > 0 {
		if err := save("throughput.png", func(f string) error { return plotThroughput(rep.Throughput, f) }); err != nil {
			return nil, err
		}
	}
	if len(rep.Memory) > 0 {
		if err := save("memory.png", func(f string) error { return plotMemory(rep.Memory, rep.Params.keys, f) }); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// typical returns each configuration's typical round.
func typical(res []*noisyResult) []*noisyRun {
	runs := make([]*noisyRun, len(res))
	for i, r := range res {
		runs[i] = r.Rounds[r.Typical]
	}
	return runs
}
