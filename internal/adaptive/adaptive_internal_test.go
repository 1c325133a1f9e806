// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package adaptive

import (
	"container/heap"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"
)

// The controller on simulated latencies: a discrete-event simulation of
// closed-loop clients, the controller and an upstream with a number of
// workers and a first-come-first-served queue. Time is simulated, so the
// runs are exact and fast, and each failure of the known controllers has
// a scenario that would show it.

// simConfig describes a simulated run.
type simConfig struct {
	workers int
	service func(at time.Duration) time.Duration // the work of a request arriving at at
	clients func(at time.Duration) int           // closed-loop clients active at at
	length  time.Duration
	backoff time.Duration // a shed client tries again after this
	min     int64
	// background keeps that many requests of other clients, not limited
	// by the controller, at the upstream: a queue already present.
	background int

	// errorEvery makes every errorEvery-th request fail at once (5xx),
	// without work; cancelEvery, every cancelEvery-th request's client
	// leave after 100µs; queueCap, the upstream answer 503 at once when
	// this many wait already (0: no cap).
	errorEvery, cancelEvery, queueCap int
	// slowOneIn makes one request in slowOneIn, drawn at random, take
	// slow at the upstream (holding its worker).
	slowOneIn int
	slow      time.Duration
	// pauses: the proxy stops for pause at each of these instants, and
	// delivers nothing meanwhile (a GC pause).
	pauses []time.Duration
	pause  time.Duration
	// workersAfter replaces workers from workersFrom on (0: never).
	workersFrom  time.Duration
	workersAfter int
	// seed varies a run: the clock's instants (the controller draws its
	// probes' jitter and its reservoir from them) and the jitter of the
	// service times.
	seed uint64
	// clock moves the clock's instants, and nothing else: the same
	// traffic seen by another key, or another instance, started at
	// another instant.
	clock time.Duration
	// reserves gives the controller classes (see NewTable); the clients
	// are then of the lowest class, and groups add clients of other
	// classes.
	reserves []float64
	groups   []simGroup
}

// A simGroup is a number of closed-loop clients of one class, each of
// which sends its next request think after the last answer (backoff
// after a refusal).
type simGroup struct {
	clients, class int
	think          time.Duration
}

// groupClient is the first client number of groups: group g's clients
// are groupClient·(g+1) on.
const groupClient = 1 << 20

// simResult is what a run measured.
type simResult struct {
	samples []simSample // admitted requests, by completion
	shed    []time.Duration
	limits  []simPoint // the limit every 10ms
	served  int        // successful responses
	probes  []simProbe
	// fewestRefused is the fewest requests in flight when one was
	// refused (shed); math.MaxInt64 when none was.
	fewestRefused int64
	shedClass     []int // the class of each of shed
}

// A simProbe is when a probe started, and when it ended (0 if it had
// not by the end of the run).
type simProbe struct{ start, end time.Duration }

type simSample struct {
	at, lat time.Duration
	ok      bool
	class   int
}

type simPoint struct {
	at     time.Duration
	limit  int64
	exact  float64       // the limit before rounding down
	noLoad time.Duration // R0
}

type simEvent struct {
	at   time.Duration
	seq  int
	kind int // 0: a client sends; 1: a response is delivered; 2: a worker is free
	// for deliveries
	client  int
	tk      Ticket
	admit   time.Duration
	outcome Sample
	slow    bool // its work takes cfg.slow
}

type simQueue []simEvent

