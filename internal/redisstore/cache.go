// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"maps"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// The Redis store's over-limit cache: what this instance learnt of the
// buckets that Redis found short, so that it can deny their requests
// without asking (DESIGN: the exact over-limit cache), and the calls in
// flight per bucket, so that a flood asks Redis once per bucket at a
// time.

// fromCache denies the request without asking Redis when one of its
// buckets is known to lack the tokens. When Redis last answered for a
// bucket at local instant t with debt d, the bucket cannot be fuller than
// a bucket full at t+d: tokens only come back at the zone's rate, and
// other instances only take them. With a delay, the bound is the same
// and the take's condition moves by the delay, as in Redis. (One give-back
// escapes it: a client that leaves while its request waits out a delay
// on another instance gets its tokens back there, which this cache
// learns when its entry runs out, as it learns of an admin reset.)
//
// The same bound says how many requests a bucket could let through now
// (its whole burst when the cache knows nothing of it), and no more calls
// than that go to Redis for the bucket at once: requests beyond it wait
// for an answer and look again. An attacker's concurrency then does not
// multiply the calls to Redis, for a fresh bucket or for one whose
// cached instant has just passed. A request waits for the store's
// timeout at most, then fail_mode decides it.
//
// fromCache returns the instant to ask Redis at and the flight it joined
// (to land when the answer is in); or that the cache decided the request,
// and whether it allowed it; or why no answer came in time.
func (s *Store) fromCache(ctx context.Context, now time.Time, d *store.Demands) (_ time.Time, _ flightKey, decided, allowed bool, _ error) {
	deadline := now.Add(s.opt.CallTimeout)
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		tight, most, pace := s.look(now, d)
		if decided, allowed := s.cacheDecides(d); decided {
			d.At = now
			return now, flightKey{}, true, allowed, nil
		}
		if tight < 0 {
			return now, noFlight, false, false, nil // counters alone: no bucket to fly for
		}
		var landed <-chan struct{}
		var k flightKey
		if pace <= 0 || !now.Add(pace).Before(deadline) {
			b := &d.Buckets[tight]
			k = flightKey{b.Zone, s.zones[b.Zone].cache.Hash(b.Key)}
			if landed = s.flights.join(k, max(most, 1)); landed == nil {
				return now, k, false, false, nil
			}
		}
		if timer == nil {
			timer = time.NewTimer(deadline.Sub(now))
		}
		var paced <-chan time.Time
		if landed == nil {
			paced = time.After(pace)
		}
		waitStart := time.Now()
		select {
		case <-landed:
		case <-paced:
		case <-ctx.Done():
			return now, flightKey{}, false, false, ctx.Err()
		case <-timer.C:
			return now, flightKey{}, false, false, errNoAnswer
		}
		now = now.Add(time.Since(waitStart))
	}
}

// look sets d's answers from what the cache knows at now. It returns the
// bucket that lets the fewest requests through now (-1 without buckets),
// how many, and how long to wait before asking Redis is worth it.
func (s *Store) look(now time.Time, d *store.Demands) (tight int, most int64, pace time.Duration) {
	for i := range d.Counters {
		// A counter only grows in its window (but for refunds, and
		// resets), so the count Redis last gave is a bound too, for a
		// while (see rememberCount).
		c := &d.Counters[i]
		t := s.zones[c.Zone].counts
		c.Used, _ = memstore.CountAt(t, c.Key, t.Instant(now))
		c.Left = 0
		if c.Used > 0 {
			c.Left = max(c.Window.End.Sub(now), 0)
		}
		c.OK = c.Used+c.Cost <= c.Limit
	}
	rtt := s.client.RTT()
	if s.opt.Clock != nil {
		rtt = 0 // replayed instants leave no room to wait
	}
	tight, most = -1, int64(math.MaxInt64)
	for i := range d.Buckets {
		b := &d.Buckets[i]
		rz := &s.zones[b.Zone]
		t := rz.cache
		known, _ := t.Lookup(b.Key)
		if rz.learned.n.Load() > 0 {
			rz.learned.apply(b, t.Hash(b.Key), t.Instant(now))
		}
		l := b.Limit
		fullAt, n := known.FullAt, t.Instant(now)
		if known.Full != l.BurstTime {
			// Learnt under another limit (the key's plan changed): Redis
			// rescales it, which no bound from the old limit foresees.
			fullAt = 0
		}
		_, b.OK = l.Take(fullAt, n, b.Cost)
		b.Debt = l.Debt(fullAt, n)
		if m := int64((l.Reach() - b.Debt) / b.Cost); m < most {
			tight, most = i, m
		}
		if fullAt != 0 && n-known.UsedAt > trusted(l) {
			// Learnt too long ago to refuse by (the bucket may have been
			// reset since): Redis is asked again, the bound still
			// keeping the calls in flight to what it lets through.
			b.OK = true
			continue
		}
		// The bound counts from when the last call was sent, Redis from
		// when it ran, up to a round trip later: a call sent within a
		// round trip of the bound would mostly find the bucket still
		// short. Wait out that round trip instead.
		if fullAt != 0 {
			pace = max(pace, fullAt-l.Reach()+b.Cost+rtt-n)
		}
	}
	return tight, most, pace
}

