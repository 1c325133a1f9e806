// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// A flight's command is the calls' keys, in order, then the clock, the
// plain shapes once each, and each call's decision: a plain take as its
// buckets' shapes and fields, a take with a counter in sections, a
// release as its sets and id.
func TestCommandLayout(t *testing.T) {
	deadline := time.Now().Add(time.Second)
	a := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false)
	b := NewShape(20*time.Second, 2*time.Second, 2*time.Second, 0, 0, 0, false)
	banned := NewShape(10*time.Second, time.Second, time.Second, time.Minute, 0, 0, false)
	q := NewCounterShape(100, 1)
	w := NewWindow(time.UnixMilli(1000), time.UnixMilli(2000), time.UnixMilli(3000), time.UnixMilli(4000))
	s := NewSlotShape(3, time.Minute, false)

	p1 := NewCall(Take, deadline)
	p1.Bucket("h1", "f1", "h1", a, false, false)
	p2 := NewCall(Take, deadline) // two zones of plain shapes: still plain
	p2.Bucket("h2", "f2a", "h2", b, true, false)
	p2.Bucket("h2", "f2b", "h2", a, true, false)
	g := NewCall(Take, deadline) // a ban and an override key: in sections
	g.Bucket("h3", "f3", "h3:limit", banned, false, false)
	g.Counter("c3", "u3", q, w, false)
	g.Slot("s3", "id3", s)
	r := NewCall(Release, deadline)
	r.Slot("s4", "id4", nil)
	m := &command{script: &testScripts(t).decide, calls: []*Call{p1, p2, g, r}}
	got := fmt.Sprint(m.build()[2:])
	want := fmt.Sprint([]any{"9", "h1", "h2", "h2", "h3", "h3:limit", "c3", "u3", "s3", "s4",
		"", "2", "2", "10000000000", "1000000000", "1000000000", "20000000000", "2000000000", "2000000000",
		"1", "1", "f1",
		"2", "2", "f2a", "1", "f2b",
		"take", "1", "1", "1", "f3", "10000000000", "1000000000", "60000000000", "0", "0", "0", "1000000000", "0",
		"100", "1", "1000000", "2000000", "3000000", "4000000", "0", "id3", "3", "60000000000", "0",
		"release", "1", "id4"})
	if got != want {
		t.Fatalf("command\n%s\nwant\n%s", got, want)
	}
	if !p1.plain || !p2.plain || g.plain || r.plain {
		t.Fatalf("plain: %t %t %t %t; want true true false false", p1.plain, p2.plain, g.plain, r.plain)
	}

	// The reply: the clock and the keys repaired, then each call's part.
	z := int64(0)
	v := []any{int64(7), int64(2),
		int64(1), int64(3000), // p1: allowed, debt
		int64(0), int64(11), int64(12), // p2: refused, its two debts
		int64(1), int64(5), z, z, z, int64(9), int64(50), z, int64(1), int64(2), // g: a bucket, a counter, a slot
		int64(1)} // r: one set held it
	m.answer(v, nil, time.Unix(1, 0))
	for _, c := range m.calls {
		<-c.done
	}
	r1, _ := p1.answer()
	r2, _ := p2.answer()
	rg, _ := g.answer()
	if d, _ := r1.Bucket(0); !r1.Allowed() || d != 3000 || r1.Repaired() != 2 || r1.Clock() != time.UnixMicro(7) {
		t.Errorf("p1: allowed %t, debt %v, repaired %d, clock %v", r1.Allowed(), d, r1.Repaired(), r1.Clock())
	}
	if d0, _ := r2.Bucket(0); r2.Allowed() || d0 != 11 || r2.Repaired() != 0 {
		t.Errorf("p2: allowed %t, debt %v, repaired %d", r2.Allowed(), d0, r2.Repaired())
	}
	if d1, _ := r2.Bucket(1); d1 != 12 {
		t.Errorf("p2's second bucket owes %v, want 12", d1)
	}
	used, left := rg.Counter(0)
	held, free := rg.Slot(0)
	if d, ban := rg.Bucket(0); !rg.Allowed() || d != 5 || ban || used != 9 || left != 50 || !held || free != 2 {
		t.Errorf("g: allowed %t, debt %v, ban %t, used %d, left %v, held %t, free %d", rg.Allowed(), d, ban, used, left, held, free)
	}

	// A reply of another length, or with a value that is no number, is
	// a bad reply for every call; a decision whose quota windows miss
	// Redis's clock (allowed -1) is that call's error alone.
	for _, v := range [][]any{v[:len(v)-1], append(append([]any{}, v[:3]...), append([]any{"x"}, v[4:]...)...)} {
		m.answer(v, nil, time.Now())
		for _, c := range m.calls {
			<-c.done
			if !errors.Is(c.err, ErrBadReply) {
				t.Errorf("reply %v: error %v, want a bad reply", v, c.err)
			}
		}
	}
	v[7] = int64(-1)
	m.answer(v, nil, time.Now())
	for _, c := range m.calls {
		<-c.done
	}
	if _, err := g.answer(); !errors.Is(err, ErrWindow) || Classify(err) != Answered {
		t.Errorf("g with allowed -1: %v, want the window's error, which Redis answered", err)
	}
	if _, err := p1.answer(); err != nil {
		t.Errorf("p1 beside it: %v", err)
	}
}