func (q simQueue) Len() int { return len(q) }
func (q simQueue) Less(i, j int) bool {
	return q[i].at < q[j].at || q[i].at == q[j].at && q[i].seq < q[j].seq
}
func (q simQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)   { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simState is a run in progress.
type simState struct {
	cfg     simConfig
	c       controller
	q       simQueue
	seq     int
	base    time.Time
	busy    int
	waiting []simEvent // requests waiting for a worker
	n       int        // requests admitted so far
	active  map[int]bool
	res     simResult
}

func simulate(cfg simConfig) simResult { return newSim(cfg).run() }

func newSim(cfg simConfig) *simState {
	if cfg.min == 0 {
		cfg.min = 4
	}
	if cfg.backoff == 0 {
		cfg.backoff = 5 * time.Millisecond
	}
	base := time.Unix(1_000_000, int64(cfg.seed*7_919_333)).Add(cfg.clock)
	t := NewTable[int](cfg.min, 1000, cfg.reserves...)
	return &simState{cfg: cfg, c: newController(cfg.min, 1000, t.shares), base: base, active: map[int]bool{},
		res: simResult{fewestRefused: math.MaxInt64}}
}

func (s *simState) run() simResult {
	cfg := s.cfg
	s.wake(0)
	for i := range cfg.background {
		s.push(simEvent{at: 0, kind: 0, client: -1 - i})
	}
	for g, gr := range cfg.groups {
		for j := range gr.clients {
			s.push(simEvent{at: 0, kind: 0, client: groupClient*(g+1) + j})
		}
	}
	next := time.Duration(0)
	for s.q.Len() > 0 {
		e := heap.Pop(&s.q).(simEvent)
		if e.at > cfg.length {
			break
		}
		for ; next <= e.at; next += 10 * time.Millisecond {
			s.res.limits = append(s.res.limits, simPoint{next, int64(s.c.limit), s.c.limit, s.c.noLoad})
		}
		switch e.kind {
		case 0:
			s.send(e)
		case 1:
			s.deliver(e)
		case 2:
			s.busy--
			s.startWork(e.at)
		}
		if n := len(s.res.probes); s.c.probing && (n == 0 || s.res.probes[n-1].end != 0) {
			s.res.probes = append(s.res.probes, simProbe{start: e.at})
		} else if !s.c.probing && n > 0 && s.res.probes[n-1].end == 0 {
			s.res.probes[n-1].end = e.at
		}
		s.wake(e.at)
	}
	return s.res
}

func (s *simState) push(e simEvent) {
	s.seq++
	e.seq = s.seq
	heap.Push(&s.q, e)
}

// wake starts the clients that have become active.
func (s *simState) wake(at time.Duration) {
	for i := range s.cfg.clients(at) {
		if !s.active[i] {
			s.active[i] = true
			s.push(simEvent{at: at, kind: 0, client: i})
		}
	}
}

// delivered is when the proxy can deliver a response finished at at.
func (s *simState) delivered(at time.Duration) time.Duration {
	for _, p := range s.cfg.pauses {
		if at >= p && at < p+s.cfg.pause {
			return p + s.cfg.pause
		}
	}
	return at
}

func (s *simState) send(e simEvent) {
	if e.client < 0 { // background: straight to the upstream
		s.waiting = append(s.waiting, simEvent{client: e.client, admit: e.at, outcome: SampleNone})
		s.startWork(e.at)
		return
	}
	if e.client < groupClient && e.client >= s.cfg.clients(e.at) {
		s.active[e.client] = false // load fell: the client stops
		return
	}
	class := s.classOf(e.client)
	tk, ok := s.c.admit(s.base.Add(e.at), class)
	if !ok {
		s.res.fewestRefused = min(s.res.fewestRefused, s.c.inFlight)
		s.res.shed = append(s.res.shed, e.at)
		s.res.shedClass = append(s.res.shedClass, class)
		s.push(simEvent{at: e.at + s.cfg.backoff, kind: 0, client: e.client})
		return
	}
	s.n++
	r := simEvent{client: e.client, tk: tk, admit: e.at, outcome: SampleOK}
	r.slow = s.cfg.slowOneIn > 0 && unitFloat(s.cfg.seed<<32+uint64(s.n))*float64(s.cfg.slowOneIn) < 1
	switch {
	case s.cfg.errorEvery > 0 && s.n%s.cfg.errorEvery == 0:
		r.at, r.kind, r.outcome = e.at+100*time.Microsecond, 1, SampleError
		s.push(r)
		return
	case s.cfg.cancelEvery > 0 && s.n%s.cfg.cancelEvery == 0:
		r.at, r.kind, r.outcome = e.at+100*time.Microsecond, 1, SampleGone
		s.push(r)
		return
	case s.cfg.queueCap > 0 && len(s.waiting) >= s.cfg.queueCap:
		r.at, r.kind, r.outcome = e.at+time.Millisecond, 1, SampleError
		s.push(r)
		return
	}
	r.at = e.at
	s.waiting = append(s.waiting, r)
	s.startWork(e.at)
}

// startWork gives waiting requests the free workers.
func (s *simState) startWork(at time.Duration) {
	workers := s.cfg.workers
	if s.cfg.workersFrom > 0 && at >= s.cfg.workersFrom {
		workers = s.cfg.workersAfter
	}
	for s.busy < workers && len(s.waiting) > 0 {
		r := s.waiting[0]
		s.waiting = s.waiting[1:]
		work := s.cfg.service(r.admit + time.Duration(s.cfg.seed))
		if r.slow {
			work = s.cfg.slow
		}
		s.busy++
		s.push(simEvent{at: at + work, kind: 2})
		r.at, r.kind = s.delivered(at+work), 1
		s.push(r)
	}
}

func (s *simState) deliver(e simEvent) {
	if e.client < 0 {
		s.push(simEvent{at: e.at, kind: 0, client: e.client})
		return
	}
	lat := e.at - e.admit
	s.c.done(s.base.Add(e.at), e.tk, e.outcome, lat)
	if e.outcome == SampleOK {
		s.res.served++
	}
	s.res.samples = append(s.res.samples, simSample{at: e.at, lat: lat, ok: e.outcome == SampleOK, class: s.classOf(e.client)})
	next := e.at
	if e.outcome == SampleGone {
		next += s.cfg.backoff
	}
	if e.client >= groupClient {
		next += s.cfg.groups[e.client/groupClient-1].think
	}
	s.push(simEvent{at: next, kind: 0, client: e.client})
}

// classOf is the class of a client's requests: its group's, or the
// lowest.
func (s *simState) classOf(client int) int {
	if client >= groupClient {
		return s.cfg.groups[client/groupClient-1].class
	}
	return len(s.cfg.reserves)
}

// ofClass returns the latencies of the successful responses of class
// delivered in [from, to), sorted, and the requests of class shed then.
func (r *simResult) ofClass(class int, from, to time.Duration) (lat []time.Duration, shed int) {
	for _, s := range r.samples {
		if s.ok && s.class == class && s.at >= from && s.at < to {
			lat = append(lat, s.lat)
		}
	}
	for i, at := range r.shed {
		if r.shedClass[i] == class && at >= from && at < to {
			shed++
		}
	}
	slices.Sort(lat)
	return lat, shed
}

// between returns the latencies of successful responses delivered in
// [from, to), sorted.
func (r *simResult) between(from, to time.Duration) []time.Duration {
	var out []time.Duration
	for _, s := range r.samples {
		if s.ok && s.at >= from && s.at < to {
			out = append(out, s.lat)
		}
	}
	slices.Sort(out)
	return out
}

func simQuantile(s []time.Duration, q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	return s[min(int(q*float64(len(s))), len(s)-1)]
}

// limitRange is the least and the most limit in [from, to).
func (r simResult) limitRange(from, to time.Duration) (lo, hi int64) {
	lo = math.MaxInt64
	for _, p := range r.limits {
		if p.at >= from && p.at < to {
			lo, hi = min(lo, p.limit), max(hi, p.limit)
		}
	}
	return lo, hi
}

// exactRange is the least and the most limit in [from, to), before
// rounding down.
func (r simResult) exactRange(from, to time.Duration) (lo, hi float64) {
	lo = math.Inf(1)
	for _, p := range r.limits {
		if p.at >= from && p.at < to {
			lo, hi = min(lo, p.exact), max(hi, p.exact)
		}
	}
	return lo, hi
}

// shedBetween counts the requests shed in [from, to).
func (r *simResult) shedBetween(from, to time.Duration) int {
	n := 0
	for _, at := range r.shed {
		if at >= from && at < to {
			n++
		}
	}
	return n
}

// fixed is a service time of d give or take 10%.
func fixed(d time.Duration) func(time.Duration) time.Duration {
	return func(at time.Duration) time.Duration { return jitter(d, at) }
}

// jitter is d give or take 10%, drawn from at.
func jitter(d, at time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.9 + 0.2*unitFloat(uint64(at))))
}

