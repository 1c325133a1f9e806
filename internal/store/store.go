// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package store is the contract between the handler and its stores: the
// demands a request makes of a store (tokens from buckets, units of
// calendar counters, slots), their answers, what a store knows of a zone
// and reports of it, and the keys' own limits (overrides). It knows
// nothing of HTTP, Caddy or the handler's zones: a zone is an index and a
// ZoneSpec.
package store

import (
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
)

// A Store keeps the state of zones: a token bucket, a calendar quota
// counter and a count of slots in use per key. A demand's zone is its
// place in the zones the store was made for (a ZoneSpec each). It decides demands on that
// state in its own terms and knows nothing of HTTP or of the handler: the
// handler turns each matching zone of a request into demands, and the
// answers into a response. Dry runs, counters, events and headers are the
// handler's.
type Store interface {
	// Take decides d all together: it charges every bucket and counter
	// and takes every slot, or does none of it (the one write a refusal
	// makes is a ban, in the bucket that refused). It sets each demand's
	// answer, and reports whether all were allowed. now is the request's
	// arrival; a store may keep its own clock.
	Take(ctx context.Context, now time.Time, d *Demands) (bool, error)

	// Adjust charges each bucket and counter of d its demand's cost,
	// refusing nothing: a bucket up to what its limit lets it owe, a
	// counter past its limit. A negative cost gives back, and never
	// shortens a ban. ctx is the request's: an adjustment completes when
	// the client has gone.
	Adjust(ctx context.Context, now time.Time, d *Demands) error

	// Release gives back the slots that Take took.
	Release(ctx context.Context, slots []SlotDemand) error

	// Peek sets the answers of d from the state, changing nothing.
	Peek(ctx context.Context, now time.Time, d *Demands) error

	// Reset forgets the state of d's buckets and counters: a bucket is
	// full again, a counter at 0. It reports whether any was not.
	Reset(ctx context.Context, d *Demands) (bool, error)

	// Stats reports what the store keeps for a zone, for the admin API
	// and metrics.
	Stats(zone int) ZoneStats

	// SetOverride gives key its own limit in a zone with a bucket, in
	// place of the zone's (or its plan's), carrying its bucket over (see
	// gcra.Limit.Retune) as of now. It fails with ErrTooManyOverrides when the
	// zone has its max_overrides already and key has none.
	SetOverride(ctx context.Context, now time.Time, zone int, key Key, o Override) error
	// DeleteOverride gives key the zone's limit back, and reports whether
	// it had its own.
	DeleteOverride(ctx context.Context, now time.Time, zone int, key Key) (bool, error)
	// Override is key's own limit, if it has one.
	Override(ctx context.Context, zone int, key Key) (Override, bool, error)
	// Overrides lists the zone's overrides, and OverrideCount counts them.
	Overrides(ctx context.Context, zone int) ([]KeyOverride, error)
	OverrideCount(ctx context.Context, zone int) (int, error)
}

// A ZoneSpec is what a store knows of a zone: how its state is named,
// shared and shaped.
type ZoneSpec struct {
	Name string
	// Bucket: the zone has a token bucket per key, of Shape when its
	// limit is fixed (the zero limit when each request brings its own).
	Bucket bool
	Shape  gcra.Limit
	// Quota names the zone's calendar windows (period and time zone): ""
	// for a zone without a quota. Counters of one name and quota are
	// shared, whatever the quota's limit.
	Quota string
	// Slots: the zone limits requests in flight.
	Slots bool
	// Refunds: tokens may be given back to the zone's buckets (adjust with
	// a negative cost), on any instance sharing the store.
	Refunds bool
	// MaxOverrides: the most keys with a limit of their own (overrides).
	MaxOverrides int64
	// Sync: the zone's buckets are decided from this instance's copies,
	// reconciled with the shared ones this often; 0 for none.
	Sync time.Duration
	// Share: the zone's busy buckets are decided from shares of their
	// tokens that this instance takes in advance, each lasting this long;
	// 0 for none.
	Share time.Duration
}

