// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package storetest is the conformance suite of the stores, as
// testing/fstest is of file systems: one table of steps that every
// store.Store must decide alike (the bucket math of internal/gcra, all or
// nothing across zones, bans, delays, calendar quotas, dry runs, plans,
// usage, keys' own limits and refunds), which
// the in-memory and the Redis engines' tests replay. It knows nothing of
// Caddy, HTTP or the handler: its zones are ZoneSpecs and its requests
// demands, made as the handler makes them from the same config.
package storetest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A NewStore makes the store a replay runs on, bound to zones (a fresh
// state: its keys were never asked for). clock is the replay's: a store
// that reads a clock of its own (Redis's TIME) reads this one instead; a
// store that decides by the instant Take is given may ignore it.
type NewStore func(t *testing.T, zones []store.ZoneSpec, clock func() time.Time) store.Store

// An Option adds to what Run replays.
type Option func(*options)

type options struct {
	flights func(s store.Store, ds []*store.Demands) ([]bool, []error)
}

// Flights has Run replay the steps once more, on a store of their own,
// with the steps of each instant decided together by take, as one flight
// of requests (the Redis store's pipeline sends a flight in one script
// call): each must be answered as it would be alone, in the table's
// order.
func Flights(take func(s store.Store, ds []*store.Demands) ([]bool, []error)) Option {
	return func(o *options) { o.flights = take }
}

// Run replays the table of steps, then the delay steps, against a store
// that newStore makes for the steps' zones, and fails t at the first
// answer that is not the table's: the decision, the tokens (or units)
// left per zone, a ban started and its wait, a quota's wait for its
// window's end, a delay's wait. Then, each on a store of its own zones,
// it replays the limits that are not a zone's one fixed limit: limits
// that come with each request, costs known after the response, keys' own
// limits, and a refund of an empty bucket (limits.go).
func Run(t *testing.T, newStore NewStore, opts ...Option) {
	t.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	r := newReplay(t, newStore)
	r.steps()
	r.delaySteps()
	t.Run("plans", func(t *testing.T) { planReplay(t, newStore) })
	t.Run("usage", func(t *testing.T) { usageReplay(t, newStore) })
	t.Run("overrides", func(t *testing.T) { overrideReplay(t, newStore) })
	t.Run("refund", func(t *testing.T) { refundReplay(t, newStore) })
	t.Run("reserves", func(t *testing.T) { reserveReplay(t, newStore) })
	if o.flights != nil {
		t.Run("flights", func(t *testing.T) { newReplay(t, newStore).flights(o.flights) })
	}
}

// quotaWindow is the length of the quotas' windows in the steps, which
// start at a window's start.
const quotaWindow = 100 * time.Second

// The zones of the steps, by their letters: a 10r/s burst 3; b 1r/s
// burst 2; c 2r/s burst 4, two tokens a request; d 7r/s burst 7; e 1r/s
// burst 2 with a ban of 10s; f 10r/s burst 2 with a delay of 300ms (the
// delay steps); q a quota of 3 a day alone; r 1r/s burst 2 with a quota
// of 3 a month in Europe/Paris; s 1r/s burst 2 with a ban of 10s and t a
// quota of 2 a day, both in dry run. The quotas' windows are quotaWindow
// long, not a calendar's (calendar.Windows' Every, which only tests
// set): their period and time zone only name their counters.
var zoneConfigs = []zoneConfig{
	{name: 'a', rate: 10, burst: 3},
	{name: 'b', rate: 1, burst: 2},
	{name: 'c', rate: 2, burst: 4, cost: 2},
	{name: 'd', rate: 7, burst: 7},
	{name: 'e', rate: 1, burst: 2, ban: 10 * time.Second},
	{name: 'f', rate: 10, burst: 2, delay: 300 * time.Millisecond},
	{name: 'q', quota: 3, period: "day@UTC"},
	{name: 'r', rate: 1, burst: 2, quota: 3, period: "month@Europe/Paris"},
	{name: 's', rate: 1, burst: 2, ban: 10 * time.Second, dryRun: true},
	{name: 't', quota: 2, period: "day@UTC", dryRun: true},
}

// A zoneConfig is a zone of the steps, as its config says it.
type zoneConfig struct {
	name       byte
	rate       float64 // tokens a second; 0: no bucket
	burst      int64
	cost       int64 // tokens (and quota units) a request; 0: 1
	ban, delay time.Duration
	quota      int64  // units a window; 0: no quota
	period     string // the quota's period and time zone, as a ZoneSpec names them
	dryRun     bool
}

// A zone is a zone of the steps made into what the handler sends a
// store: its bucket's limit and a request's cost, its quota's windows.
type zone struct {
	index    int
	name     string
	limit    gcra.Limit
	cost     int64
	costTime time.Duration
	quota    int64
	windows  *calendar.Windows
	soft     bool // in dry run
}

// makeZones are the zones of the steps, and their specs.
func makeZones() (map[byte]*zone, []store.ZoneSpec) {
	zones := make(map[byte]*zone, len(zoneConfigs))
	specs := make([]store.ZoneSpec, len(zoneConfigs))
	for i, c := range zoneConfigs {
		z := &zone{index: i, name: string(c.name), cost: max(c.cost, 1), quota: c.quota, soft: c.dryRun}
		// A zone without a bucket has the shape the handler gives it: a
		// token a second, which no store reads.
		shape := gcra.NewLimit(1, 1)
		if c.rate > 0 {
			z.limit = gcra.NewLimit(c.rate, c.burst)
			z.limit.Ban, z.limit.Delay = c.ban, c.delay
			z.costTime = z.limit.CostTime(z.cost)
			shape = z.limit
		}
		specs[i] = store.ZoneSpec{Name: z.name, Bucket: c.rate > 0, Shape: shape, Quota: c.period, MaxOverrides: store.DefaultMaxOverrides}
		if c.quota > 0 {
			z.windows = &calendar.Windows{Every: quotaWindow}
		}
		zones[c.name] = z
	}
	return zones, specs
}

// A replay is a store the table is replayed against, on the replay's
// clock.
type replay struct {
	t     *testing.T
	s     store.Store
	zones map[byte]*zone
	// The steps start at the start of a quota window, in the future:
	// Redis expires a quota's counter at its window's end by its own
	// clock.
	start time.Time
	now   time.Time // the store's clock
}

func newReplay(t *testing.T, newStore NewStore) *replay {
	t.Helper()
	w := int64(quotaWindow)
	r := &replay{t: t, start: time.Unix(0, time.Now().Add(quotaWindow).UnixNano()/w*w)}
	var specs []store.ZoneSpec
	r.zones, specs = makeZones()
	r.s = newStore(t, specs, func() time.Time { return r.now })
	return r
}

// steps replays the table of steps one by one.
func (r *replay) steps() {
	r.t.Helper()
	for i, s := range steps {
		r.now = r.start.Add(s.at)
		d, as := r.demands(s, false)
		ok, err := r.s.Take(context.Background(), r.now, d)
		r.check(fmt.Sprintf("step %d", i), s, ok, err, as)
	}
}

// delaySteps replays the delay steps, which the table of steps leaves
// zone f to.
func (r *replay) delaySteps() {
	r.t.Helper()
	for i, s := range delaySteps {
		r.now = r.start.Add(s.at)
		name := fmt.Sprintf("delay step %d", i)
		d, as := r.demands(s.step, s.noDelay)
		if s.refund {
			for j := range d.Buckets {
				d.Buckets[j].Cost = -d.Buckets[j].Cost
			}
			if err := r.s.Adjust(context.Background(), r.now, d); err != nil {
				r.t.Fatalf("%s: refund: %v", name, err)
			}
			continue
		}
		ok, err := r.s.Take(context.Background(), r.now, d)
		r.check(name, s.step, ok, err, as)
		for j := range as {
			a := &as[j]
			if s.ok && a.delayed() != s.delays[j] {
				r.t.Fatalf("%s: zone %s delays %v, want %v", name, a.zone.name, a.delayed(), s.delays[j])
			}
			if !s.ok && !a.ok() && a.wait() != s.wait {
				r.t.Fatalf("%s: zone %s: wait %v, want %v", name, a.zone.name, a.wait(), s.wait)
			}
		}
	}
}

// flights replays the table of steps with the steps of each instant
// decided together by take.
func (r *replay) flights(take func(s store.Store, ds []*store.Demands) ([]bool, []error)) {
	r.t.Helper()
	flights := 0
	for i := 0; i < len(steps); {
		j := i + 1
		for j < len(steps) && steps[j].at == steps[i].at {
			j++
		}
		r.now = r.start.Add(steps[i].at)
		ds, as := make([]*store.Demands, j-i), make([][]answer, j-i)
		for n, s := range steps[i:j] {
			ds[n], as[n] = r.demands(s, false)
		}
		allowed, errs := take(r.s, ds)
		for n, s := range steps[i:j] {
			r.check(fmt.Sprintf("step %d (in a flight of %d)", i+n, j-i), s, allowed[n], errs[n], as[n])
		}
		if j-i > 1 {
			flights++
		}
		i = j
	}
	if flights < 5 {
		r.t.Fatalf("only %d flights of more than one step", flights)
	}
}

// check fails the replay when a step's answer is not the table's: an
// error, the decision, the tokens left per zone, a ban started (and its
// wait: the ban and a token), a quota that counts (its wait: until its
// window's end).
func (r *replay) check(name string, s step, ok bool, err error, as []answer) {
	r.t.Helper()
	if err != nil {
		r.t.Fatalf("%s: %v", name, err)
	}
	if ok != s.ok {
		r.t.Fatalf("%s: allowed = %v, want %v", name, ok, s.ok)
	}
	for j := range as {
		a := &as[j]
		if got := a.remaining(); got != s.rem[j] {
			r.t.Fatalf("%s: zone %s has %d tokens left, want %d", name, a.zone.name, got, s.rem[j])
		}
		if want := strings.IndexByte(s.ban, s.zones[j]) >= 0; a.ban() != want {
			r.t.Fatalf("%s: zone %s started a ban: %v, want %v", name, a.zone.name, a.ban(), want)
		}
		if a.ban() && a.wait() != a.zone.limit.Ban+a.zone.costTime {
			r.t.Fatalf("%s: zone %s: wait %v after a ban started, want the ban and a token", name, a.zone.name, a.wait())
		}
		// A quota that counts waits for its window's end (Redis counts
		// in whole milliseconds, its over-limit cache a millisecond
		// less).
		if a.quota && a.counter().Used > 0 {
			if want := a.counter().Window.End.Sub(r.now); a.debt() > want || a.debt() <= want-2*time.Millisecond {
				r.t.Fatalf("%s: zone %s's quota: %v to its window's end, want %v", name, a.zone.name, a.debt(), want)
			}
		}
	}
}

// demands are the demands of step s's letters at the replay's instant
// (with noDelay, as if its zones had no delay: the handler lets no more
// requests wait), as the handler makes them, and the view of each
// letter's answer.
func (r *replay) demands(s step, noDelay bool) (*store.Demands, []answer) {
	d := new(store.Demands)
	as := make([]answer, 0, len(s.zones))
	k := store.Key{Text: s.key}
	for _, c := range []byte(s.zones) {
		if c >= 'A' && c <= 'Z' { // the quota of the zone of that letter
			z := r.zones[c-'A'+'a']
			as = append(as, answer{zone: z, d: d, i: len(d.Counters), quota: true})
			d.Counters = append(d.Counters, store.CounterDemand{Zone: z.index, Key: k, Limit: z.quota, Cost: z.cost,
				Window: z.windows.Window(r.now), Soft: z.soft})
			continue
		}
		z := r.zones[c]
		l := z.limit
		l.NoDelay = noDelay
		as = append(as, answer{zone: z, d: d, i: len(d.Buckets)})
		d.Buckets = append(d.Buckets, store.BucketDemand{Zone: z.index, Key: k, Limit: l, Cost: z.costTime, Soft: z.soft})
	}
	return d, as
}

// An answer is one letter of a step, in the step's demands: a zone's
// bucket, or, for an upper-case letter, its quota's counter.
type answer struct {
	zone  *zone
	d     *store.Demands
	i     int // its place in d.Buckets, or in d.Counters
	quota bool
}

func (a *answer) bucket() *store.BucketDemand { return &a.d.Buckets[a.i] }

func (a *answer) counter() *store.CounterDemand { return &a.d.Counters[a.i] }

func (a *answer) remaining() int64 {
	if a.quota {
		return a.counter().Remaining()
	}
	return a.bucket().Remaining()
}

func (a *answer) ok() bool {
	if a.quota {
		return a.counter().OK
	}
	return a.bucket().OK
}

func (a *answer) ban() bool { return !a.quota && a.bucket().Ban }

func (a *answer) wait() time.Duration {
	if a.quota {
		return a.counter().Wait()
	}
	return a.bucket().Wait()
}

func (a *answer) delayed() time.Duration {
	if a.quota {
		return 0
	}
	return a.bucket().Delayed()
}

// debt is how long until the bucket is full again, or the counter's
// window ends.
func (a *answer) debt() time.Duration {
	if a.quota {
		return a.counter().Left
	}
	return a.bucket().Debt
}
