// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"time"
)

// A store keeps token buckets and takes tokens from them. Stores know
// nothing of HTTP: the handler turns a request into store requests, one
// per matching zone, and the store's answers into a response.
type store interface {
	// bind prepares the store for the handler's zones. It is called once,
	// from the handler's Provision, after the store's own.
	bind(zones []*Zone) error

	// take decides reqs together: it charges every bucket or none, and
	// starts the ban of a zone with a ban that denies a bucket not banned
	// yet. It sets each request's ok, ban and debt, and reports whether
	// all were allowed.
	// now is the request's arrival; a store may keep its own clock.
	take(ctx context.Context, now time.Time, reqs []request) (bool, error)

	// refund gives each request's cost back to its bucket, which take
	// charged, unless the bucket is banned: a ban is never shortened.
	// ctx is the request's: a refund completes when the client has gone.
	refund(ctx context.Context, now time.Time, reqs []request) error

	// peek sets q.debt from the bucket's state, changing nothing.
	peek(ctx context.Context, now time.Time, q *request) error

	// reset fills the bucket. It reports whether the bucket was not full.
	reset(ctx context.Context, q *request) (bool, error)
}

// A request asks a store for a zone's cost in tokens from one bucket,
// or, for a zone's calendar quota, for its cost in units of the key's
// counter in the current window (see quota.go).
type request struct {
	zone *Zone
	key  bucketKey
	// pl is the limit the request is decided by: its plan, in a zone
	// whose limit depends on the request; nil stands for the zone's own.
	pl  *plan
	win *quotaWindow // a quota's window by this instance's clock; nil: a bucket

	ok        bool          // the bucket had the tokens
	ban       bool          // this denial started a ban
	debt      time.Duration // how long until the bucket is full, after the decision
	wouldDeny bool          // a dry-run zone that refused the request
	used      int64         // a quota's count in its window, after the decision
	// noDelay: the zone's delay does not apply (the handler's waiting
	// room is full): the request is decided as if the delay were 0.
	noDelay bool
}

// limit is the shape the request is decided by: its plan's, taking as if
// without the delay when noDelay.
func (q *request) limit() limit {
	l := q.plan().limit
	l.noDelay = q.noDelay
	return l
}

// isQuota reports whether the request is for the zone's calendar quota.
func (q *request) isQuota() bool { return q.win != nil }

// denied reports whether the request's zone refused it, dry runs aside.
func (q *request) denied() bool { return !q.ok && !q.wouldDeny }

// plan is the limit the request is decided by.
func (q *request) plan() *plan {
	if q.pl != nil {
		return q.pl
	}
	return q.zone.plan
}

// wait is how long the request's bucket needs before it can give the
// tokens (or, with a delay, before a take of them would wait no longer
// than the delay).
func (q *request) wait() time.Duration {
	if q.win != nil {
		if q.used+q.zone.Cost > q.zone.quota.limit {
			return q.debt
		}
		return 0
	}
	p := q.plan()
	return q.limit().wait(q.debt, p.costTime)
}

// delayed is how long an allowed request waits for this zone's tokens
// (a quota never delays).
func (q *request) delayed() time.Duration {
	if !q.ok || q.wouldDeny || q.noDelay || q.win != nil {
		return 0
	}
	return q.plan().limit.delayed(q.debt)
}

// remaining is the number of whole tokens left in the request's bucket.
func (q *request) remaining() int64 {
	if q.win != nil {
		return max(q.zone.quota.limit-q.used, 0)
	}
	return q.plan().limit.wholeTokens(q.debt)
}

// capacity is the most the request's bucket or quota window holds.
func (q *request) capacity() int64 {
	if q.win != nil {
		return q.zone.quota.limit
	}
	return q.plan().limit.burst
}

// nextUnit is how long until the request's bucket holds one more whole
// token, or its quota is whole again: 0 when either is full.
func (q *request) nextUnit() time.Duration {
	if q.win != nil {
		return q.debt
	}
	return q.plan().limit.nextToken(q.debt)
}

// A slotKeeper is a store that keeps the slots of zones with concurrency
// itself, shared as its buckets are, and decides them in the same call as
// the buckets. (The handler keeps the slots of other stores in memory.)
type slotKeeper interface {
	// takeWithSlots is take, with a slot of every zone of slots: it
	// charges every bucket and takes every slot, or does neither. A zone
	// in dry run whose slots are all held lets the request go on without
	// one. It sets each slot's free, full and lease.
	takeWithSlots(ctx context.Context, now time.Time, reqs []request, slots []slot) (bool, error)

	// releaseSlots gives back the slots that takeWithSlots took (those
	// with a lease).
	releaseSlots(ctx context.Context, slots []slot) error

	// slotsInUse is how many slots of q's key are held now.
	slotsInUse(ctx context.Context, q *slot) (int64, error)
}

// fallible is a store that can fail, and says what to do then.
type fallible interface {
	failMode() failMode
	// known is how long q's bucket owes at least at now, from what the
	// store last learnt of it (0 when it knows nothing), after the store
	// failed with err: fail_mode local's buckets start from there, so
	// that a client that emptied its bucket does not get a fresh one
	// when a call fails.
	known(now time.Time, q *request, err error) time.Duration
}

// A failMode is what the handler does when a fallible store fails.
type failMode uint8

const (
	failLocal  failMode = iota // decide with in-memory buckets
	failOpen                   // allow
	failClosed                 // answer 503
)

var failModes = map[string]failMode{"local": failLocal, "open": failOpen, "closed": failClosed}