func constClients(n int) func(time.Duration) int { return func(time.Duration) int { return n } }

const simMs = time.Millisecond

// TestAdaptiveSimulated is the bench's scenarios in simulation: 8 workers
// of 20ms each (400/s) under 64 clients, 32 workers, load falling to 4
// clients, and the upstream slowing from 20 to 60ms.
func TestAdaptiveSimulated(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	t.Run("8 workers", func(t *testing.T) {
		r := simulate(simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(64), length: 60 * time.Second})
		lat := r.between(5*time.Second, 60*time.Second)
		goodput := float64(len(lat)) / 55 / 400
		p50, p99 := simQuantile(lat, .5), simQuantile(lat, .99)
		lo, hi := r.limitRange(5*time.Second, 60*time.Second)
		t.Logf("p50 %v p99 %v goodput %.2f limit %d-%d", p50, p99, goodput, lo, hi)
		if p50 > 50*simMs || p99 > 150*simMs || goodput < 0.9 {
			t.Errorf("p50 %v (want ≤ 50ms), p99 %v (≤ 150ms), goodput %.2f of capacity (≥ 0.9)", p50, p99, goodput)
		}
	})
	t.Run("32 workers", func(t *testing.T) {
		r := simulate(simConfig{workers: 32, service: fixed(20 * simMs), clients: constClients(64), length: 30 * time.Second})
		lat := r.between(2*time.Second, 30*time.Second)
		goodput := float64(len(lat)) / 28 / 1600
		lo, hi := r.limitRange(2*time.Second, 30*time.Second)
		t.Logf("p50 %v p99 %v goodput %.2f limit %d-%d", simQuantile(lat, .5), simQuantile(lat, .99), goodput, lo, hi)
		if goodput < 0.9 {
			t.Errorf("goodput %.2f of capacity, want ≥ 0.9", goodput)
		}
	})
	t.Run("load falls to 4 clients", func(t *testing.T) {
		clients := func(at time.Duration) int {
			if at < 10*time.Second {
				return 64
			}
			return 4
		}
		r := simulate(simConfig{workers: 8, service: fixed(20 * simMs), clients: clients, length: 40 * time.Second})
		shed, all := r.shedBetween(11*time.Second, 40*time.Second), len(r.between(11*time.Second, 40*time.Second))
		t.Logf("shed %d of %d", shed, shed+all)
		if shed*100 >= shed+all {
			t.Errorf("shed %d of %d requests with 4 clients, want under 1%%", shed, shed+all)
		}
	})
	t.Run("upstream slows", func(t *testing.T) {
		service := func(at time.Duration) time.Duration {
			if at < 20*time.Second {
				return jitter(20*simMs, at)
			}
			return jitter(60*simMs, at)
		}
		r := simulate(simConfig{workers: 8, service: service, clients: constClients(64), length: 60 * time.Second})
		for from := 23 * time.Second; from < 60*time.Second; from += time.Second {
			if p99 := simQuantile(r.between(from, from+time.Second), .99); p99 > 180*simMs {
				t.Errorf("p99 %v in the second from %v, want ≤ 180ms", p99, from)
			}
		}
		late := r.between(50*time.Second, 60*time.Second)
		lo, hi := r.limitRange(50*time.Second, 60*time.Second)
		t.Logf("after: p50 %v p99 %v goodput %.2f limit %d-%d", simQuantile(late, .5), simQuantile(late, .99), float64(len(late))/10/(8/0.06), lo, hi)
	})
}

