// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"
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
// (to land when the answer is in); or that the request is denied; or why
// no answer came in time.
func (s *RedisStore) fromCache(ctx context.Context, now time.Time, reqs []request) (time.Time, flightKey, bool, error) {
	deadline := now.Add(s.callTimeout)
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	rtt := s.client.RTT()
	if s.testClock != nil {
		rtt = 0 // replayed instants leave no room to wait
	}
	for {
		tight, most := 0, int64(math.MaxInt64)
		var pace time.Duration
		for i := range reqs {
			q := &reqs[i]
			if q.win != nil {
				// A quota's counter only grows in its window (but for
				// refunds, and resets), so the count Redis last gave is
				// a bound too, for a while (see rememberCount).
				t := s.zones[q.zone.index].counts
				n := t.instant(now)
				used, _ := t.count(q.key, n)
				q.used, q.debt = used, 0
				if used > 0 {
					q.debt = max(q.win.end.Sub(now), 0)
				}
				q.ok = used+q.zone.Cost <= q.zone.quota.limit
				continue
			}
			p := q.plan()
			t, l := s.zones[q.zone.index].cache, q.limit()
			fullAt, n := t.get(q.key), t.instant(now)
			if fullAt-n > l.burstTime+l.ban+l.delay {
				// The bucket owes more than the request's limit holds:
				// its plan changed. Redis clamps it to the new burst
				// (which no bound from the old plan foresees): ask.
				fullAt = 0
			}
			_, q.ok = l.take(fullAt, n, p.costTime)
			q.debt = l.debt(fullAt, n)
			if m := int64((l.reach() - q.debt) / p.costTime); m < most {
				tight, most = i, m
			}
			// The bound counts from when the last call was sent, Redis
			// from when it ran, up to a round trip later: a call sent
			// within a round trip of the bound would mostly find the
			// bucket still short. Wait out that round trip instead.
			if fullAt != 0 {
				pace = max(pace, fullAt-l.reach()+p.costTime+rtt-n)
			}
		}
		if s.cacheDenied(reqs) {
			return now, flightKey{}, true, nil
		}
		if reqs[tight].win != nil {
			return now, noFlight, false, nil // quotas alone: no bucket to fly for
		}
		var landed <-chan struct{}
		var k flightKey
		if pace <= 0 || !now.Add(pace).Before(deadline) {
			q := &reqs[tight]
			k = flightKey{q.zone.index, s.zones[q.zone.index].cache.hash(q.key)}
			if landed = s.flights.join(k, max(most, 1)); landed == nil {
				return now, k, false, nil
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
			return now, flightKey{}, false, ctx.Err()
		case <-timer.C:
			return now, flightKey{}, false, errNoAnswer
		}
		now = now.Add(time.Since(waitStart))
	}
}

// errNoAnswer is a request that waited out its timeout for the calls in
// flight for its buckets; they report Redis's health, this request not.
var errNoAnswer = errors.New("redis: no answer within timeout")

// cacheDenied counts the zones that the cache refused, and reports
// whether there was one. A zone with a ban whose bucket the cache finds
// short but not banned sends the request to Redis instead: the denial
// that starts a ban is Redis's to make, once for every instance. So does
// a zone with count: other instances' refunds give its tokens back faster
// than its rate, so only a ban (which refunds never shorten) is a bound
// the cache can deny by.
func (s *RedisStore) cacheDenied(reqs []request) bool {
	denied := false
	for i := range reqs {
		q := &reqs[i]
		if !q.ok && q.win != nil && q.zone.Count != nil {
			return false
		}
		if l := q.plan().limit; !q.ok && q.win == nil && (l.ban > 0 || q.zone.Count != nil) && !l.banned(q.debt) {
			return false
		}
		denied = denied || !q.ok
	}
	if denied {
		for i := range reqs {
			if !reqs[i].ok {
				reqs[i].zone.state.cacheHits.Add(1)
			}
		}
	}
	return denied
}

// remember notes, for fromCache, the buckets of a request that Redis
// left without the tokens for another such request; the request's other
// buckets are noted too, so that a denial from the cache still reports
// them in the headers. When Redis left them all with the tokens, the
// cache forgets them (it only ever denies, so forgetting is always safe),
// unless other requests wait for this answer in flight: then they learn
// from it how many of them may ask at once.
func (s *RedisStore) remember(now time.Time, reqs []request, flight flightKey) {
	short := false
	for i := range reqs {
		short = short || reqs[i].wait() > 0
	}
	forget := !short && !s.flights.waited(flight)
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			s.rememberCount(now, q)
			continue
		}
		t := s.zones[q.zone.index].cache
		if forget {
			t.forget(q.key)
			continue
		}
		n := t.instant(now)
		if l := q.plan().limit; q.zone.plans != nil && t.get(q.key)-n > l.burstTime+l.ban {
			t.forget(q.key) // learnt under another plan: Redis clamped it
		}
		t.raise(q.key, n+q.debt, n)
	}
}

// quotaCacheFor is how long this instance refuses an exhausted quota by
// itself, without asking Redis. A count only grows in its window, but a
// reset through another instance's admin API lowers it, and a window
// lasts up to a month: such a reset is seen here within this time.
const quotaCacheFor = 5 * time.Second

// rememberCount notes the count Redis gave for a quota, sent at now, for
// quotaCacheFor at most, and never past the window that ends debt after:
// no sooner than that, since Redis decided after now (and a millisecond
// sooner, as it counts in whole ones). A count of 0 is forgotten.
func (s *RedisStore) rememberCount(now time.Time, q *request) {
	t := s.zones[q.zone.index].counts
	if q.used <= 0 || q.debt <= time.Millisecond {
		t.forget(q.key)
		return
	}
	h, n := t.hash(q.key), t.instant(now)
	sh := t.shard(h)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if b, ok := sh.buckets[h]; ok && b.fullAt > n && int64(b.usedAt) > q.used {
		return // a later answer came in first
	}
	sh.setCount(t, h, n+min(q.debt-time.Millisecond, quotaCacheFor), q.used, n)
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
