// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
)

// A headerMode says which rate-limit header families a handler sends.
type headerMode uint8

const (
	headersBoth headerMode = iota
	headersLegacy
	headersIETF
	headersOff
)

// headerModes are the values of Handler.Headers. The empty string, not
// in it, means both: the zero headerMode.
var headerModes = map[string]headerMode{
	"both":   headersBoth,
	"legacy": headersLegacy,
	"ietf":   headersIETF,
	"off":    headersOff,
}

// A standing is what a bucket's or a counter's answer tells the client,
// for the headers and the 429.
type standing struct {
	zone      int
	key       store.Key
	denied    bool          // it refused the request, dry runs aside
	wait      time.Duration // how long until the request could go on
	remaining int64         // whole tokens, or units, left
	capacity  int64         // the most it holds
	debt      time.Duration // how long until it is full again, or its window ends
	end       time.Time     // for a counter that counts: when its window ends
	full      time.Duration // how long its bucket takes to refill from empty: jitter's bound
}

func (h *Handler) bucketStanding(m *match, b *store.BucketDemand) standing {
	return standing{zone: b.Zone, key: b.Key, denied: !b.OK && !m.wouldDeny, wait: b.Wait(), remaining: b.Remaining(),
		capacity: b.Limit.Capacity(), debt: b.Debt, full: b.Limit.BurstTime}
}

func (h *Handler) counterStanding(m *match, c *store.CounterDemand) standing {
	q := standing{zone: c.Zone, key: c.Key, denied: !c.OK && !m.wouldDeny, wait: c.Wait(), remaining: c.Remaining(),
		capacity: c.Limit, debt: c.Left, full: h.Zones[c.Zone].limit.BurstTime}
	if c.Used > 0 {
		q.end = c.Window.End
	}
	return q
}

// respond sets what the response says of the request's zones: the most
// constrained of them (sc.top, which a refusal speaks for too), and the
// headers.
func (h *Handler) respond(hdr http.Header, now time.Time, sc *scratch) {
	sc.top = h.mostConstrained(sc)
	h.writeHeaders(hdr, now, sc)
}

// mostConstrained picks the bucket or counter that speaks for the
// response, in sc.std: of the refusing ones, the one that makes the
// client wait longest; if all allowed (dry runs aside), the one with the
// fewest whole tokens left. It is nil for a request of slots alone.
func (h *Handler) mostConstrained(sc *scratch) *standing {
	var top *standing
	for i := range sc.matches {
		m := &sc.matches[i]
		if m.bucket >= 0 {
			if q := h.bucketStanding(m, &sc.d.Buckets[m.bucket]); top == nil || q.before(top) {
				sc.std, top = q, &sc.std
			}
		}
		if m.counter >= 0 {
			if q := h.counterStanding(m, &sc.d.Counters[m.counter]); top == nil || q.before(top) {
				sc.std, top = q, &sc.std
			}
		}
	}
	return top
}

// before reports whether q speaks for the response rather than top.
func (q *standing) before(top *standing) bool {
	switch {
	case q.denied != top.denied:
		return q.denied
	case q.denied:
		return q.wait > top.wait
	}
	return q.remaining < top.remaining || q.remaining == top.remaining && q.debt > top.debt
}

// writeHeaders sets the rate-limit headers for the decided request: the
// legacy X-RateLimit-* trio for the most constrained zone (sc.top), and
// one RateLimit and RateLimit-Policy item per bucket, counter and set of
// slots.
//
// RateLimit's t is, as draft-ietf-httpapi-ratelimit-headers-10 defines
// it, the seconds until more quota is available: until the bucket holds
// one more whole token than r (0 when it is full), which on a 429 is
// never later than Retry-After. X-RateLimit-Reset is when the bucket is
// full again. A calendar quota's t is the seconds until its window ends
// (0 while nothing is counted), and its RateLimit-Policy w the length of
// its current window.
func (h *Handler) writeHeaders(hdr http.Header, now time.Time, sc *scratch) {
	if h.headerMode == headersOff {
		return
	}
	// All values go into one buffer and become one string, sliced.
	b := sc.buf[:0]
	var ends [5]int
	legacy := h.headerMode != headersIETF && sc.top != nil
	if legacy {
		top := sc.top
		b = strconv.AppendInt(b, top.capacity, 10)
		ends[0] = len(b)
		b = strconv.AppendInt(b, top.remaining, 10)
		ends[1] = len(b)
		// When it is full again: a counter's window's end exactly,
		// whichever clock counted it.
		reset := now.Add(top.debt)
		if !top.end.IsZero() {
			reset = top.end
		}
		b = strconv.AppendInt(b, reset.Add(time.Second-1).Unix(), 10)
		ends[2] = len(b)
	}
	if h.headerMode != headersLegacy {
		b = h.appendPolicies(b, sc)
		ends[3] = len(b)
		b = h.appendItems(b, sc)
		ends[4] = len(b)
	}
	sc.buf = b
	s := string(b)
	vals := make([]string, 5)
	start := 0
	set := func(i int, name string) {
		vals[i] = s[start:ends[i]]
		hdr[name] = vals[i : i+1 : i+1]
		start = ends[i]
	}
	if legacy {
		set(0, "X-Ratelimit-Limit")
		set(1, "X-Ratelimit-Remaining")
		set(2, "X-Ratelimit-Reset")
	}
	if h.headerMode != headersLegacy {
		set(3, "Ratelimit-Policy")
		set(4, "Ratelimit")
	}
}

