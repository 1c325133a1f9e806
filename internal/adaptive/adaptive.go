// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package adaptive is the controller of `concurrency adaptive`: a limit
// on requests in flight per key, learnt from the latency of the requests
// it admits. It is an instance's own view, kept in memory; it knows
// nothing of HTTP, zones, stores or Caddy, and is tested on simulated
// latencies.
package adaptive

import (
	"math"
	"time"
)

// An adaptive limit on requests in flight (`concurrency adaptive`) is
// learnt from the latency of the requests it admits, as TCP Vegas learns a
// congestion window from round-trip times. With N requests in flight on
// average, a median latency R and the latency R0 of the upstream without
// a queue, Little's law gives the requests waiting in the upstream's
// queue:
//
//	queue = N × (1 − R0/R)
//
// The controller keeps that queue between α and β requests: α = 2·lg and
// β = 5·lg (lg = log10 of the limit, at least 1), or a tenth and a quarter
// of the limit when more (latency at most a third above R0): enough to
// keep every worker of the upstream busy, few enough that a request waits
// little. Below α it raises the limit, by lg, or by β (at most by half)
// when there is no queue at all; above β it lowers it by half the excess
// over the middle of the band, at most by a quarter at a time.
//
// How it avoids what goes wrong in other controllers:
//
//   - R0 is the least of the medians measured in the last two probe
//     periods. Every 3 seconds or so (jittered by a quarter, and never
//     more often than 50 latencies) a probe halves the requests in flight
//     (the limit, or the part of it in use when less) for two latencies,
//     never below min, and takes the median latency of the requests it
//     admits: with half as many in flight, a queue drains, so R0 is a
//     no-load latency and does not drift up with a queue that is already
//     there (which would let the limit creep up), yet follows an upstream
//     that really got slower within two periods. A probe lasts a time,
//     not a number of requests (two of the latencies measured since the
//     last one), and keeps half the requests: it cannot starve traffic;
//     and it ends when its requests are back, or two of its times later
//     when one hangs. Until the requests in flight are back to the limit
//     after it (a latency at most), latencies are not samples: they would
//     show a shorter queue than the limit's.
//   - An upstream that got uniformly slower (every request slower,
//     however many are in flight) shows a queue against the R0 it had,
//     and 50 latencies of a slow upstream are long (25s at 500ms). A
//     probe is flat when its median is about that of the requests
//     admitted under the full limit: halving the requests in flight did
//     not make them faster, there was no queue. A flat probe far above R0
//     brings the next one a period of 3 seconds later, not 50 latencies,
//     so that R0 follows within about 12 seconds (16 latencies when
//     longer); meanwhile the limit falls only for the queue that the
//     flat probe's median shows too, and not again after a fall below the
//     requests in flight that did not make them faster. A probe that is
//     not flat found a queue, and changes nothing of this: after a loss
//     of workers, where a probe may not drain the queue, R0 is not taken
//     from it any sooner.
//   - R is the median latency of an interval: at least 100ms and about a
//     limit's worth of requests (8 to 32, a uniform sample of more), all
//     admitted under the current limit (the samples of requests admitted
//     before a change are dropped). A single slow request does not move a
//     median.
//   - The limit falls only when two intervals in a row find a queue
//     beyond β: a pause of the whole process (a GC pause, a stalled
//     host) inflates one interval, not two.
//   - A response with an error status (5xx) counts as slower than every
//     success, never as a fast sample: it raises the median, and when
//     errors are half of an interval, R is infinite and the queue is
//     everything in flight. Requests that were refused (shed, or refused
//     by another zone) are never samples, and one whose client left
//     counts only when it had already waited longer than the last median
//     (a bound that shows slowness); a client that leaves early says
//     nothing of the upstream.
//   - The limit rises only while at least half of it is in use: idle
//     traffic does not inflate it. With classes (below), "it" is the part
//     of the limit that the interval's requests could use.
//
// Classes (priorities) share a key's limit: class 0 is the highest, and
// each class above the lowest has a reserve, a fraction of the limit held
// back for it and the classes above it. A request of class c is admitted
// while the requests in flight, whatever their class, are fewer than its
// part of the limit: the limit less the reserves of the classes above c,
// rounded down, and at least one. So the highest class may use the whole
// limit, the lowest the limit less every reserve, and under overload the
// lowest class is shed first while each reserve stays free for the
// classes it is for. A probe halves every class's part alike.
//
// The limit is learnt from every admitted request, whatever its class,
// but a reserve that no request uses must not hold it down: counted
// against the whole limit, a lowest class that may use 40% of it is
// never "half in use", and the limit would stay at min. So the
// controller steers the part of the limit that the interval's requests
// could use, as it steers a limit without classes, and the limit
// follows as that part over its share: the part of the lowest class that
// asked for a place (admitted or shed), or the most requests in flight
// when more (a higher class that used more than it). "In use" is the
// most requests in flight, whatever their class, against that part; the
// band of the queue and the steps are that part's. The lowest class
// alone thus raises the limit until its part keeps the upstream busy, as
// without classes, and a class that comes later finds its reserve above
// that part, at the cost of a queue of at most its reserve until the
// limit falls.
//
// The state of a key is one mutex and one controller; the limiter is
// local to each instance (latency is an instance's own view), and never
// in a store.

