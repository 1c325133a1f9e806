// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/http"
	"strconv"
	"time"
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

// mostConstrained picks the request whose zone speaks for the response:
// of the denied ones, the one that makes the client wait longest; if all
// were allowed (dry runs aside), the one with the fewest whole tokens left.
func mostConstrained(reqs []request) *request {
	top := &reqs[0]
	for i := 1; i < len(reqs); i++ {
		q := &reqs[i]
		switch qd, td := q.denied(), top.denied(); {
		case qd != td:
			if qd {
				top = q
			}
		case qd:
			if q.wait() > top.wait() {
				top = q
			}
		default:
			if qr, tr := q.remaining(), top.remaining(); qr < tr || qr == tr && q.debt > top.debt {
				top = q
			}
		}
	}
	return top
}

// writeHeaders sets the rate-limit headers for the decided requests:
// the legacy X-RateLimit-* trio for the most constrained zone, and one
// RateLimit and RateLimit-Policy item per zone. top is the most
// constrained zone's request.
//
// RateLimit's t is, as draft-ietf-httpapi-ratelimit-headers-10 defines
// it, the seconds until more quota is available: until the bucket holds
// one more whole token than r (0 when it is full), which on a 429 is
// never later than Retry-After. X-RateLimit-Reset is when the bucket is
// full again. A calendar quota's t is the seconds until its window ends
// (0 while nothing is counted), and its RateLimit-Policy w the length of
// its current window.
func (h *Handler) writeHeaders(hdr http.Header, now time.Time, sc *scratch, top *request) {
	if h.headerMode == headersOff {
		return
	}
	reqs := sc.reqs

	// All values go into one buffer and become one string, sliced.
	b := sc.buf[:0]
	var ends [5]int
	legacy := h.headerMode != headersIETF && top != nil
	if legacy {
		b = strconv.AppendInt(b, top.capacity(), 10)
		ends[0] = len(b)
		b = strconv.AppendInt(b, top.remaining(), 10)
		ends[1] = len(b)
		b = strconv.AppendInt(b, now.Add(top.debt+time.Second-1).Unix(), 10)
		ends[2] = len(b)
	}
	if h.headerMode != headersLegacy {
		for i := range reqs {
			if i > 0 {
				b = append(b, ", "...)
			}
			if q := &reqs[i]; q.win != nil {
				// A quota's policy: its limit and its window's length,
				// which for a month or a day with a change of daylight
				// saving time is that window's own.
				b = append(b, q.zone.quotedName...)
				b = append(b, ";q="...)
				b = strconv.AppendInt(b, q.zone.quota.limit, 10)
				b = append(b, ";w="...)
				b = strconv.AppendInt(b, q.win.seconds, 10)
			} else {
				b = append(b, q.plan().policy...)
			}
		}
		for i := range sc.slots {
			if len(reqs) > 0 || i > 0 {
				b = append(b, ", "...)
			}
			b = append(b, sc.slots[i].zone.slotPolicy...)
		}
		ends[3] = len(b)
		for i := range reqs {
			q := &reqs[i]
			if i > 0 {
				b = append(b, ", "...)
			}
			b = append(b, q.zone.quotedName...)
			b = append(b, ";r="...)
			b = strconv.AppendInt(b, q.remaining(), 10)
			b = append(b, ";t="...)
			b = strconv.AppendInt(b, ceilSeconds(q.nextUnit()), 10)
		}
		for i := range sc.slots {
			q := &sc.slots[i]
			if len(reqs) > 0 || i > 0 {
				b = append(b, ", "...)
			}
			b = append(b, q.zone.quotedName...)
			b = append(b, ";r="...)
			b = strconv.AppendInt(b, q.free, 10)
		}
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
	return int64((d + time.Second - 1) / time.Second)
}