// TestAdaptiveProbeDoesNotStarve: a probe for the no-load latency that
// pins the limit low until it has its samples (Envoy's first gradient
// controller: one request in flight, then three, until 50 had come back)
// starves a slow upstream for a long time. A probe here halves the
// requests in flight for two latencies: an upstream of 1s requests keeps
// its goodput, in the whole run and in every 20s of it.
func TestAdaptiveProbeDoesNotStarve(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	for _, tc := range []struct {
		name    string
		service time.Duration
		clients int
		length  time.Duration
	}{
		{"1s requests", time.Second, 16, 10 * time.Minute},
		{"20ms requests", 20 * simMs, 64, time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := simulate(simConfig{workers: 8, service: fixed(tc.service), clients: constClients(tc.clients), length: tc.length})
			capacity := 8 / tc.service.Seconds()
			warm := 20 * tc.service
			all := float64(len(r.between(warm, tc.length))) / (tc.length - warm).Seconds() / capacity
			worst := math.Inf(1)
			for from := warm; from+20*time.Second <= tc.length; from += 5 * time.Second {
				worst = min(worst, float64(len(r.between(from, from+20*time.Second)))/20/capacity)
			}
			t.Logf("goodput %.3f of capacity, %.3f in the worst 20s", all, worst)
			if all < 0.95 || worst < 0.85 {
				t.Errorf("goodput %.3f of capacity (want ≥ 0.95), %.3f in the worst 20s (want ≥ 0.85)", all, worst)
			}
		})
	}
}

// TestAdaptiveProbeFloor: Envoy's gradient controller pinned the limit
// to 1 while it probed, and then to a floor of 3. A probe here halves
// the limit, never below min: a request is never refused while fewer
// than min are in flight, during a probe or not, whether min is above
// half the limit the upstream takes (every probe would go below it) or
// the requests are slow (a probe lasts longest).
func TestAdaptiveProbeFloor(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	for _, tc := range []struct {
		name    string
		min     int64
		workers int
		service time.Duration
		clients int
		length  time.Duration
		probes  int // at least
	}{
		{"min 10, 8 workers", 10, 8, 20 * simMs, 32, time.Minute, 15},
		{"min 4, 2 workers", 4, 2, 20 * simMs, 32, time.Minute, 10},
		{"min 4, 1s requests", 4, 8, time.Second, 16, 10 * time.Minute, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := simulate(simConfig{workers: tc.workers, service: fixed(tc.service), clients: constClients(tc.clients),
				length: tc.length, min: tc.min})
			lo, hi := r.limitRange(0, tc.length)
			t.Logf("%d probes; limit %d-%d; fewest in flight at a refusal %d", len(r.probes), lo, hi, r.fewestRefused)
			if len(r.probes) < tc.probes || r.fewestRefused == math.MaxInt64 {
				t.Fatalf("%d probes, fewest in flight at a refusal %d: the run tests nothing", len(r.probes), r.fewestRefused)
			}
			if r.fewestRefused < tc.min || lo < tc.min {
				t.Errorf("a request refused with %d in flight, the limit down to %d: want neither below min %d", r.fewestRefused, lo, tc.min)
			}
		})
	}
}

