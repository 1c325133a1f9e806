// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// shareBench is a bucket of a zone with share on a real Redis, touched at
// instants of a replayed clock: burst 40, a token every 50ms (20/s).
type shareBench struct {
	t           *testing.T
	r           *redistest.Server
	c           *Client
	shape       *Shape
	hash, field string
	t0          time.Time
}

const shareToken = 50 * time.Millisecond

func newShareBench(t *testing.T) *shareBench {
	r := redistest.Start(t)
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	hash, field := Keys{Prefix: "share:"}.Bucket(ZoneField("z"), "k")
	return &shareBench{t: t, r: r, c: c, shape: NewShape(40*shareToken, shareToken, shareToken, 0, 0, 0, false),
		hash: hash, field: field, t0: time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)}
}

// A shareTouch is one share call, its amounts in tokens.
type shareTouch struct {
	at                       time.Duration // since the bench's start
	holder                   string
	cost, known, spent, want float64
	ttl                      time.Duration
	ret                      bool
}

// A shareAnswer is a share call's reply, its amounts in tokens.
type shareAnswer struct {
	allowed              bool
	tokens, granted, out float64 // tokens: what the bucket holds after the call
	left                 time.Duration
}

func tok(n float64) time.Duration { return time.Duration(n * float64(shareToken)) }

func (b *shareBench) touch(s shareTouch) shareAnswer {
	b.t.Helper()
	call := NewCall(Share, time.Now().Add(5*time.Second))
	call.Clock(b.t0.Add(s.at))
	call.Share(b.hash, b.field, b.shape, tok(s.cost), s.holder, tok(s.known), tok(s.spent), tok(s.want), s.ttl, s.ret)
	r, err := b.c.Run(context.Background(), call)
	if err != nil {
		b.t.Fatal(err)
	}
	allowed, debt, granted, left, out := r.Share()
	return shareAnswer{allowed, 40 - float64(debt)/float64(shareToken), float64(granted) / float64(shareToken),
		float64(out) / float64(shareToken), left}
}

// A bucket shared by holders keeps its tokens plus every share at most
// its burst: a grant moves tokens from the bucket to a share, refill
// behind a share is lost, a report of what a holder spent frees the
// bucket to refill, a return gives back what was not spent, and a share
// that ends unreported is written off whole.
func TestShareProtocol(t *testing.T) {
	b := newShareBench(t)
	a, z := "a:1", "z:1"
	for i, tc := range []struct {
		name string
		in   shareTouch
		want shareAnswer
	}{
		{"an exact take, asking no share", shareTouch{at: 0, holder: a, cost: 1}, shareAnswer{true, 39, 0, 0, 0}},
		{"a take and a grant of 8", shareTouch{at: 0, holder: a, cost: 1, want: 8, ttl: 10 * time.Second}, shareAnswer{true, 30, 8, 8, 10 * time.Second}},
		// 400ms later the bucket refilled 8 tokens, but 8 are out: it
		// holds 32, not 38.
		{"refill behind a share is lost", shareTouch{at: 400 * time.Millisecond, holder: z, cost: 1}, shareAnswer{true, 31, 0, 8, 0}},
		// a reports 5 spent: out is 3, and the bucket may refill to 37.
		{"a report", shareTouch{at: 400 * time.Millisecond, holder: a, known: 8, spent: 5, ttl: 10 * time.Second}, shareAnswer{true, 31, 8, 3, 10 * time.Second}},
		{"a late, smaller report changes nothing", shareTouch{at: 400 * time.Millisecond, holder: a, known: 8, spent: 2, ttl: 10 * time.Second}, shareAnswer{true, 31, 8, 3, 10 * time.Second}},
		{"refill up to the burst less out", shareTouch{at: 5 * time.Second, holder: z}, shareAnswer{true, 37, 0, 3, 0}},
		// A second holder is granted a fair part of what is left, at most
		// a quarter of the burst.
		{"a fair part, at most a quarter", shareTouch{at: 5 * time.Second, holder: z, cost: 1, want: 30, ttl: 200 * time.Millisecond}, shareAnswer{true, 26, 10, 13, 200 * time.Millisecond}},
		// a returns what it did not spend: 3 tokens back.
		{"a return", shareTouch{at: 5 * time.Second, holder: a, known: 8, spent: 5, ret: true}, shareAnswer{true, 29, 0, 10, 0}},
		// z's share ends at 5.2s unreported: written off, nothing back;
		// the bucket refilled 4 tokens meanwhile.
		{"a write-off", shareTouch{at: 5200 * time.Millisecond, holder: a, cost: 1}, shareAnswer{true, 32, 0, 0, 0}},
		{"a written-off holder is granted nothing", shareTouch{at: 5200 * time.Millisecond, holder: z, cost: 1, known: 10, spent: 10, want: 5, ttl: time.Second}, shareAnswer{true, 31, 0, 0, 0}},
		{"a refusal grants nothing", shareTouch{at: 5200 * time.Millisecond, holder: a, cost: 32, want: 5, ttl: time.Second}, shareAnswer{false, 31, 0, 0, 0}},
		{"a cost given back", shareTouch{at: 5200 * time.Millisecond, holder: a, cost: -3}, shareAnswer{true, 34, 0, 0, 0}},
	} {
		got := b.touch(tc.in)
		if got != tc.want {
			t.Fatalf("step %d, %s: got %+v, want %+v", i, tc.name, got, tc.want)
		}
	}
}