const (
	adaptiveWindow    = 32                     // samples kept per interval (a reservoir beyond)
	adaptiveMinSample = 8                      // samples per interval at least
	Interval          = 100 * time.Millisecond // an interval lasts at least this long
	adaptivePeriods   = 2                      // probe periods that R0 remembers
	probeEvery        = 3 * time.Second        // the base probe period
	probeLatencies    = 50                     // a probe period lasts at least this many latencies
	maxProbeSpan      = 10 * time.Second
	// errorLatency ranks an error's sample above every success.
	errorLatency = time.Duration(math.MaxInt64)
)

// A Sample is what a request's response tells the controller.
type Sample uint8

const (
	SampleNone  Sample = iota // nothing: not served, or a protocol switch
	SampleOK                  // a response: its latency is a sample
	SampleError               // an error status: a sign of overload
	SampleGone                // the client left before the end
)

// A controller is the adaptive limit of one key. It is not safe for
// concurrent use: Key guards it.
type controller struct {
	min, max float64
	limit    float64
	inFlight int64
	// gen changes with the limit: a request carries the generation it
	// was admitted in, and only the current one's latencies are samples.
	gen uint32

	noLoad  time.Duration // R0; 0 until the first interval
	periods [adaptivePeriods]time.Duration
	period  int // the current one in periods

	// The interval: its samples, since when, and the integral of the
	// requests in flight over it, up to last.
	win   latencyWindow
	since time.Time
	last  time.Time
	area  float64
	peak  int64 // the most in flight

	over    bool          // the last interval found a queue beyond β
	used    float64       // its mean requests in flight, over the share of the limit they could use (interval.share)
	latency time.Duration // the last interval's median

	probing    bool
	probeN     uint32    // the probe's number, which its requests carry
	probeEnd   time.Time // the probe's limit applies until then
	probeLimit int64
	probeOut   int64     // requests admitted by the probe, still in flight
	giveUp     time.Time // the probe ends then, whatever is still out
	probeWin   latencyWindow
	fullWin    latencyWindow // the latencies of requests admitted under the limit, back during the probe
	nextProbe  time.Time
	// flat is the last probe's median when it was about the median of
	// the requests admitted under the full limit that came back while it
	// ran (0 otherwise): with half as many in flight the requests were no
	// faster, so there was no queue for the probe to drain. The limit
	// falls only for a queue that flat shows too (see next).
	flat time.Duration
	// fellAt is the median latency of the interval whose queue made the
	// limit fall below the requests it had in flight; 0 when the last
	// change was not such a fall. futile: the interval after that fall
	// was no faster, so there was no queue of the limit's to shorten; the
	// limit falls no further until a probe ends, or a latency beyond 1¼
	// of futileAt shows a queue growing.
	fellAt   time.Duration
	futile   bool
	futileAt time.Duration
	// measured: an interval has ended since the last probe, so that a
	// probe lasts two of the latencies the upstream has now.
	measured bool
	// settling: a probe has ended, and the requests in flight are not
	// back to the limit yet (or for a latency at most); their samples
	// would show a shorter queue than the limit's.
	settling bool
	settleBy time.Time

	logged float64 // the limit last logged

	// Classes (see Key.Admit): shares[c] is the fraction of the limit
	// that class c may use, 1 for the highest (nil without classes, a
	// table's slice that no key changes); classIn, the requests of each
	// class in flight; low, the lowest class that asked for a place in
	// the interval.
	shares  []float64
	classIn []int64
	low     int
}

func newController(min, max int64, shares []float64) controller {
	c := controller{min: float64(min), max: float64(max), limit: float64(min), logged: float64(min), shares: shares}
	if shares != nil {
		c.classIn = make([]int64, len(shares))
	}
	return c
}

// A Ticket is what a request admitted by a controller carries to its
// release.
type Ticket struct {
	gen   uint32
	probe uint32 // the probe that admitted it; 0 for none
	class uint32
}

