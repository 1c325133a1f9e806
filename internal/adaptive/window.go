// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package adaptive

import "time"

// unitFloat maps x to [0, 1) (splitmix64): the jitter of a probe, drawn
// from the clock so that a simulated clock makes it repeatable.
func unitFloat(x uint64) float64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	x ^= x >> 31
	return float64(x>>11) / (1 << 53)
}

// A latencyWindow holds an interval's latencies, at most adaptiveWindow
// of them, a uniform sample of all when there were more.
type latencyWindow struct {
	seen int
	n    int
	s    [adaptiveWindow]time.Duration
}

func (w *latencyWindow) reset() { w.seen, w.n = 0, 0 }

// add adds a sample; an error's ranks above every success.
func (w *latencyWindow) add(kind Sample, lat time.Duration, now time.Time) {
	switch kind {
	case SampleNone:
		return
	case SampleError:
		lat = errorLatency
	}
	w.seen++
	if w.n < len(w.s) {
		w.s[w.n] = lat
		w.n++
		return
	}
	// Reservoir sampling; the clock's low bits are random enough.
	if i := int(unitFloat(uint64(now.UnixNano())+uint64(w.seen)) * float64(w.seen)); i < len(w.s) {
		w.s[i] = lat
	}
}

// median is the median latency (the lower of the middle two), 0 when the
// window is empty. It reorders the window.
func (w *latencyWindow) median() time.Duration { return lowerMedian(w.s[:w.n]) }

// lowerMedian is the lower of the middle two values of v (which it
// reorders), 0 for none. The windows are small: selection does.
func lowerMedian(v []time.Duration) time.Duration {
	if len(v) == 0 {
		return 0
	}
	k := (len(v) - 1) / 2
	for i := 0; i <= k; i++ {
		m := i
		for j := i + 1; j < len(v); j++ {
			if v[j] < v[m] {
				m = j
			}
		}
		v[i], v[m] = v[m], v[i]
	}
	return v[k]
}
