// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"slices"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// loop reconciles every interval, and a last time when the zone goes.
func (sz *SyncZone) loop() {
	defer close(sz.done)
	tick := time.NewTicker(sz.interval)
	defer tick.Stop()
	for {
		select {
		case <-sz.stop:
			sz.reconcile()
			return
		case <-tick.C:
			sz.reconcile()
		}
	}
}

// A syncItem is a copy in a reconciliation: the tokens it sends, counted
// in its limit base.
type syncItem struct {
	c      *syncCopy
	sh     *syncShard
	base   gcra.Limit
	tokens int64
}

// reconcile sends Redis what each copy that was asked or spent since the
// last reconciliation spent, as adjustments, syncFlight to a script call,
// and sets the copies from the answers; and drops the copies that have
// had their day (see sweep). Its work follows the copies used since the
// last one, not the copies held: an idle zone costs a lock of each shard.
// While Redis is down (its breaker open), what the copies spend waits
// for the next, forgiven beyond two intervals of refill or a request's
// cost (see owe).
func (sz *SyncZone) reconcile() {
	u, ok := sz.owner()
	if !ok {
		return
	}
	up := u.s.client.Up()
	n := sz.instant(time.Now())
	batch := sz.batch[:0]
	defer func() { clear(batch); sz.batch = batch[:0] }()
	for i := range sz.shards {
		sh := &sz.shards[i]
		sh.mu.Lock()
		sz.sweep(sh, n)
		if up {
			batch = sz.collect(sh, batch)
		}
		sh.mu.Unlock()
	}
	own := len(batch) > 0 && sz.ownLimits(u)
	for sent := 0; sent < len(batch); {
		if !u.s.client.Up() {
			// Redis went away meanwhile: the rest waits for the next.
			for i := range batch[sent:] {
				p := &batch[sent+i]
				p.sh.mu.Lock()
				sz.unsent(p, false)
				p.sh.mu.Unlock()
			}
			return
		}
		part := batch[sent:min(len(batch), sent+syncFlight)]
		sent += len(part)
		sz.send(u, part, own)
	}
}

// collect appends to batch the copies of sh used since the last
// reconciliation, each with what it spent, which it now sends. Requires
// sh.mu.
func (sz *SyncZone) collect(sh *syncShard, batch []syncItem) []syncItem {
	for _, c := range sh.used {
		c.used = false
		if sh.m[c.key] != c {
			continue // reset meanwhile: its key's next request goes to Redis
		}
		batch = append(batch, syncItem{c, sh, c.base, c.pending})
		c.sent, c.pending = c.pending, 0
	}
	sz.visited.Add(uint64(len(sh.used)))
	clear(sh.used)
	sh.used = sh.used[:0]
	return batch
}

// sweep drops the copies of sh whose check is due at n and that have had
// their day: no request used them since the last reconciliation, their
// bucket is full, and Redis last answered for them more than keep ago.
// It checks the others again keep later: each copy is looked at once
// every keep, from when it is made, so that what the sweep costs an
// interval is the copies made or checked keep earlier, not all those
// held. Requires sh.mu.
func (sz *SyncZone) sweep(sh *syncShard, n time.Duration) {
	visited := uint64(0)
	for c := sh.expiry.pop(n); c != nil; c = sh.expiry.pop(n) {
		visited++
		switch {
		case sh.m[c.key] != c: // reset: gone already
		case !c.used && n-c.heard > sz.keep() && c.fullAt <= n:
			delete(sh.m, c.key)
			sz.size.Add(-1)
		default:
			sh.expiry.push(c, n+sz.keep())
		}
	}
	sz.visited.Add(visited)
}

// ownLimits reports whether a reconciliation must read its keys' own
// limits (overrides): unless Redis says, asked now, that the zone has
// none. A count costs Redis one command a reconciliation where reading
// would cost one a key; an override set through another instance
// meanwhile is read by the next reconciliation, an interval later.
func (sz *SyncZone) ownLimits(u syncUser) bool {
	at := time.Since(processStart).Nanoseconds()
	u.s.pollOverrides(u.zone, at)
	c := u.s.zones[u.zone].overridden.Load()
	return c.n != 0 || c.at < at
}