// TestAdaptiveProbeJitter: probes at fixed intervals put many keys, or
// many instances in front of one upstream, in step: they all halve their
// limits at once (Envoy added jitter to its probes for that). A probe
// here starts a period after the last one, give or take a quarter,
// drawn at random: the periods fill that range, and keys that see the
// same traffic from other instants do not probe together.
func TestAdaptiveProbeJitter(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	cfg := simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(16), length: 3 * time.Minute}
	t.Run("periods", func(t *testing.T) {
		cfg := cfg
		cfg.length = 10 * time.Minute
		r := simulate(cfg)
		// The period is probeEvery: 50 latencies are less. From the end
		// of a probe to the start of the next, in fifths of [¾, 1¼) of
		// it.
		var bins [5]int
		n := 0
		for i := 1; i < len(r.probes); i++ {
			gap := r.probes[i].start - r.probes[i-1].end
			f := float64(gap)/float64(probeEvery) - 0.75
			if f < 0 || f >= 0.5+0.01 {
				t.Errorf("probe %d starts %v after the last one ended: want %v give or take a quarter", i, gap, probeEvery)
				continue
			}
			bins[min(int(f*10), 4)]++
			n++
		}
		t.Logf("%d probes; periods in fifths of the range: %v", len(r.probes), bins)
		if n < 100 {
			t.Fatalf("%d periods: want over 100", n)
		}
		for i, b := range bins {
			if b*10 < n {
				t.Errorf("%d periods of %d in the %d. fifth of the range: want at least a tenth in each, %v", b, n, i+1, bins)
			}
		}
	})
	t.Run("keys", func(t *testing.T) {
		// Six keys with the same traffic, their clocks 1ms apart: for
		// each probe of the first after the first 30s, the share of the
		// others that start one within 100ms of it. At random, about
		// 7%; in step, all.
		var runs []simResult
		for k := range 6 {
			cfg := cfg
			cfg.clock = time.Duration(k) * time.Millisecond
			runs = append(runs, simulate(cfg))
		}
		together, probes := 0, 0
		for _, p := range runs[0].probes {
			if p.start < 30*time.Second {
				continue
			}
			probes++
			for k, r := range runs[1:] {
				at := p.start - time.Duration(k+1)*time.Millisecond // on the first key's clock
				for _, q := range r.probes {
					if d := q.start - at; d > -100*simMs && d < 100*simMs {
						together++
						break
					}
				}
			}
		}
		share := float64(together) / float64(5*probes)
		t.Logf("%d probes of the first key; %.0f%% of the others' probes with them", probes, 100*share)
		if probes < 30 || share > 0.25 {
			t.Errorf("%d probes; %.0f%% of the other keys start one within 100ms of each: want over 30, at most 25%%", probes, 100*share)
		}
	})
}

// TestAdaptiveNoCreepWithQueue: a controller whose no-load latency is
// taken from latencies with a queue in them (Vegas resetting it to the
// latest sample; Gradient2's long average following the short one) lets
// the limit creep up, queue and latency with it. Here the limit stays put
// over ten minutes, whether the queue is the limit's own or other
// clients' requests that wait at the upstream too.
func TestAdaptiveNoCreepWithQueue(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	for _, background := range []int{0, 8} {
		t.Run(fmt.Sprintf("%d other requests waiting", background), func(t *testing.T) {
			r := simulate(simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(24),
				length: 10 * time.Minute, background: background, backoff: 20 * simMs})
			_, early := r.limitRange(10*time.Second, 2*time.Minute)
			lo, late := r.limitRange(8*time.Minute, 10*time.Minute)
			p50 := simQuantile(r.between(8*time.Minute, 10*time.Minute), .5)
			t.Logf("limit up to %d in minutes 0-2, %d-%d in minutes 8-10; p50 %v", early, lo, late, p50)
			// Little's law: the limit and the other requests share 8
			// workers of 20ms.
			want := time.Duration(float64(20*simMs) * float64(int64(background)+late) / 8)
			if late > early+5 || late > 24 || p50 > want+10*simMs {
				t.Errorf("limit up to %d in minutes 8-10 (%d in minutes 0-2), p50 %v", late, early, p50)
			}
		})
	}
}