// The holders' field keeps the hash as long as the last share, and no
// purge of full buckets takes it while a share is out.
func TestShareStateOutlivesTheBucket(t *testing.T) {
	b := newShareBench(t)
	b.t0 = time.Now() // Redis expires keys by its own clock
	if got := b.touch(shareTouch{holder: "a:1", cost: 1, want: 5, ttl: 10 * time.Second}); got.granted != 5 {
		t.Fatalf("grant: %+v", got)
	}
	holders := b.r.CLI("HGET", b.hash, b.field+"#")
	if ttl, _ := strconv.Atoi(b.r.CLI("PTTL", b.hash)); ttl < 9000 || !strings.Contains(holders, "a:1|") {
		t.Fatalf("the hash lives %dms, its holders %q; want about 10s, and a:1", ttl, holders)
	}
	// New buckets in the hash each purge full ones among three taken at
	// random: the holders' field is not full until its last share ends.
	for i := range 50 {
		call := NewCall(Take, time.Now().Add(5*time.Second))
		call.Bucket(b.hash, BucketField("z", strconv.Itoa(i)), b.hash, b.shape, false, false)
		if _, err := b.c.Run(context.Background(), call); err != nil {
			t.Fatal(err)
		}
	}
	if got := b.r.CLI("HGET", b.hash, b.field+"#"); got != holders {
		t.Fatalf("after 50 new buckets the holders are %q, want %q", got, holders)
	}
}

// A plain take of a bucket of a zone with share (its shape's token sent
// negative) clips the bucket by the shares out, as the share op does,
// alone in its call and among others.
func TestSharePlainTakeClips(t *testing.T) {
	b := newShareBench(t)
	shared := NewSharedShape(40*shareToken, shareToken, shareToken)
	plain := func(at time.Duration, n int) []bool {
		t.Helper()
		var got []bool
		calls := make([]*Call, n)
		for i := range calls {
			calls[i] = NewCall(Take, time.Now().Add(5*time.Second))
			calls[i].Clock(b.t0.Add(at))
			calls[i].Bucket(b.hash, b.field, b.hash, shared, false, false)
		}
		replies, errs := b.c.RunAll(calls)
		for i := range calls {
			if errs[i] != nil {
				t.Fatal(errs[i])
			}
			got = append(got, replies[i].Allowed())
		}
		return got
	}
	// a takes 1 and is granted 10: 29 left in the bucket.
	if got := b.touch(shareTouch{holder: "a:1", cost: 1, want: 10, ttl: 10 * time.Second}); got.tokens != 29 || got.granted != 10 {
		t.Fatalf("grant: %+v", got)
	}
	// 400ms later the bucket refilled 8, of which the share hides all
	// but 1: plain takes find 30, not 37, one call at a time and in one
	// call.
	n := 0
	for range 28 {
		if plain(400*time.Millisecond, 1)[0] {
			n++
		}
	}
	if n != 28 {
		t.Fatalf("%d of 28 single plain takes allowed, want 28", n)
	}
	for _, ok := range plain(400*time.Millisecond, 3) {
		if ok {
			n++
		}
	}
	if n != 30 {
		t.Fatalf("%d plain takes allowed of the 30 tokens beside the share, want 30", n)
	}
	// The clip was written: once the share is returned whole, the bucket
	// holds what a return gives back and its refill since the clip.
	if got := b.touch(shareTouch{at: 400 * time.Millisecond, holder: "a:1", known: 10, ret: true}); got.tokens != 10 {
		t.Fatalf("after the return: %+v, want 10 tokens", got)
	}
}