// Demands are what one request asks of a store: tokens from buckets,
// units of calendar counters, and slots.
type Demands struct {
	Buckets  []BucketDemand
	Counters []CounterDemand
	Slots    []SlotDemand
	// The answer. At is the local instant the answers hold at: a
	// bucket's debt is what it owes then (the store decided no later).
	// Remembered: the store refused the demands from what it had learnt
	// before, without deciding them anew (the Redis store's over-limit
	// cache).
	At         time.Time
	Remembered bool
}

// Clear empties d, keeping its slices' room.
func (d *Demands) Clear() {
	d.Buckets, d.Counters, d.Slots = d.Buckets[:0], d.Counters[:0], d.Slots[:0]
	d.At, d.Remembered = time.Time{}, false
}

// Soft reports whether every demand of d is soft: d can refuse nothing.
func (d *Demands) Soft() bool {
	for i := range d.Buckets {
		if !d.Buckets[i].Soft {
			return false
		}
	}
	for i := range d.Counters {
		if !d.Counters[i].Soft {
			return false
		}
	}
	for i := range d.Slots {
		if !d.Slots[i].Soft {
			return false
		}
	}
	return true
}

// Empty reports whether d asks for nothing.
func (d *Demands) Empty() bool { return len(d.Buckets)+len(d.Counters)+len(d.Slots) == 0 }

// A BucketDemand asks a zone's bucket of key for tokens worth cost.
type BucketDemand struct {
	Zone  int
	Key   Key
	Limit gcra.Limit    // the bucket's shape
	Cost  time.Duration // what the tokens are worth (Limit.CostTime); Adjust: negative to give back
	// Floor: the bucket owes at least this much now, as another store knew
	// it (fail_mode local's buckets start from what Redis said).
	Floor time.Duration
	// Soft: a bucket without the tokens refuses nothing; it is charged
	// nothing, and answers not ok (a zone in dry run). A refusal starts
	// its ban as any bucket's.
	Soft bool

	// The answer.
	OK   bool          // the bucket had the tokens (or, with a delay, will have them within it)
	Ban  bool          // this refusal started the bucket's ban
	Debt time.Duration // how long until the bucket is full again, after the decision
	// Overridden: the key's own limit decided, and the store put it in
	// Limit and Cost (an Override, with SetOwnLimit); baseToken and
	// baseBurst are the rate and burst it replaced, and baseKept what the
	// request's class kept of the bucket under them.
	Overridden bool
	baseBurst  int64
	baseToken  time.Duration
	baseKept   time.Duration
}

// SetOwnLimit makes b's limit the key's own, of a token's time tokenTime
// and burst: its limit, and its cost counted in that limit's tokens.
func (b *BucketDemand) SetOwnLimit(tokenTime time.Duration, burst int64) {
	if !b.Overridden {
		b.baseToken, b.baseBurst, b.baseKept, b.Overridden = b.Limit.TokenTime, b.Limit.Burst, b.Limit.Kept, true
	}
	b.Cost = b.Cost / b.Limit.TokenTime * tokenTime
	b.Limit = b.Base().With(tokenTime, burst)
}

// ClearOwnLimit gives b back the limit an override replaced, when the
// store found none.
func (b *BucketDemand) ClearOwnLimit() {
	if b.Overridden {
		b.Cost = b.BaseCost()
		b.Limit, b.Overridden = b.Base(), false
	}
}

// BaseCost is b's cost counted in the tokens of the limit an override
// replaced (rounded up): what a store that applies overrides itself is
// sent.
func (b *BucketDemand) BaseCost() time.Duration {
	if !b.Overridden {
		return b.Cost
	}
	t := b.Limit.TokenTime
	n := b.Cost / t
	if b.Cost%t > 0 {
		n++
	}
	return n * b.baseToken
}

// Base is the limit an override replaced.
func (b *BucketDemand) Base() gcra.Limit {
	l := b.Limit.With(b.baseToken, b.baseBurst)
	l.Kept = b.baseKept
	return l
}

// Wait is how long the bucket needs before it can give the tokens (or,
// with a delay, before a take of them would wait no longer than the
// delay).
func (b *BucketDemand) Wait() time.Duration { return b.Limit.Wait(b.Debt, b.Cost) }