// admit takes a place in flight at now for a request of class, if one is
// free under its part of the limit.
func (c *controller) admit(now time.Time, class int) (Ticket, bool) {
	c.checkProbe(now)
	if !c.probing && c.noLoad > 0 && c.measured && !now.Before(c.nextProbe) {
		c.startProbe(now)
	}
	limit, probe := int64(c.limit), c.probing && now.Before(c.probeEnd)
	if probe {
		limit = c.probeLimit
	}
	if c.shares == nil {
		class = 0
	} else {
		class = min(max(class, 0), len(c.shares)-1)
		limit = c.part(limit, class)
	}
	if c.inFlight >= limit {
		c.low = max(c.low, class)
		return Ticket{}, false
	}
	if c.settling && (c.inFlight+1 >= limit || !now.Before(c.settleBy)) {
		c.settling = false
		c.gen++
		c.restart(now)
	}
	c.low = max(c.low, class)
	c.tick(now)
	c.inFlight++
	c.peak = max(c.peak, c.inFlight)
	t := Ticket{gen: c.gen}
	if c.shares != nil {
		c.classIn[class]++
		t.class = uint32(class)
	}
	if probe {
		c.probeOut++
		t.probe = c.probeN
	}
	return t, true
}

// part is what class may use of limit: the limit less the reserves of
// the classes above it, rounded down, and at least one request.
func (c *controller) part(limit int64, class int) int64 {
	if c.shares == nil || class == 0 {
		return limit
	}
	return max(1, int64(float64(limit)*c.shares[class]))
}

// tick adds the requests in flight since the last event to the
// interval's integral.
func (c *controller) tick(now time.Time) {
	if c.since.IsZero() {
		c.since = now
	}
	if d := now.Sub(c.last); !c.last.IsZero() && d > 0 {
		c.area += float64(c.inFlight) * float64(d)
	}
	c.last = now
}

// done gives back the place of a request admitted with t, whose response
// ended at now after lat. It reports whether the limit changed.
func (c *controller) done(now time.Time, t Ticket, kind Sample, lat time.Duration) bool {
	c.tick(now)
	c.inFlight--
	if c.classIn != nil {
		c.classIn[t.class]--
	}
	if kind == SampleGone {
		// A lower bound of the latency: it shows slowness only when it
		// is long already.
		kind = SampleOK
		if c.latency == 0 || lat < c.latency {
			kind = SampleNone
		}
	}
	if t.probe != 0 {
		if c.probing && t.probe == c.probeN {
			c.probeOut--
			c.probeWin.add(kind, lat, now)
		}
		c.checkProbe(now)
		return false
	}
	if c.probing {
		c.fullWin.add(kind, lat, now)
	}
	c.checkProbe(now)
	if c.probing || c.settling || t.gen != c.gen || kind == SampleNone {
		return false
	}
	c.win.add(kind, lat, now)
	if c.win.seen < min(max(int(c.limit), adaptiveMinSample), adaptiveWindow) || now.Sub(c.since) < Interval {
		return false
	}
	return c.update(now)
}

// update ends an interval: it sets the limit from the queue that the
// interval's median latency and mean requests in flight show, and from
// its errors.
func (c *controller) update(now time.Time) bool {
	r := c.win.median()
	if r != errorLatency {
		c.latency, c.measured = r, true
		if c.fellAt > 0 && 20*r >= 19*c.fellAt {
			c.futile, c.futileAt = true, r
		}
		if c.futile && 4*r > 5*c.futileAt {
			c.futile = false
		}
		if c.noLoad == 0 {
			c.nextProbe = c.probeTime(now, false)
		}
		if c.noLoad == 0 || r < c.noLoad {
			c.noLoad = r
		}
		if p := &c.periods[c.period]; *p == 0 || r < *p {
			*p = r
		}
	}
	iv := c.interval(now, r)
	c.used = iv.inFlight / iv.share
	c.restart(now)
	old := c.limit
	c.limit = c.next(iv)
	c.fellAt = 0
	if c.limit < old && c.limit*iv.share < 0.95*iv.inFlight && r != errorLatency {
		c.fellAt = r // the next interval tells whether it was any use
	}
	if int64(c.limit) == int64(old) {
		return false
	}
	c.gen++
	c.restart(now)
	return true
}

// An interval is what the controller learnt in one.
type interval struct {
	inFlight float64 // requests in flight, on average
	queue    float64 // of which waiting in the upstream's queue
	excess   float64 // the queue that the last probe does not contradict (see controller.flat)
	busy     bool    // at least half the limit was in use (see share)
	// share is the fraction of the limit that the interval's requests
	// could use: 1 without classes. With classes, the part of the lowest
	// class present, or the most requests in flight when more (a higher
	// class that used more than the lowest's part). The controller keeps
	// that part of the limit, not the whole, as it keeps a limit without
	// classes: its band and its steps are that part's, and busy means
	// that at least half the lowest class's part was in use. So a
	// reserve left unused keeps the limit neither from rising nor, by
	// widening the band, from falling.
	share float64
}

