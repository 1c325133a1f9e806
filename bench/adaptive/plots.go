// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"image/color"
	"math"
	"os"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

var (
	colors = map[string]color.Color{
		"no limiter":                     color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
		"adaptive":                       color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
		"concurrency 8":                  color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
		"adaptive, reserve critical 25%": color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	}
	grey   = color.RGBA{R: 0x80, G: 0x80, B: 0x80, A: 0xff}
	green  = color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}
	dashed = []vg.Length{vg.Points(4), vg.Points(3)}
	dotted = []vg.Length{vg.Points(1), vg.Points(2)}
)

// plotScenario draws the adaptive limit over time above the admitted
// latency of each limiter, from their typical rounds.
func plotScenario(sr *scenarioResult, file string) error {
	top, err := limitPlot(sr)
	if err != nil {
		return err
	}
	bottom, err := latencyPlot(sr)
	if err != nil {
		return err
	}
	img := vgimg.New(9*vg.Inch, 8*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(12), PadY: vg.Points(18)}
	canvases := plot.Align([][]*plot.Plot{{top}, {bottom}}, tiles, dc)
	top.Draw(canvases[0][0])
	bottom.Draw(canvases[1][0])
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func newPlot(title, y string, sr *scenarioResult) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "seconds since start"
	p.Y.Label.Text = y
	p.X.Min, p.X.Max = 0, sr.load.length.Seconds()
	p.Add(plotter.NewGrid())
	p.Legend.Top, p.Legend.Left = true, true
	return p
}

// line adds a line of xys in c, dashed when dashes are given.
func line(p *plot.Plot, label string, xys plotter.XYs, c color.Color, width float64, dashes []vg.Length) error {
	if len(xys) == 0 {
		return nil
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		return err
	}
	l.Color, l.Width, l.Dashes = c, vg.Points(width), dashes
	p.Add(l)
	if label != "" {
		p.Legend.Add(label, l)
	}
	return nil
}

// limitPlot draws the adaptive limit and the requests in flight under it,
// with the upstream's workers for reference.
func limitPlot(sr *scenarioResult) (*plot.Plot, error) {
	p := newPlot(sr.Title+": the limit", "requests in flight", sr)
	end := sr.load.length.Seconds()
	hi := float64(sr.Workers)
	if err := line(p, "upstream workers", plotter.XYs{{X: 0, Y: hi}, {X: end, Y: hi}}, grey, 1, dashed); err != nil {
		return nil, err
	}
	if slices.Contains(sr.Limiters, "concurrency 8") {
		if err := line(p, "concurrency 8", plotter.XYs{{X: 0, Y: 8}, {X: end, Y: 8}}, colors["concurrency 8"], 1.5, nil); err != nil {
			return nil, err
		}
	}
	if lim := adaptiveOf(sr); lim != "" {
		r := sr.typical(lim)
		var limit, inFlight plotter.XYs
		for _, s := range r.samples {
			limit = append(limit, plotter.XY{X: s.at.Seconds(), Y: s.limit})
			inFlight = append(inFlight, plotter.XY{X: s.at.Seconds(), Y: s.inFlight})
			hi = max(hi, s.limit, s.inFlight)
		}
		if err := line(p, lim+": the limit", limit, colors[lim], 2, nil); err != nil {
			return nil, err
		}
		if err := line(p, "in flight (sampled every 100 ms)", inFlight, green, 1, dotted); err != nil {
			return nil, err
		}
	}
	p.Y.Min, p.Y.Max = 0, hi*1.35
	return p, events(p, sr, 0, hi*1.35)
}