// Delayed is how long an allowed request waits for the bucket's tokens.
func (b *BucketDemand) Delayed() time.Duration {
	if !b.OK || b.Limit.NoDelay {
		return 0
	}
	return b.Limit.Delayed(b.Debt)
}

// Remaining is the number of whole tokens left in the bucket.
func (b *BucketDemand) Remaining() int64 { return b.Limit.WholeTokens(b.Debt) }

// A CounterDemand asks a zone's calendar quota counter of key for cost
// units in the current window.
type CounterDemand struct {
	Zone   int
	Key    Key
	Limit  int64            // units per window
	Cost   int64            // units the request counts; Adjust: negative to take off
	Window *calendar.Window // the window by this instance's clock
	Soft   bool             // a counter without the units refuses nothing, and counts nothing (dry run)

	// The answer.
	OK   bool
	Used int64         // the count in its window, after the decision
	Left time.Duration // how long until the window ends; 0 while nothing is counted
}

// Remaining is the number of units left in the counter's window.
func (c *CounterDemand) Remaining() int64 { return max(c.Limit-c.Used, 0) }

// Wait is how long until the counter can count the request: the end of
// its window, when it lacks the units.
func (c *CounterDemand) Wait() time.Duration {
	if c.Used+c.Cost > c.Limit {
		return c.Left
	}
	return 0
}

// A SlotDemand asks for one of a zone's slots of key: a request in
// flight.
type SlotDemand struct {
	Zone  int
	Key   Key
	Limit int64         // slots per key
	Lease time.Duration // how long a store shared between instances holds the slot at most
	Soft  bool          // when no slot is free, the other demands are decided without this one

	// The answer.
	Held  bool   // the request holds a slot, for release
	Free  int64  // slots free after the decision
	Full  bool   // no slot was free, while the other demands were allowed
	Claim string // what the store holds the slot by (a lease), for release
}

// ZoneStats is what a store reports of one zone.
type ZoneStats struct {
	// The keys the store tracks in this process (buckets and counters),
	// and the buckets it evicted before they refilled; nil when it does
	// not track keys here. Capacity is the most keys it keeps (max_keys).
	Keys      *int
	Evictions *uint64
	Capacity  int
	// Table identifies what keys and evictions count: zones that share a
	// table report it alike, and are counted once.
	Table any
	// OverLimitCache: the store refuses some demands from what it learnt
	// before (Demands.Remembered).
	OverLimitCache bool
	// Client identifies the store's connection, shared by the stores of a
	// setup, and Unavailable says whether it is down now (its circuit
	// breaker is open); nil for a store without one.
	Client      any
	Unavailable bool
	// SyncCopies identifies the copies that a zone with sync decides
	// from, nil for none: zones that share them report them alike, and
	// are counted once. SyncCalls, SyncFailed and SyncKeys count their
	// reconciliations' script calls, those that failed and the keys they
	// carried, and SyncHeld the copies held now.
	SyncCopies                      any
	SyncCalls, SyncFailed, SyncKeys uint64
	SyncHeld                        int64
	// Shares identifies the shares of a zone with share, nil for none;
	// for such a zone: the shares granted (renewals included),
	// returned and written off (they ended unreturned), the requests
	// decided here from a share or a remembered refusal and by Redis,
	// and the keys tracked.
	Shares                                    any
	ShareGrants, ShareReturns, ShareWriteOffs uint64
	ShareHere, ShareRedis                     uint64
	ShareKeys                                 int64
}

// A Fallible store can fail, and says what to do then.
type Fallible interface {
	// FailureMode is what the handler does when the store fails.
	FailureMode() FailMode
	// Known is how long b's bucket owes at least at now, from what the
	// store last learnt of it (0 when it knows nothing), after the store
	// failed with err: fail_mode local's buckets start from there, so
	// that a client that emptied its bucket does not get a fresh one
	// when a call fails.
	Known(now time.Time, b *BucketDemand, err error) time.Duration
}