// Plain takes of one bucket in a row go as one decision, a run: its key
// and field once, each take still with its own result.
func TestCommandRun(t *testing.T) {
	deadline := time.Now().Add(time.Second)
	a := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false)
	var calls []*Call
	for _, h := range []string{"h1", "h1", "h1", "h2", "h1"} {
		c := NewCall(Take, deadline)
		c.Bucket(h, "f"+h, h, a, false, false)
		calls = append(calls, c)
	}
	m := &command{script: &testScripts(t).decide, calls: calls}
	got := fmt.Sprint(m.build()[2:])
	want := fmt.Sprint([]any{"3", "h1", "h2", "h1", "", "0", "1", "10000000000", "1000000000", "1000000000",
		"*", "3", "1", "fh1", "1", "1", "fh2", "1", "1", "fh1"})
	if got != want {
		t.Fatalf("command\n%s\nwant\n%s", got, want)
	}
	n := 0
	for _, c := range calls {
		n += c.results()
	}
	if n != 10 {
		t.Fatalf("the calls expect %d results, want 2 each", n)
	}
}

// A plain adjustment of n buckets (one shape without ban or scale, no
// override read) is decided as n adjustments in sections, one after
// another: from every kind of value a bucket can hold (none, a debt, one
// refilled, one written under an override or a plan, one that holds no
// instant, a hash of another type), by costs that charge, cap at full +
// beyond, and give back, a bucket twice among them, the same debts, the
// same values written and the same keys repaired.
func TestPlainAdjustMatchesSections(t *testing.T) {
	r := redistest.Start(t)
	c, err := NewClient(&redis.UniversalOptions{Addrs: []string{r.Addr()}}, testScripts(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	// burst 10, a token a second, up to 20 s beyond a whole bucket.
	shape := NewShape(10*time.Second, time.Second, time.Second, 0, 20*time.Second, 0, false)
	clock := time.Now().Truncate(time.Second)
	inst := func(debt time.Duration) string { // the instant a bucket of debt is full again
		return strconv.FormatInt((clock.UnixMicro()-1735689600000000)*1000+int64(debt), 10)
	}
	values := []string{"", inst(3 * time.Second), inst(-5 * time.Second), inst(4*time.Second) + ":4000000000:1000000000",
		inst(6*time.Second) + ":20000000000", "x", inst(9 * time.Second), "wrongtype"}
	costs := []time.Duration{time.Second, 5 * time.Second, -2 * time.Second, 40 * time.Second, -time.Minute}
	for _, cost := range costs {
		var replies [2][]Reply
		// What each wrote, read as soon as it answered: a bucket a
		// second from full expires a second after the call, and the
		// other's setup (redis-cli, a process a command) can take that
		// long on a loaded machine.
		var wrote [2][]string
		for v, prefix := range []string{"plain:", "sections:"} {
			var calls []*Call
			adjust := func(h, limit string) {
				if v == 0 && len(calls) == 1 {
					calls[0].AdjustBucket(h, "f", limit, shape, cost)
					return
				}
				// The decision's clock is fixed; its deadline is not: the
				// redis-cli setup before it can take seconds on a busy host.
				call := NewCall(Adjust, time.Now().Add(time.Minute))
				call.Clock(clock)
				call.AdjustBucket(h, "f", limit, shape, cost)
				calls = append(calls, call)
			}
			for i, val := range values {
				h := fmt.Sprintf("%s{%d}", prefix, i)
				r.CLI("DEL", h)
				switch val {
				case "":
				case "wrongtype":
					r.CLI("SET", h, "a string")
				default:
					r.CLI("HSET", h, "f", val)
				}
				limit := h // no override read: plain
				if v == 1 {
					limit = prefix + "none" // read, and absent: in sections
				}
				adjust(h, limit)
				if i == 1 {
					adjust(h, limit) // the same bucket again
				}
			}
			if calls[0].plain != (v == 0) {
				t.Fatalf("%s call: plain %t", prefix, calls[0].plain)
			}
			var errs []error
			replies[v], errs = c.RunAll(calls)
			for _, err := range errs {
				if err != nil {
					t.Fatalf("%s adjustment by %v: %v", prefix, cost, err)
				}
			}
			gets := make([]*redis.StringCmd, len(values))
			c.Pipelined(context.Background(), func(p redis.Pipeliner) error {
				for i := range values {
					gets[i] = p.HGet(context.Background(), fmt.Sprintf("%s{%d}", prefix, i), "f")
				}
				return nil
			})
			for _, g := range gets {
				val, err := g.Result()
				if err != nil && !errors.Is(err, redis.Nil) {
					val = err.Error()
				}
				wrote[v] = append(wrote[v], val)
			}
		}
		p, s := replies[0][0], replies[1]
		if len(s) != len(values)+1 || !p.Allowed() || p.Repaired() != 2 {
			t.Fatalf("by %v: %d calls in sections; plain allowed %t, repaired %d, want 2", cost, len(s), p.Allowed(), p.Repaired())
		}
		repaired := int64(0)
		for i := range s {
			dp, _ := p.Bucket(i)
			ds, _ := s[i].Bucket(0)
			if !s[i].Allowed() || dp != ds || dp < 0 || dp > 30*time.Second {
				t.Errorf("by %v, bucket %d: plain owes %v, in sections %v", cost, i, dp, ds)
			}
			repaired += s[i].Repaired()
		}
		if repaired != p.Repaired() {
			t.Errorf("by %v: %d keys repaired in sections, %d plain", cost, repaired, p.Repaired())
		}
		for i := range values {
			if vp, vs := wrote[0][i], wrote[1][i]; vp != vs {
				t.Errorf("by %v, bucket %d (was %q): plain wrote %q, in sections %q", cost, i, values[i], vp, vs)
			}
		}
	}
}

// A plain adjustment is one decision of its buckets' hashes, its shape's
// place, its beyond and each bucket's field and cost, counted among the
// decisions that are not plain takes (so that only a call that holds one
// makes its function); buckets of another shape, or an override's key,
// make it one in sections; and it is never part of a run of takes.
func TestAdjustLayout(t *testing.T) {
	deadline := time.Now().Add(time.Second)
	owe := NewShape(10*time.Second, time.Second, time.Second, 0, 20*time.Second, 0, false)
	banned := NewShape(10*time.Second, time.Second, time.Second, time.Minute, 0, 0, false)
	take := NewCall(Take, deadline)
	take.Bucket("h1", "f1", "h1", NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false), false, false)
	adj := NewCall(Adjust, deadline)
	adj.AdjustBucket("h1", "f1", "h1", owe, time.Second)
	adj.AdjustBucket("h2", "f2", "h2", owe, -3*time.Second)
	m := &command{script: &testScripts(t).decide, calls: []*Call{take, adj}}
	got := fmt.Sprint(m.build()[2:])
	want := fmt.Sprint([]any{"3", "h1", "h1", "h2", "", "1", "2",
		"10000000000", "1000000000", "1000000000", "10000000000", "1000000000", "1000000000",
		"1", "1", "f1", "+", "2", "2", "20000000000", "f1", "1000000000", "f2", "-3000000000"})
	if got != want {
		t.Fatalf("command\n%s\nwant\n%s", got, want)
	}
	if n := take.results() + adj.results(); n != 5 {
		t.Errorf("the calls expect %d results, want 2 and 3", n)
	}
	for _, b := range []struct {
		shape *Shape
		limit string
	}{{banned, "h3"}, {owe, "h3:limit"}, {NewShape(time.Second, time.Second, time.Second, 0, 0, 0, false), "h3"}} {
		c := NewCall(Adjust, deadline)
		c.AdjustBucket("h1", "f1", "h1", owe, time.Second)
		c.AdjustBucket("h3", "f3", b.limit, b.shape, time.Second)
		if c.plain {
			t.Errorf("an adjustment with a bucket of shape %+v, override key %s: plain", b.shape, b.limit)
		}
	}
	// A plain adjustment of the bucket of a run of takes ends the run.
	run1, run2 := NewCall(Take, deadline), NewCall(Adjust, deadline)
	run1.Bucket("h1", "f1", "h1", take.buckets[0].shape, false, false)
	run2.AdjustBucket("h1", "f1", "h1", take.buckets[0].shape, time.Second)
	if n := run([]*Call{run1, run2}); n != 1 || !run2.plain {
		t.Errorf("a take and an adjustment of one bucket: a run of %d (plain adjustment: %t)", n, run2.plain)
	}
}
