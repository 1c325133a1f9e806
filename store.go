// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
)

// A store keeps the state of zones: a token bucket, a calendar quota
// counter and a count of slots in use per key. It decides demands on that
// state in its own terms and knows nothing of HTTP or of the handler: the
// handler turns each matching zone of a request into demands, and the
// answers into a response. Dry runs, counters, events and headers are the
// handler's.
type store interface {
	// bind prepares the store for zones. A demand's zone is its place in
	// zones. It is called once, from the handler's Provision, after the
	// store's own.
	bind(zones []zoneSpec) error

	// take decides d all together: it charges every bucket and counter
	// and takes every slot, or does none of it (the one write a refusal
	// makes is a ban, in the bucket that refused). It sets each demand's
	// answer, and reports whether all were allowed. now is the request's
	// arrival; a store may keep its own clock.
	take(ctx context.Context, now time.Time, d *demands) (bool, error)

	// adjust charges each bucket and counter of d its demand's cost,
	// refusing nothing: a bucket up to what its limit lets it owe, a
	// counter past its limit. A negative cost gives back, and never
	// shortens a ban. ctx is the request's: an adjustment completes when
	// the client has gone.
	adjust(ctx context.Context, now time.Time, d *demands) error

	// release gives back the slots that take took.
	release(ctx context.Context, slots []slotDemand) error

	// peek sets the answers of d from the state, changing nothing.
	peek(ctx context.Context, now time.Time, d *demands) error

	// reset forgets the state of d's buckets and counters: a bucket is
	// full again, a counter at 0. It reports whether any was not.
	reset(ctx context.Context, d *demands) (bool, error)

	// stats reports what the store keeps for a zone, for the admin API
	// and metrics.
	stats(zone int) zoneStats

	// setOverride gives key its own limit in a zone with a bucket, in
	// place of the zone's (or its plan's), carrying its bucket over (see
	// overrides.go) as of now. It fails with errTooManyOverrides when the
	// zone has its max_overrides already and key has none.
	setOverride(ctx context.Context, now time.Time, zone int, key bucketKey, o override) error
	// deleteOverride gives key the zone's limit back, and reports whether
	// it had its own.
	deleteOverride(ctx context.Context, now time.Time, zone int, key bucketKey) (bool, error)
	// override is key's own limit, if it has one.
	override(ctx context.Context, zone int, key bucketKey) (override, bool, error)
	// overrides lists the zone's overrides, and overrideCount counts them.
	overrides(ctx context.Context, zone int) ([]keyOverride, error)
	overrideCount(ctx context.Context, zone int) (int, error)
}

// A zoneSpec is what a store knows of a zone: how its state is named,
// shared and shaped.
type zoneSpec struct {
	name string
	// bucket: the zone has a token bucket per key, of shape when its
	// limit is fixed (the zero limit when each request brings its own).
	bucket bool
	shape  gcra.Limit
	// quota names the zone's calendar windows (period and time zone): ""
	// for a zone without a quota. Counters of one name and quota are
	// shared, whatever the quota's limit.
	quota string
	// slots: the zone limits requests in flight.
	slots bool
	// refunds: tokens may be given back to the zone's buckets (adjust with
	// a negative cost), on any instance sharing the store.
	refunds bool
	// maxOverrides: the most keys with a limit of their own (overrides).
	maxOverrides int64
	// sync: the zone's buckets are decided from this instance's copies,
	// reconciled with the shared ones this often (see sync.go); 0 for
	// none.
	sync time.Duration
}

// demands are what one request asks of a store: tokens from buckets,
// units of calendar counters, and slots.
type demands struct {
	buckets  []bucketDemand
	counters []counterDemand
	slots    []slotDemand
	// The answer. at is the local instant the answers hold at: a
	// bucket's debt is what it owes then (the store decided no later).
	// remembered: the store refused the demands from what it had learnt
	// before, without deciding them anew (the Redis store's over-limit
	// cache).
	at         time.Time
	remembered bool
}

func (d *demands) clear() {
	d.buckets, d.counters, d.slots = d.buckets[:0], d.counters[:0], d.slots[:0]
	d.at, d.remembered = time.Time{}, false
}

func (d *demands) empty() bool { return len(d.buckets)+len(d.counters)+len(d.slots) == 0 }

// A bucketDemand asks a zone's bucket of key for tokens worth cost.
type bucketDemand struct {
	zone  int
	key   bucketKey
	limit gcra.Limit    // the bucket's shape
	cost  time.Duration // what the tokens are worth (limit.costTime); adjust: negative to give back
	// floor: the bucket owes at least this much now, as another store knew
	// it (fail_mode local's buckets start from what Redis said).
	floor time.Duration
	// soft: a bucket without the tokens refuses nothing; it is charged
	// nothing, and answers not ok (a zone in dry run). A refusal starts
	// its ban as any bucket's.
	soft bool

	// The answer.
	ok   bool          // the bucket had the tokens (or, with a delay, will have them within it)
	ban  bool          // this refusal started the bucket's ban
	debt time.Duration // how long until the bucket is full again, after the decision
	// overridden: the key's own limit decided, and the store put it in
	// limit and cost (an override: see overrides.go); baseToken and
	// baseBurst are the rate and burst it replaced.
	overridden bool
	baseBurst  int64
	baseToken  time.Duration
}

