// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"errors"
	"fmt"
	"testing"
	"time"
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