// TestAdaptiveFailuresAreNotFastSamples: requests that fail or are
// dropped come back fast; taken as latencies (Netflix's concurrency-limits
// saw RTTs near 0 from dropped requests), they drag the no-load latency
// towards 0 and throw the limit off. Here errors rank above every success,
// a client that leaves early is no sample, and neither is a request
// refused after admission: the no-load latency stays the upstream's, and
// the limit where it is without them. An upstream that answers 503 at
// once when its queue is full is overloaded, not fast: the limit stays
// about what the upstream takes (8 at work, 4 waiting), and its errors
// few.
func TestAdaptiveFailuresAreNotFastSamples(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	base := simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(64), length: time.Minute}
	for _, tc := range []struct {
		name string
		set  func(*simConfig)
	}{
		{"a third fail at once", func(c *simConfig) { c.errorEvery = 3 }},
		{"a third of the clients leave at once", func(c *simConfig) { c.cancelEvery = 3 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			tc.set(&cfg)
			s := newSim(cfg)
			r := s.run()
			lo, hi := r.limitRange(10*time.Second, time.Minute)
			t.Logf("no-load latency %v, limit %d-%d", s.c.noLoad, lo, hi)
			if s.c.noLoad < 18*simMs || lo < 10 || hi > 20 {
				t.Errorf("no-load latency %v (want the upstream's 18-22ms), limit %d-%d (want about 14)", s.c.noLoad, lo, hi)
			}
		})
	}
	t.Run("the upstream answers 503 when 4 wait", func(t *testing.T) {
		cfg := base
		cfg.queueCap = 4
		r := simulate(cfg)
		errs, all := 0, 0
		for _, s := range r.samples {
			if s.at >= 10*time.Second {
				all++
				if !s.ok {
					errs++
				}
			}
		}
		_, hi := r.limitRange(10*time.Second, time.Minute)
		t.Logf("%d errors of %d responses, limit up to %d", errs, all, hi)
		if errs*10 > all || hi > 20 {
			t.Errorf("%d errors of %d responses (want under 10%%), limit up to %d", errs, all, hi)
		}
	})
	t.Run("refused after admission", func(t *testing.T) {
		c := newController(4, 1000, nil)
		now := time.Unix(0, 0)
		for range 1000 {
			tk, ok := c.admit(now, 0)
			if !ok {
				t.Fatal("refused with nothing in flight")
			}
			now = now.Add(simMs)
			c.done(now, tk, SampleNone, 0)
		}
		if c.limit != 4 || c.noLoad != 0 || c.win.seen != 0 || c.inFlight != 0 {
			t.Errorf("limit %v, no-load latency %v, %d samples, %d in flight: want 4, 0, 0, 0", c.limit, c.noLoad, c.win.seen, c.inFlight)
		}
	})
}

// TestAdaptiveUpstreamSlowsUniformly: an upstream without a queue that
// turns uniformly slower (every request takes 10 to 200 times as long,
// however many are in flight) shows a queue against the no-load latency
// it had, until probes measure it anew. Probes 50 latencies apart took
// R0 about 30s to follow a 500ms upstream, and meanwhile the limit fell
// to min, shedding most requests of an upstream that was not overloaded.
// Here R0 follows within 12s, or 16 of the new latencies when that is
// longer, and the limit stays above half of what the clients use.
func TestAdaptiveUpstreamSlowsUniformly(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	const at, seeds = 10 * time.Second, 3
	for _, slow := range []time.Duration{100 * simMs, 200 * simMs, 500 * simMs, time.Second, 2 * time.Second} {
		for _, clients := range []int{20, 100} {
			within := max(12*time.Second, 16*slow)
			var worst, sum time.Duration
			least := int64(math.MaxInt64)
			for seed := range uint64(seeds) {
				service := func(a time.Duration) time.Duration {
					if a < at {
						return jitter(10*simMs, a)
					}
					return jitter(slow, a)
				}
				r := simulate(simConfig{workers: 10_000, service: service, clients: constClients(clients),
					length: at + within + 5*time.Second, seed: seed})
				followed := time.Duration(-1)
				for _, p := range r.limits {
					if p.at < at || followed >= 0 {
						continue
					}
					least = min(least, p.limit)
					if p.noLoad >= slow*8/10 {
						followed = p.at - at
					}
				}
				if followed < 0 {
					t.Errorf("10ms to %v, %d clients, seed %d: R0 still below %v %v after the change", slow, clients, seed, slow*8/10, within+5*time.Second)
					followed = within + 5*time.Second
				}
				worst, sum = max(worst, followed), sum+followed
			}
			t.Logf("10ms to %v, %d clients: R0 followed in %v on average, %v at most; the limit down to %d meanwhile", slow, clients, sum/seeds, worst, least)
			if worst > within {
				t.Errorf("10ms to %v, %d clients: R0 followed in up to %v, want within %v", slow, clients, worst, within)
			}
			if least < int64(clients/2) {
				t.Errorf("10ms to %v, %d clients: the limit fell to %d, want at least %d (half the clients)", slow, clients, least, clients/2)
			}
		}
	}
}