// latencyPlot draws each limiter's admitted p50 and p99 per half second,
// and the upstream's service time.
func latencyPlot(sr *scenarioResult) (*plot.Plot, error) {
	p := newPlot(sr.Title+": admitted latency per 0.5 s", "latency (ms, log scale)", sr)
	p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, benchkit.MsTicks{}
	lo, hi := ms(sr.Service), ms(sr.Service)
	for _, lim := range sr.Limiters {
		p50, p99 := buckets(sr.typical(lim), sr.load.length, 500*time.Millisecond, func(request) bool { return true })
		for _, xy := range append(p50, p99...) {
			lo, hi = min(lo, xy.Y), max(hi, xy.Y)
		}
		if err := line(p, lim+" p99", p99, colors[lim], 2, nil); err != nil {
			return nil, err
		}
		if err := line(p, lim+" p50", p50, colors[lim], 1, dashed); err != nil {
			return nil, err
		}
		if sr.load.critical == 0 {
			continue
		}
		_, critical := buckets(sr.typical(lim), sr.load.length, 500*time.Millisecond, func(q request) bool { return q.critical })
		if err := line(p, lim+": critical p99", critical, colors[lim], 1, dotted); err != nil {
			return nil, err
		}
	}
	service := plotter.XYs{{X: 0, Y: ms(sr.Service)}, {X: sr.load.length.Seconds(), Y: ms(sr.Service)}}
	if sr.SlowAt > 0 {
		at := sr.SlowAt.Seconds()
		service = plotter.XYs{{X: 0, Y: ms(sr.Service)}, {X: at, Y: ms(sr.Service)}, {X: at, Y: ms(sr.SlowTo)}, {X: sr.load.length.Seconds(), Y: ms(sr.SlowTo)}}
		hi = max(hi, 3*ms(sr.SlowTo))
		bound := plotter.XYs{{X: at, Y: 3 * ms(sr.SlowTo)}, {X: sr.load.length.Seconds(), Y: 3 * ms(sr.SlowTo)}}
		if err := line(p, "3× the upstream's time", bound, grey, 1, dotted); err != nil {
			return nil, err
		}
	}
	if err := line(p, "upstream's service time", service, grey, 1, dashed); err != nil {
		return nil, err
	}
	if lim := adaptiveOf(sr); lim != "" {
		var seen, noLoad plotter.XYs
		for _, s := range sr.typical(lim).samples {
			if s.latency > 0 {
				seen = append(seen, plotter.XY{X: s.at.Seconds(), Y: 1000 * s.latency})
				noLoad = append(noLoad, plotter.XY{X: s.at.Seconds(), Y: 1000 * s.noLoad})
			}
		}
		if err := line(p, lim+": the median it saw", seen, green, 1, nil); err != nil {
			return nil, err
		}
		if err := line(p, lim+": its no-load latency", noLoad, green, 1, dotted); err != nil {
			return nil, err
		}
	}
	p.Y.Min, p.Y.Max = lo/1.5, hi*4
	return p, events(p, sr, p.Y.Min, p.Y.Max)
}

// adaptiveOf is the adaptive limiter whose limit a scenario's plots
// show: the one with classes when there is one; "" for none.
func adaptiveOf(sr *scenarioResult) string {
	for _, lim := range []string{"adaptive, reserve critical 25%", "adaptive"} {
		if _, ok := sr.Runs[lim]; ok {
			return lim
		}
	}
	return ""
}

// buckets are a run's admitted p50 and p99 per bucket of completion time,
// of the requests that of accepts.
func buckets(r *runResult, length, width time.Duration, of func(request) bool) (p50, p99 plotter.XYs) {
	n := int(length / width)
	lats := make([][]time.Duration, n)
	for _, q := range r.reqs {
		if b := int(q.done / width); q.status == 200 && b < n && of(q) {
			lats[b] = append(lats[b], q.latency())
		}
	}
	for b, l := range lats {
		if len(l) == 0 {
			continue
		}
		slices.Sort(l)
		x := (float64(b) + 0.5) * width.Seconds()
		p50 = append(p50, plotter.XY{X: x, Y: math.Max(ms(benchkit.Quantile(l, .5)), 0.1)})
		p99 = append(p99, plotter.XY{X: x, Y: math.Max(ms(benchkit.Quantile(l, .99)), 0.1)})
	}
	return p50, p99
}

// events marks when the load falls or the upstream slows.
func events(p *plot.Plot, sr *scenarioResult, lo, hi float64) error {
	for _, at := range []time.Duration{sr.load.fallAt, sr.SlowAt} {
		if at > 0 {
			if err := line(p, "", plotter.XYs{{X: at.Seconds(), Y: lo}, {X: at.Seconds(), Y: hi}}, grey, 1, dashed); err != nil {
				return err
			}
		}
	}
	return nil
}