// appendPolicies appends the RateLimit-Policy items: each bucket's and
// counter's, zone by zone, then each zone's slots.
func (h *Handler) appendPolicies(b []byte, sc *scratch) []byte {
	n := 0
	for i := range sc.matches {
		m := &sc.matches[i]
		z := h.Zones[m.zone]
		if m.bucket >= 0 {
			b = sep(b, &n)
			// A class below others sees the burst less their reserves,
			// refilled in its own time.
			if q := &sc.d.Buckets[m.bucket]; z.plans != nil || q.Overridden || q.Limit.Kept > 0 {
				b = appendPolicy(b, z.quotedName, q.Limit.Capacity(), ceilSeconds(q.Limit.Room()))
			} else {
				b = append(b, z.policy...)
			}
		}
		if m.counter >= 0 {
			// A quota's policy: its limit and its window's length, which
			// for a month or a day with a change of daylight saving time
			// is that window's own.
			b = sep(b, &n)
			b = appendPolicy(b, z.quotedName, z.quota.limit, sc.d.Counters[m.counter].Window.Seconds)
		}
	}
	for i := range sc.matches {
		if m := &sc.matches[i]; m.slot >= 0 {
			b = sep(b, &n)
			b = append(b, h.Zones[m.zone].slotPolicy...)
		}
	}
	return b
}

// appendItems appends the RateLimit items, in the order of the policies.
func (h *Handler) appendItems(b []byte, sc *scratch) []byte {
	n := 0
	for i := range sc.matches {
		m := &sc.matches[i]
		z := h.Zones[m.zone]
		if m.bucket >= 0 {
			q := &sc.d.Buckets[m.bucket]
			b = appendItem(sep(b, &n), z.quotedName, q.Remaining(), ceilSeconds(q.Limit.NextToken(q.Debt)))
		}
		if m.counter >= 0 {
			c := &sc.d.Counters[m.counter]
			b = appendItem(sep(b, &n), z.quotedName, c.Remaining(), ceilSeconds(c.Left))
		}
	}
	for i := range sc.matches {
		if m := &sc.matches[i]; m.slot >= 0 {
			b = sep(b, &n)
			b = append(b, h.Zones[m.zone].quotedName...)
			b = append(b, ";r="...)
			b = strconv.AppendInt(b, sc.d.Slots[m.slot].Free, 10)
		}
	}
	return b
}

// sep appends the separator before the n-th item of a list, and counts
// it.
func sep(b []byte, n *int) []byte {
	if *n++; *n > 1 {
		b = append(b, ", "...)
	}
	return b
}

func appendPolicy(b []byte, name string, q, w int64) []byte {
	b = append(b, name...)
	b = append(b, ";q="...)
	b = strconv.AppendInt(b, q, 10)
	b = append(b, ";w="...)
	return strconv.AppendInt(b, w, 10)
}

func appendItem(b []byte, name string, r, t int64) []byte {
	b = append(b, name...)
	b = append(b, ";r="...)
	b = strconv.AppendInt(b, r, 10)
	b = append(b, ";t="...)
	return strconv.AppendInt(b, t, 10)
}

// setRetryAfter sets the Retry-After header of a denial that must wait
// wait, in whole seconds rounded up, at least 1, and returns the value
// boxed for the placeholder.
func setRetryAfter(hdr http.Header, wait time.Duration) any {
	secs := max(ceilSeconds(wait), 1)
	if secs < int64(len(smallSeconds)) {
		v := smallSeconds[secs]
		hdr["Retry-After"] = []string{v.(string)}
		return v
	}
	s := strconv.FormatInt(secs, 10)
	hdr["Retry-After"] = []string{s}
	return s
}

// smallSeconds are the common Retry-After values, boxed once for the
// replacer.
var smallSeconds = func() (v [100]any) {
	for i := range v {
		v[i] = strconv.Itoa(i)
	}
	return v
}()

// ceilSeconds rounds d up to whole seconds.
func ceilSeconds(d time.Duration) int64 {
	return int64(gcra.AddSat(d, time.Second-1) / time.Second)
}