// TestAdaptiveCapacityDrops: what keeps the limit up when the upstream
// got uniformly slower must not keep it up when the upstream lost
// workers, where the same latencies mean a queue. With a quarter or an
// eighth of the workers left, the limit comes down to about the workers
// left, whatever their speed.
func TestAdaptiveCapacityDrops(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	for _, svc := range []time.Duration{20 * simMs, 200 * simMs, time.Second} {
		for _, w := range []struct{ before, after int }{{32, 8}, {16, 2}} {
			for seed := range uint64(2) {
				// 240 latencies after the drop, at least a minute; the
				// limit is read in the last quarter.
				length := time.Minute + max(time.Minute, 240*svc)
				r := simulate(simConfig{workers: w.before, workersFrom: time.Minute, workersAfter: w.after, service: fixed(svc),
					clients: constClients(64), length: length, seed: seed})
				_, before := r.limitRange(50*time.Second, time.Minute)
				lo, hi := r.limitRange(length-(length-time.Minute)/4, length)
				t.Logf("%v, %d to %d workers, seed %d: limit %d before, %d-%d at the end", svc, w.before, w.after, seed, before, lo, hi)
				if before <= int64(w.before) || lo < int64(w.after) || hi > int64(w.after)+8 {
					t.Errorf("%v, %d to %d workers, seed %d: limit %d before, %d-%d at the end; want above %d, then %d to %d",
						svc, w.before, w.after, seed, before, lo, hi, w.before, w.after, w.after+8)
				}
			}
		}
	}
}

// TestAdaptivePausesAndSlowRequests: a pause of the whole process (a GC
// pause) makes every request in flight slow at once, and a request may be
// slow on its own; neither is overload, nor spare capacity. A controller
// that lowers the limit on one interval's latency, or on a mean, reads
// them as overload; one whose no-load latency follows the last probe
// alone, as spare capacity once a pause has slowed a probe.
//
// Each run is compared with the same run (the same seed) without pauses
// or slow requests: its limit stays above 0.8 of that run's least and
// below twice its most. Over 30 seeds, the controller stays within 0.83
// and 1.61 of them (a pause may be followed by one step up, which the
// next intervals take back). Lowering on one interval's latency goes down
// to 0.73-0.81 with the 200ms pauses; a mean instead of the median, to
// 0.67-0.87 with them and 0.68-0.89 with the slow requests; a no-load
// latency from the last probe alone, up to 3 times with the 50ms pauses
// (in 4 seeds of 10).
func TestAdaptivePausesAndSlowRequests(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	within := func(t *testing.T, what string, r, without simResult, from, to time.Duration) {
		t.Helper()
		lo, hi := r.exactRange(from, to)
		wlo, whi := without.exactRange(from, to)
		t.Logf("%s: limit %.1f-%.1f, %.1f-%.1f without", what, lo, hi, wlo, whi)
		if lo < 0.8*wlo || hi > 2*whi {
			t.Errorf("%s: limit %.1f-%.1f, want within 0.8 × %.1f and 2 × %.1f, the limit without", what, lo, hi, wlo, whi)
		}
	}
	t.Run("pauses", func(t *testing.T) {
		for seed := range uint64(5) {
			cfg := simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(16), length: time.Minute, seed: seed}
			without := simulate(cfg)
			for _, p := range []struct{ pause, every time.Duration }{{200 * simMs, 5 * time.Second}, {50 * simMs, time.Second}} {
				cfg := cfg
				cfg.pause = p.pause
				for at := 10 * time.Second; at < cfg.length; at += p.every {
					cfg.pauses = append(cfg.pauses, at)
				}
				what := fmt.Sprintf("seed %d, a %v pause every %v", seed, p.pause, p.every)
				within(t, what, simulate(cfg), without, 10*time.Second, cfg.length)
			}
		}
	})
	t.Run("slow requests", func(t *testing.T) {
		// One request in 200, at random, takes 1s instead of 100ms (and
		// holds its worker, 5% of the upstream's capacity): intervals
		// in a row sometimes have one each.
		for seed := range uint64(3) {
			cfg := simConfig{workers: 8, service: fixed(100 * simMs), clients: constClients(16), length: 5 * time.Minute, seed: seed}
			without := simulate(cfg)
			cfg.slowOneIn, cfg.slow = 200, time.Second
			within(t, fmt.Sprintf("seed %d, a 1s request in 200", seed), simulate(cfg), without, 30*time.Second, cfg.length)
		}
	})
	t.Run("one slow request per interval", func(t *testing.T) {
		c := newController(4, 1000, nil)
		now := time.Unix(0, 0)
		// Rounds of as many requests as the limit, at a latency with no
		// queue; after the first five, each has one request of 5s: the
		// limit rises as if it were not there.
		for i := range 40 {
			var tks []Ticket
			for range int(c.limit) {
				tk, _ := c.admit(now, 0)
				tks = append(tks, tk)
			}
			now = now.Add(Interval) // one interval a round
			for j, tk := range tks {
				lat := 20 * simMs
				if j == 0 && i >= 5 {
					lat = 5 * time.Second
				}
				c.done(now, tk, SampleOK, lat)
			}
		}
		if c.limit < 100 {
			t.Errorf("limit %v after 40 rounds without a queue but one slow request each: want it far above 100", c.limit)
		}
	})
}