// The share protocol as a property: three holders of one bucket on a
// simulated clock take requests from their shares or exactly, renew,
// return, die, and send duplicated, late and lost messages (a reply
// lost: the holder learns nothing of what Redis decided; a report sent
// again, or one older than the last): over every pair of admissions,
// whether Redis or a share admitted them, no more than one exact bucket
// allows.
func TestShareProtocolProperty(t *testing.T) {
	b := newShareBench(t)
	type holder struct {
		id            string
		epoch         int
		known, spent  float64 // tokens
		until         time.Duration
		lastKnown     float64
		lastSpentSent float64
	}
	const burst, ttl = 40.0, time.Second
	for run := range 30 {
		rng := rand.New(rand.NewPCG(uint64(run), 11))
		b.hash, b.field = Keys{Prefix: "prop:"}.Bucket(ZoneField("z"), strconv.Itoa(run))
		hs := make([]*holder, 3)
		for i := range hs {
			hs[i] = &holder{id: fmt.Sprintf("h%d:0", i)}
		}
		var at []time.Duration
		now := time.Duration(run) * time.Hour
		start := now
		gap := []int{2, 10, 40, 150}[run%4]
		for range 800 {
			now += time.Duration(rng.IntN(gap*1000)) * time.Microsecond
			if rng.IntN(40) == 0 { // a lull: the bucket refills, and shares are granted
				now += time.Duration(200+rng.IntN(2000)) * time.Millisecond
			}
			h := hs[rng.IntN(len(hs))]
			left := h.known - h.spent
			switch p := rng.IntN(100); {
			case p < 2: // dies: starts again with nothing, its share written off
				h.epoch++
				h.id, h.known, h.spent, h.until = fmt.Sprintf("%s:%d", h.id[:2], h.epoch), 0, 0, 0
			case p < 5: // returns what it did not spend
				b.touch(shareTouch{at: now, holder: h.id, known: h.known, spent: h.spent, ret: true})
				h.epoch++
				h.id, h.known, h.spent, h.until = fmt.Sprintf("%s:%d", h.id[:2], h.epoch), 0, 0, 0
			case p < 9: // a report sent again, or an older one
				spent := h.lastSpentSent
				if p < 7 && spent > 0 {
					spent = float64(rng.IntN(int(spent)))
				}
				b.touch(shareTouch{at: now, holder: h.id, known: h.lastKnown, spent: spent, ttl: ttl})
			case left >= 1 && now < h.until:
				h.spent++
				at = append(at, now-start)
			default: // exactly, reporting, and asking for more when busy
				want := 0.0
				if rng.IntN(3) > 0 {
					want = float64(1 + rng.IntN(12))
				}
				got := b.touch(shareTouch{at: now, holder: h.id, cost: 1, known: h.known, spent: h.spent, want: want, ttl: ttl})
				h.lastKnown, h.lastSpentSent = h.known, h.spent
				if got.allowed {
					at = append(at, now-start)
				}
				if rng.IntN(10) == 0 {
					break // the reply is lost: nothing learnt
				}
				switch {
				case got.granted > h.known:
					h.known = got.granted
					fallthrough
				case got.granted > 0 && got.left > 0:
					h.until = max(h.until, now+got.left-got.left/10)
				case h.known > 0:
					// written off: a new share at the next grant
					h.epoch++
					h.id, h.known, h.spent, h.until = fmt.Sprintf("%s:%d", h.id[:2], h.epoch), 0, 0, 0
				}
			}
		}
		if e := overBound(at, burst, shareToken); e > 1e-9 {
			t.Fatalf("run %d: %d admitted, %.3f tokens over the exact bucket's bound", run, len(at), e)
		}
		if len(at) < 20 {
			t.Fatalf("run %d: %d admitted: the run tested little", run, len(at))
		}
	}
}

// overBound is the largest excess, over every pair of admission instants,
// of what was admitted between them over burst + the refill of a token
// every tt: 0 or less when the bound holds.
func overBound(at []time.Duration, burst float64, tt time.Duration) float64 {
	slices.Sort(at)
	worst, low := -burst, 0.0
	for j, t := range at {
		v := float64(j) - float64(t)/float64(tt)
		if j == 0 || v < low {
			low = v
		}
		worst = max(worst, v-low+1-burst)
	}
	return worst
}