// A Holder is a store whose Cleanup would close what its requests use
// (the Redis store's client). Caddy cleans a config up while its last
// requests still run; each request that asks the store holds it until
// it ends, so that what it does after its decision (its settlement after
// the response, its slots given back) reaches the store as it was, and
// the store lets go of its client when the last of them ends.
type Holder interface {
	// Hold keeps the store for a request until Done; false when the
	// store has let go already (a request that reached the handler after
	// its config's Cleanup and its last request), and Done must not be
	// called.
	Hold() bool
	Done()
}

// A Sharer is a store with zones with share: it tells a key's shared
// state, for the admin API.
type Sharer interface {
	ShareState(ctx context.Context, zone int, key Key) (ShareState, error)
}

// ShareState is what a Sharer knows of a key's bucket in a zone with
// share: the tokens out in every share (not reported spent) and how many
// shares hold them, as Redis keeps them, and this instance's share: what
// it holds and how long until it ends here (0 for none).
type ShareState struct {
	Out     time.Duration
	Holders int
	Here    time.Duration
	EndsIn  time.Duration
}

// A FailMode is what the handler does when a Fallible store fails.
type FailMode uint8

const (
	FailLocal  FailMode = iota // decide with in-memory buckets
	FailOpen                   // allow
	FailClosed                 // answer 503
)

// FailModes are the fail modes by their names in a config.
var FailModes = map[string]FailMode{"local": FailLocal, "open": FailOpen, "closed": FailClosed}

// A Key names one bucket (and counter, and slot set) within a zone: an
// IP network (Net) when the zone's key expanded to an IP address, else
// the expanded string (Text).
type Key struct {
	Text string
	Net  netip.Prefix
}

// String is the key as the admin API and Redis name it: its text, an IP
// address, or a network in CIDR notation.
func (k Key) String() string {
	if !k.Net.IsValid() {
		return k.Text
	}
	if k.Net.IsSingleIP() {
		return k.Net.Addr().String()
	}
	return k.Net.String()
}

// Hash is the keyed hash that stands for k in a table of keys hashed
// with sk. String keys
// hash with SipHash. An IP network of at most 64 bits (any IPv4 network;
// IPv6 up to the usual /64) is one 64-bit word, which a keyed bijection
// maps to its hash: two networks of one family and length never share an
// entry, and the hash costs a few multiplications. (A zone's networks
// all have one length per family.) The two families are mapped by
// different bijections, longer IPv6 networks by SipHash under a key of
// their own, so keys of different kinds share an entry only by a chance
// of 1 in 2⁶⁴, as SipHash's do.
func (k Key) Hash(sk siphash.Key) uint64 {
	if !k.Net.IsValid() {
		return siphash.Sum(sk, k.Text)
	}
	b := k.Net.Addr().AsSlice() // inlined, it allocates nothing (As16 costs 10 ns more)
	if len(b) == 4 {
		return siphash.Mix64(uint64(binary.BigEndian.Uint32(b))^sk[0]) ^ sk[1]
	}
	bits := uint64(k.Net.Bits())
	if bits <= 64 {
		return siphash.Mix64(binary.BigEndian.Uint64(b)^sk[1]) ^ sk[0]
	}
	words := [2]uint64{binary.LittleEndian.Uint64(b), binary.LittleEndian.Uint64(b[8:])}
	return siphash.SumWords(siphash.Key{sk[0], sk[1] ^ 1}, words[:], 17<<56|bits)
}

// An Override is a key's own limit.
type Override struct {
	TokenTime time.Duration // 1/rate
	Burst     int64
	Rate      string    // the rate as it was given, for the admin API
	Expires   time.Time // when it ends by itself; zero: when it is removed
}

// Limit is base with o's rate and burst.
func (o Override) Limit(base gcra.Limit) gcra.Limit { return base.With(o.TokenTime, o.Burst) }

// A KeyOverride is an override and the key it is for, as a store lists
// them.
type KeyOverride struct {
	Key      string
	Override Override
}

// DefaultMaxOverrides is how many overrides a zone keeps at most by
// default.
const DefaultMaxOverrides = 100_000

// ErrTooManyOverrides refuses an override beyond a zone's max_overrides.
var ErrTooManyOverrides = errors.New("the zone has max_overrides overrides already")