// errNoAnswer is a request that waited out its timeout for the calls in
// flight for its buckets; they report Redis's health, this request not.
var errNoAnswer = errors.New("redis: no answer within timeout")

// cacheDecides reports whether the cache decides d, whether it allows it,
// and says so in d.remembered. It refuses d when a demand that is not
// soft lacks; it allows d when every demand is soft and lacks, so that
// nothing would be charged (a flood of a zone in dry run asks Redis
// nothing). A bucket with a ban that the cache finds short but not
// banned sends the request to Redis instead: the refusal that starts a
// ban is Redis's to make, once for every instance. So does a zone whose
// buckets or counters get tokens back (count): other instances' refunds
// give them back faster than the rate, so only a ban (which refunds never
// shorten) is a bound the cache can refuse by.
func (s *Store) cacheDecides(d *store.Demands) (decided, allowed bool) {
	denied, charged := false, len(d.Slots) > 0
	for i := range d.Counters {
		c := &d.Counters[i]
		if !c.OK && s.zones[c.Zone].refunds {
			return false, false
		}
		denied = denied || !c.OK && !c.Soft
		charged = charged || c.OK
	}
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if l := b.Limit; !b.OK && (l.Ban > 0 || s.zones[b.Zone].refunds) && !l.Banned(b.Debt) {
			return false, false
		}
		denied = denied || !b.OK && !b.Soft
		charged = charged || b.OK
	}
	d.Remembered = denied || !charged
	return d.Remembered, !denied
}

// remember notes, for fromCache, the buckets of a request that Redis
// left without the tokens for another such request; the request's other
// buckets are noted too, so that a refusal from the cache still reports
// them in the headers. When Redis left them all with the tokens, the
// cache forgets them (it only ever refuses, so forgetting is always
// safe), unless other requests wait for this answer in flight: then they
// learn from it how many of them may ask at once.
func (s *Store) remember(now time.Time, d *store.Demands, flight flightKey) {
	short := false
	for i := range d.Buckets {
		short = short || d.Buckets[i].Wait() > 0
	}
	for i := range d.Counters {
		short = short || d.Counters[i].Wait() > 0
		s.rememberCount(now, &d.Counters[i])
	}
	forget := !short && !s.flights.waited(flight)
	for i := range d.Buckets {
		b := &d.Buckets[i]
		rz := &s.zones[b.Zone]
		t := rz.cache
		if b.Overridden {
			rz.learned.learn(t.Hash(b.Key), b.Limit, t.Instant(now))
		} else if rz.learned.n.Load() > 0 {
			rz.learned.forget(t.Hash(b.Key))
		}
		if forget {
			t.Forget(b.Key)
			continue
		}
		learn(t, b.Key, t.Instant(now)+b.Debt, b.Limit.BurstTime, t.Instant(now))
	}
}

// learn notes that a bucket is full again at fullAt, under a limit of
// whole bucket full, as the answer to a call sent at now says: it replaces what an answer to an earlier call
// said, whatever that was (the bucket may have been reset since), and an
// answer to an earlier call than the one noted changes nothing.
func learn(t *memstore.Table[memstore.Bucket], k store.Key, fullAt, full, now time.Duration) {
	t.Update(k, now, func(b memstore.Bucket, tracked bool) (memstore.Bucket, bool) {
		return memstore.Bucket{FullAt: fullAt, UsedAt: now, Full: full}, !tracked || b.UsedAt <= now
	})
}

// overLimitTrust is how long the cache refuses by what Redis last said,
// at most: a reset through another instance (or another instance's
// refund of a request that left while it waited out a delay) is seen
// here within it, or within a token's refill when that is shorter. It
// costs a flooded key one call to Redis per period, whatever the flood.
const overLimitTrust = time.Second

// trusted is how long what Redis said of a bucket of limit l is refused
// by.
func trusted(l gcra.Limit) time.Duration { return min(overLimitTrust, l.TokenTime) }

// quotaCacheFor is how long this instance refuses an exhausted quota by
// itself, without asking Redis. A count only grows in its window, but a
// reset through another instance's admin API lowers it: such a reset is
// seen here within this time.
const quotaCacheFor = overLimitTrust