// setOwnLimit makes b's limit the key's own, of a token's time tokenTime
// and burst: its limit, and its cost counted in that limit's tokens.
func (b *bucketDemand) setOwnLimit(tokenTime time.Duration, burst int64) {
	if !b.overridden {
		b.baseToken, b.baseBurst, b.overridden = b.limit.TokenTime, b.limit.Burst, true
	}
	b.cost = b.cost / b.limit.TokenTime * tokenTime
	b.limit = b.limit.With(tokenTime, burst)
}

// clearOwnLimit gives b back the limit an override replaced, when the
// store found none.
func (b *bucketDemand) clearOwnLimit() {
	if b.overridden {
		b.cost = b.baseCost()
		b.limit, b.overridden = b.base(), false
	}
}

// baseCost is b's cost counted in the tokens of the limit an override
// replaced (rounded up): what a store that applies overrides itself is
// sent.
func (b *bucketDemand) baseCost() time.Duration {
	if !b.overridden {
		return b.cost
	}
	t := b.limit.TokenTime
	n := b.cost / t
	if b.cost%t > 0 {
		n++
	}
	return n * b.baseToken
}

// base is the limit an override replaced.
func (b *bucketDemand) base() gcra.Limit { return b.limit.With(b.baseToken, b.baseBurst) }

// wait is how long the bucket needs before it can give the tokens (or,
// with a delay, before a take of them would wait no longer than the
// delay).
func (b *bucketDemand) wait() time.Duration { return b.limit.Wait(b.debt, b.cost) }

// delayed is how long an allowed request waits for the bucket's tokens.
func (b *bucketDemand) delayed() time.Duration {
	if !b.ok || b.limit.NoDelay {
		return 0
	}
	return b.limit.Delayed(b.debt)
}

// remaining is the number of whole tokens left in the bucket.
func (b *bucketDemand) remaining() int64 { return b.limit.WholeTokens(b.debt) }

// A counterDemand asks a zone's calendar quota counter of key for cost
// units in the current window.
type counterDemand struct {
	zone   int
	key    bucketKey
	limit  int64            // units per window
	cost   int64            // units the request counts; adjust: negative to take off
	window *calendar.Window // the window by this instance's clock
	soft   bool             // a counter without the units refuses nothing, and counts nothing (dry run)

	// The answer.
	ok   bool
	used int64         // the count in its window, after the decision
	left time.Duration // how long until the window ends; 0 while nothing is counted
}

// remaining is the number of units left in the counter's window.
func (c *counterDemand) remaining() int64 { return max(c.limit-c.used, 0) }

// wait is how long until the counter can count the request: the end of
// its window, when it lacks the units.
func (c *counterDemand) wait() time.Duration {
	if c.used+c.cost > c.limit {
		return c.left
	}
	return 0
}

// A slotDemand asks for one of a zone's slots of key: a request in
// flight.
type slotDemand struct {
	zone  int
	key   bucketKey
	limit int64         // slots per key
	lease time.Duration // how long a store shared between instances holds the slot at most
	soft  bool          // when no slot is free, the other demands are decided without this one

	// The answer.
	held  bool   // the request holds a slot, for release
	free  int64  // slots free after the decision
	full  bool   // no slot was free, while the other demands were allowed
	claim string // what the store holds the slot by (a lease), for release
}

// zoneStats is what a store reports of one zone.
type zoneStats struct {
	// The keys the store tracks in this process (buckets and counters),
	// and the buckets it evicted before they refilled; nil when it does
	// not track keys here. capacity is the most keys it keeps (max_keys).
	keys      *int
	evictions *uint64
	capacity  int
	// table identifies what keys and evictions count: zones that share a
	// table report it alike, and are counted once.
	table any
	// overLimitCache: the store refuses some demands from what it learnt
	// before (demands.remembered).
	overLimitCache bool
	// client identifies the store's connection, shared by the stores of a
	// setup, and unavailable says whether it is down now (its circuit
	// breaker is open); nil for a store without one.
	client      any
	unavailable bool
}

// fallible is a store that can fail, and says what to do then.
type fallible interface {
	failMode() failMode
	// known is how long b's bucket owes at least at now, from what the
	// store last learnt of it (0 when it knows nothing), after the store
	// failed with err: fail_mode local's buckets start from there, so
	// that a client that emptied its bucket does not get a fresh one
	// when a call fails.
	known(now time.Time, b *bucketDemand, err error) time.Duration
}

// A holder is a store whose Cleanup would close what its requests use
// (the Redis store's client). Caddy cleans a config up while its last
// requests still run; each request that asks the store holds it until
// it ends, so that what it does after its decision (its settlement after
// the response, its slots given back) reaches the store as it was, and
// the store lets go of its client when the last of them ends.
type holder interface {
	// hold keeps the store for a request until done; false when the
	// store has let go already (a request that reached the handler after
	// its config's Cleanup and its last request), and done must not be
	// called.
	hold() bool
	done()
}

// A failMode is what the handler does when a fallible store fails.
type failMode uint8

const (
	failLocal  failMode = iota // decide with in-memory buckets
	failOpen                   // allow
	failClosed                 // answer 503
)

var failModes = map[string]failMode{"local": failLocal, "open": failOpen, "closed": failClosed}