// interval sums up the interval that ends at now, whose median latency
// is r.
func (c *controller) interval(now time.Time, r time.Duration) interval {
	iv := interval{inFlight: float64(c.inFlight), busy: 2*c.peak >= c.part(int64(c.limit), c.low), share: 1}
	if span := now.Sub(c.since); span > 0 {
		iv.inFlight = c.area / float64(span)
	}
	if c.shares != nil {
		iv.share = max(c.shares[c.low], min(1, float64(c.peak)/c.limit))
	}
	iv.queue, iv.excess = iv.inFlight, iv.inFlight
	if r != errorLatency {
		iv.queue *= 1 - float64(c.noLoad)/float64(r)
		iv.excess *= 1 - float64(max(c.noLoad, c.flat))/float64(r)
	}
	return iv
}

// next is the limit after iv: it rises when the queue was short and the
// limit in use, and falls when two intervals in a row found the queue
// long, by half its excess over the middle of the band, at most by a
// quarter. An upstream that got uniformly slower shows a queue against
// the R0 it had before, until probes have measured R0 anew: the limit
// falls only for the queue that the last probe does not contradict
// (flat), and not again after a fall that did not make it faster
// (futile). With classes, all this is of the part of the limit that the
// interval's requests could use (iv.share), which the limit follows.
func (c *controller) next(iv interval) float64 {
	l := c.limit * iv.share
	lg := max(1, math.Log10(l))
	alpha, beta := max(2*lg, l/10), max(5*lg, l/4)
	switch {
	case iv.queue > beta:
		if c.over && !c.futile && iv.excess > beta {
			l -= min(max(lg, (iv.excess-(alpha+beta)/2)/2), l/4)
		}
		c.over = true
	case iv.queue < alpha:
		c.over = false
		if iv.busy && iv.queue < lg {
			l += min(beta, l/2)
		} else if iv.busy {
			l += lg
		}
	default:
		c.over = false
	}
	return min(max(l/iv.share, c.min), c.max)
}

// restart starts a new interval at now.
func (c *controller) restart(now time.Time) {
	c.win.reset()
	c.since, c.last, c.area, c.peak, c.low = now, now, 0, c.inFlight, 0
}

// startProbe halves the requests in flight for two latencies, to measure
// R0: the limit, or what the last interval used of it when less (halving
// an unused limit would measure the queue it meant to drain). Each
// class's part of the limit is halved with it.
func (c *controller) startProbe(now time.Time) {
	c.probing, c.measured = true, false
	c.probeN = max(c.probeN+1, 1)
	c.probeLimit = max(int64(c.min), int64(math.Ceil(min(c.limit, c.used)/2)))
	span := min(max(2*c.latency, time.Millisecond), maxProbeSpan)
	c.probeEnd, c.giveUp = now.Add(span), now.Add(3*span)
	c.probeOut = 0
	c.probeWin.reset()
	c.fullWin.reset()
}

// checkProbe ends the probe once its time is over and the requests it
// admitted are back, or, when some are not, twice its time later: a
// request that hangs does not hold the controller.
func (c *controller) checkProbe(now time.Time) {
	if c.probing && !now.Before(c.probeEnd) && (c.probeOut == 0 || !now.Before(c.giveUp)) {
		c.endProbe(now)
	}
}

// endProbe starts a new probe period with the probe's median, and
// forgets the oldest period. A flat probe far above R0 says that the
// upstream got slower: the next probe, which can confirm it (R0 is the
// least of two periods), comes a period of probeEvery later, however
// long the latency, rather than 50 latencies later.
func (c *controller) endProbe(now time.Time) {
	c.probing, c.flat, c.futile, c.fellAt = false, 0, false, 0
	soon := false
	if r := c.probeWin.median(); c.probeWin.seen >= 3 && r != errorLatency {
		ref := c.latency
		if c.fullWin.seen >= 3 {
			ref = max(ref, c.fullWin.median())
		}
		if 5*r >= 4*ref {
			c.flat, soon = r, r > 2*c.noLoad
		}
		c.period = (c.period + 1) % adaptivePeriods
		c.periods[c.period] = r
		c.noLoad = r
		for _, p := range c.periods {
			if p > 0 {
				c.noLoad = min(c.noLoad, p)
			}
		}
	}
	c.nextProbe = c.probeTime(now, soon)
	c.settling, c.settleBy = true, now.Add(c.latency)
	c.gen++
	c.over = false
}

// probeTime is when the next probe starts: a period of probeEvery, or 50
// latencies when longer and not soon, give or take a quarter.
func (c *controller) probeTime(now time.Time, soon bool) time.Time {
	p := max(probeEvery, probeLatencies*c.latency)
	if soon {
		p = probeEvery
	}
	return now.Add(time.Duration(float64(p) * (0.75 + 0.5*unitFloat(uint64(now.UnixNano())))))
}