// rememberCount notes the count Redis gave for a counter, asked at now,
// for quotaCacheFor at most, and never past the end of its window, which
// ends c.left after now at the latest (Redis decided after now), less a
// millisecond of margin. A count of 0 is forgotten.
func (s *Store) rememberCount(now time.Time, c *store.CounterDemand) {
	t := s.zones[c.Zone].counts
	if c.Used <= 0 || c.Left <= time.Millisecond {
		t.Forget(c.Key)
		return
	}
	n := t.Instant(now)
	t.Update(c.Key, n, func(e memstore.Counter, tracked bool) (memstore.Counter, bool) {
		if tracked && !e.Spent(n) && e.Used > c.Used {
			return e, false // a later answer came in first
		}
		return memstore.Counter{EndAt: n + min(c.Left-time.Millisecond, quotaCacheFor), Used: c.Used}, true
	})
}

// learnedOverrides are the keys' own limits (overrides) that Redis's
// answers told this instance, by the cache's hash of the key, so that
// the cache computes a bucket with the limit Redis decides it by. What
// was learnt more than overLimitTrust ago is not used: an override set
// or removed elsewhere is seen within that time, as a reset is.
type learnedOverrides struct {
	n  atomic.Int64 // len(m): the cache looks only when some are known
	mu sync.Mutex
	m  map[uint64]learnedOverride
}

type learnedOverride struct {
	tokenTime time.Duration
	burst     int64
	at        time.Duration // the cache's instant it was learnt at
}

// apply puts in b the limit learnt for its key's hash h, if it is recent.
func (lo *learnedOverrides) apply(b *store.BucketDemand, h uint64, now time.Duration) {
	lo.mu.Lock()
	o, ok := lo.m[h]
	lo.mu.Unlock()
	if ok && now-o.at <= overLimitTrust {
		b.SetOwnLimit(o.tokenTime, o.burst)
	}
}

// learn notes the own limit l of the key of hash h. Beyond
// overLimitCacheKeys of them, the stale ones go, or all.
func (lo *learnedOverrides) learn(h uint64, l gcra.Limit, now time.Duration) {
	lo.mu.Lock()
	defer lo.mu.Unlock()
	if lo.m == nil {
		lo.m = make(map[uint64]learnedOverride)
	}
	if len(lo.m) >= overLimitCacheKeys {
		maps.DeleteFunc(lo.m, func(_ uint64, o learnedOverride) bool { return now-o.at > overLimitTrust })
		if len(lo.m) >= overLimitCacheKeys {
			clear(lo.m)
		}
	}
	lo.m[h] = learnedOverride{l.TokenTime, l.Burst, now}
	lo.n.Store(int64(len(lo.m)))
}

// forget drops what was learnt of the key of hash h.
func (lo *learnedOverrides) forget(h uint64) {
	if lo.n.Load() == 0 {
		return
	}
	lo.mu.Lock()
	defer lo.mu.Unlock()
	delete(lo.m, h)
	lo.n.Store(int64(len(lo.m)))
}

// noFlight is the flight of a request with no bucket to fly for.
var noFlight = flightKey{zone: -1}

// flights are the Redis calls in flight for the buckets of the requests
// that the over-limit cache looks at.
type flights struct {
	mu sync.Mutex
	m  map[flightKey]flight
}

type flightKey struct {
	zone int
	hash uint64
}

// A flight is the calls in flight for one bucket.
type flight struct {
	calls  int64
	landed chan struct{} // closed when a call lands; nil until a request waits
}

// join makes the caller one of k's calls in flight, if fewer than most
// are, and returns nil: the caller lands k when its answer is in.
// Otherwise it returns a channel closed when one of them lands.
func (fs *flights) join(k flightKey, most int64) <-chan struct{} {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[k]
	if f.calls >= most {
		if f.landed == nil {
			f.landed = make(chan struct{})
			fs.m[k] = f
		}
		return f.landed
	}
	f.calls++
	fs.m[k] = f
	return nil
}

// calls is the number of k's calls in flight.
func (fs *flights) calls(k flightKey) int64 {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.m[k].calls
}

// waited reports whether a request waits for one of k's calls.
func (fs *flights) waited(k flightKey) bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.m[k].landed != nil
}

func (fs *flights) land(k flightKey) {
	if k == noFlight {
		return
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[k]
	if f.landed != nil {
		close(f.landed)
		f.landed = nil
	}
	if f.calls--; f.calls == 0 {
		delete(fs.m, k)
		return
	}
	fs.m[k] = f
}