// round admits as many requests as c lets in at now, and gives them back
// after lat, with kind; it returns the instant they ended.
func round(c *controller, now time.Time, lat time.Duration, kind Sample) time.Time {
	tks := admitAll(c, now, 0)
	now = now.Add(lat)
	for _, tk := range tks {
		c.done(now, tk, kind, lat)
	}
	return now
}

// admitAll admits requests of class at now until c refuses one.
func admitAll(c *controller, now time.Time, class int) []Ticket {
	var tks []Ticket
	for {
		tk, ok := c.admit(now, class)
		if !ok {
			return tks
		}
		tks = append(tks, tk)
	}
}

// TestAdaptiveSettlesAfterProbe: when a probe ends, the requests in
// flight are half the limit, and climb back as clients return; until
// they are back, the upstream's queue is shorter than the limit's, and
// its latencies show no queue at all. Taken as samples, they would
// raise the limit by β after probes, and the queue with it, until two
// intervals took it back: a controller that probes often would keep it
// up. Here they are not samples until the requests in flight are back
// to the limit, or for a latency. Clients that wait 100ms after a
// refusal make the climb slow: no probe is followed by a rise of the
// limit beyond two steps of lg (1 at this limit) within 500ms; β is 5.
func TestAdaptiveSettlesAfterProbe(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	for seed := range uint64(3) {
		r := simulate(simConfig{workers: 8, service: fixed(20 * simMs), clients: constClients(16),
			length: 2 * time.Minute, backoff: 100 * simMs, seed: seed})
		rises, probes := 0, 0
		for _, p := range r.probes {
			if p.start < 10*time.Second || p.end == 0 {
				continue
			}
			probes++
			_, before := r.limitRange(p.start-10*simMs, p.start+10*simMs)
			if _, after := r.limitRange(p.end, p.end+500*simMs); after > before+2 {
				rises++
				t.Logf("seed %d: the limit from %d to %d after the probe of %v", seed, before, after, p.start)
			}
		}
		lo, hi := r.limitRange(10*time.Second, 2*time.Minute)
		t.Logf("seed %d: %d probes, %d followed by a rise; limit %d-%d", seed, probes, rises, lo, hi)
		if probes < 30 || rises > 0 {
			t.Errorf("seed %d: %d probes of %d followed by a rise of the limit beyond 2: want none (and 30 probes)", seed, rises, probes)
		}
	}
}

// A request of a probe that never comes back does not keep the probe
// going, nor the controller from learning; and a key's learning started
// again during a probe ignores the probe's requests when they return.
func TestAdaptiveProbeRequests(t *testing.T) {
	t.Parallel() // state of its own, on virtual time
	t.Run("one hangs", func(t *testing.T) {
		c := newController(4, 1000, nil)
		now := time.Unix(0, 0)
		for !c.probing {
			now = round(&c, now, 20*simMs, SampleOK)
		}
		if _, ok := c.admit(now, 0); !ok { // never given back
			t.Fatal("the probe admitted nothing")
		}
		limit := c.limit
		for range 20 {
			now = round(&c, now, 100*simMs, SampleOK) // a queue: the limit falls
		}
		if c.probing || c.limit >= limit {
			t.Errorf("probing %v, limit %v from %v: want the probe over and the limit lower", c.probing, c.limit, limit)
		}
	})
	t.Run("learning starts again", func(t *testing.T) {
		k := &Key{c: newController(4, 1000, nil)}
		now := time.Unix(0, 0)
		for !k.c.probing {
			now = round(&k.c, now, 20*simMs, SampleOK)
		}
		tk, _ := k.Admit(now, 0)
		k.Forget()
		k.Release(now, tk, SampleOK, time.Millisecond)
		for range 100 {
			now = round(&k.c, now, 20*simMs, SampleOK)
		}
		if k.c.inFlight != 0 || k.c.probeOut != 0 || k.c.noLoad != 20*simMs {
			t.Errorf("%d in flight, %d out for the probe, no-load latency %v: want 0, 0, 20ms", k.c.inFlight, k.c.probeOut, k.c.noLoad)
		}
	})
}