// send reconciles part in one flight, reading the keys' own limits if
// own. An adjustment refuses nothing, so each bucket is charged as it
// would be alone, and part goes as one adjustment of all its buckets: one
// script call on one Redis; on a cluster, one per hash tag among them
// (part is sorted by hash for it).
func (sz *SyncZone) send(u syncUser, part []syncItem, own bool) {
	s := u.s
	if s.client.Cluster {
		slices.SortFunc(part, func(a, b syncItem) int { return strings.Compare(a.c.hash, b.c.hash) })
	}
	deadline := time.Now().Add(s.opt.CallTimeout)
	bs := slices.Grow(sz.bs[:0], len(part))[:len(part)]
	defer func() { clear(bs); sz.bs = bs[:0] }()
	var ds []store.Demands
	var calls []*rediswire.Call
	for i := range part {
		p := &part[i]
		// The script applies the key's own limit itself (see build).
		bs[i] = store.BucketDemand{Zone: u.zone, Limit: p.base, Cost: time.Duration(p.tokens) * p.base.TokenTime}
		if i == 0 || s.client.Cluster && p.c.hash != part[i-1].c.hash {
			ds = append(ds, store.Demands{Buckets: bs[i:i]})
			calls = append(calls, rediswire.NewCall(rediswire.Adjust, deadline))
		}
		d := &ds[len(ds)-1]
		d.Buckets = d.Buckets[:len(d.Buckets)+1] // bs[i], the call's next bucket
		limit := p.c.limitKey
		if !own {
			limit = p.c.hash // the script reads no override
		}
		calls[len(calls)-1].AdjustBucket(p.c.hash, p.c.field, limit, s.shapeOf(&bs[i], true), bs[i].Cost)
	}
	sent := time.Now()
	replies, errs := s.client.RunAll(calls)
	var failure error
	var failed uint64
	i := 0
	for j := range ds {
		_, err := s.answered(replies[j], errs[j], sent, rediswire.Adjust, &ds[j])
		if err != nil {
			failure = cmpErr(failure, err)
			failed++
		}
		for k := range ds[j].Buckets {
			sz.update(u, &part[i], &ds[j], k, err)
			i++
		}
	}
	// The metrics count script calls: one per hash tag on a cluster.
	sz.calls.Add(uint64(len(calls)))
	sz.failed.Add(failed)
	sz.keys.Add(uint64(len(part)))
	switch kind := rediswire.Classify(failure); {
	case failure == nil || kind == rediswire.Answered:
		s.client.Answered(s.opt.Logger)
		if failure != nil {
			s.keyErrors.Warn(s.opt.Logger, "redis refused a reconciliation of zone "+s.zones[u.zone].name, failure)
		}
	case kind != rediswire.Unknown: // an Unknown failure says nothing of Redis
		s.client.Failed(s.opt.Logger, failure)
	}
}

// update sets p's copy from bucket k of d, the answer of its call, or
// keeps what it sent for the next reconciliation when the call failed.
func (sz *SyncZone) update(u syncUser, p *syncItem, d *store.Demands, k int, err error) {
	b := &d.Buckets[k]
	p.sh.mu.Lock()
	c := p.c
	if err != nil {
		sz.unsent(p, rediswire.InDoubt(err))
	} else {
		c.sent = 0
		n := sz.instant(time.Now())
		c.learnt(sz.instant(d.At), n, b.Debt, b.Limit, c.pending)
	}
	p.sh.mu.Unlock()
	if err == nil && b.Overridden {
		u.s.sawOverride(u.zone)
	}
}

// owe adds tokens to what c spent here and has not sent, for the next
// reconciliation to send. Requires sh.mu, c's shard's lock. away says
// that they wait for Redis because Redis could not take them: decided
// here while it was away (its breaker open, the request's call failed,
// or the copy has calls in doubt), or sent in a reconciliation that
// failed or was not made. What waits so is forgiven beyond two intervals
// of refill, or one request's cost when that is more, as fail_mode local
// forgets what its buckets spent: no allowance held an outage's spending
// back, and all of it charged to the shared bucket at once would refuse
// the keys used during the outage for up to syncOwe intervals after.
// Spending that Redis could have taken (within the allowance, while it
// answers) is always sent whole: the bound counts on it.
//
// doubt says that the tokens went in a call that failed in doubt: Redis
// may have run it, or may run it later (a frozen Redis thawing), so they
// are not sent again, and count against what may still go up: the copy
// then decides here, sending nothing to Redis but its reconciliations,
// until Redis answers for the key again, so that one call at most is in
// doubt for it.
func (sz *SyncZone) owe(sh *syncShard, c *syncCopy, tokens int64, away, doubt bool) {
	if doubt {
		c.doubt += tokens
	} else {
		c.pending += tokens
	}
	if away || doubt {
		c.pending = min(c.pending, max(sz.forgiven(c)-c.doubt, 0))
	}
	sh.use(c)
}

// forgiven is what of c's spending while Redis was away may go up, in
// tokens: two intervals of refill, or one request's cost when that is
// more.
func (sz *SyncZone) forgiven(c *syncCopy) int64 {
	return max(int64(2*sz.interval/c.lim.TokenTime), c.cost, 1)
}

// unsent puts back what p's copy sent in a call that failed or was not
// made, for the next reconciliation to send again, with the shared state
// to learn: Redis could not take it (see owe); or, for a call that
// failed in doubt, counts it in doubt. Requires p.sh.mu.
func (sz *SyncZone) unsent(p *syncItem, doubt bool) {
	tokens := p.c.sent
	p.c.sent = 0
	sz.owe(p.sh, p.c, tokens, true, doubt)
}
