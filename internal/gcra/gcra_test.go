// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package gcra_test

import (
	"math"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
)

// Named instants, as in golang.org/x/time/rate's tests.
var (
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1 = t0.Add(100 * time.Millisecond)
	t2 = t0.Add(200 * time.Millisecond)
	t3 = t0.Add(300 * time.Millisecond)
	t5 = t0.Add(500 * time.Millisecond)
	t9 = t0.Add(900 * time.Millisecond)
)

// A step is one request against a bucket and what it must get.
type step struct {
	t         time.Time
	n         int64   // tokens asked for
	ok        bool    // allowed?
	remaining float64 // tokens left after the decision
	wait      time.Duration
}

// runSteps replays steps against one bucket of shape l, starting full.
func runSteps(t *testing.T, l gcra.Limit, steps []step) {
	t.Helper()
	var f time.Duration
	for i, s := range steps {
		now := s.t.Sub(t0)
		cost := l.CostTime(s.n)
		nf, ok := l.Take(f, now, cost)
		if ok != s.ok {
			t.Fatalf("step %d: ok = %v, want %v", i, ok, s.ok)
		}
		if !ok && nf != l.Clamp(f, now) {
			t.Fatalf("step %d: a denied request moved the bucket from %d to %d", i, f, nf)
		}
		f = nf
		debt := l.Debt(f, now)
		if got := l.Tokens(debt); math.Abs(got-s.remaining) > 1e-6 {
			t.Fatalf("step %d: remaining = %v, want %v", i, got, s.remaining)
		}
		if !ok {
			if got := l.Wait(debt, cost); got != s.wait {
				t.Fatalf("step %d: wait = %v, want %v", i, got, s.wait)
			}
		}
	}
}

func TestBucketMath(t *testing.T) {
	tests := []struct {
		name  string
		rate  float64 // tokens per second
		burst int64
		steps []step
	}{
		{"burst exhaustion", 10, 3, []step{
			{t: t0, n: 1, ok: true, remaining: 2},
			{t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
		}},
		{"refill", 10, 2, []step{
			{t: t0, n: 2, ok: true, remaining: 0},
			{t: t1, n: 1, ok: true, remaining: 0},
			{t: t1, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t3, n: 1, ok: true, remaining: 1},
			{t: t9, n: 1, ok: true, remaining: 1}, // capped at burst before taking
		}},
		// A clock that went back leaves the bucket owing a whole bucket
		// at most, from the instant it was seen.
		{"clock going backwards", 10, 2, []step{
			{t: t5, n: 2, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 100 * time.Millisecond},
			{t: t2, n: 1, ok: true, remaining: 1},
		}},
		{"fractional rate", 0.5, 1, []step{
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t9, n: 1, ok: false, remaining: 0.45, wait: 1100 * time.Millisecond},
			{t: t0.Add(2 * time.Second), n: 1, ok: true, remaining: 0},
		}},
		{"cost above 1", 10, 5, []step{
			{t: t0, n: 3, ok: true, remaining: 2},
			{t: t0, n: 3, ok: false, remaining: 2, wait: 100 * time.Millisecond},
			{t: t1, n: 3, ok: true, remaining: 0},
		}},
		{"long idle", 1, 10, []step{
			{t: t0, n: 10, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 1, ok: true, remaining: 9},
		}},
		{"huge values", 1e-6, 1000, []step{ // a token per 11.6 days; 31.7 years to refill
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(1000 * time.Hour), n: 4, ok: false, remaining: 3.6, wait: 400000 * time.Second},
		}},
		{"whole burst at a rate of odd token time", 7, 7, []step{
			{t: t0, n: 1, ok: true, remaining: 6}, {t: t0, n: 1, ok: true, remaining: 5},
			{t: t0, n: 1, ok: true, remaining: 4}, {t: t0, n: 1, ok: true, remaining: 3},
			{t: t0, n: 1, ok: true, remaining: 2}, {t: t0, n: 1, ok: true, remaining: 1},
			{t: t0, n: 1, ok: true, remaining: 0},
			{t: t0, n: 1, ok: false, remaining: 0, wait: 142857143},
		}},
		{"fast rate", 1e9, 1000, []step{
			{t: t0, n: 1000, ok: true, remaining: 0},
			{t: t0.Add(time.Microsecond), n: 1000, ok: true, remaining: 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runSteps(t, gcra.NewLimit(tt.rate, tt.burst), tt.steps)
		})
	}
}

// A long run at the limit must allow exactly burst + rate·elapsed, with no
// drift from the rounding of fractional token intervals.
func TestBucketNoDrift(t *testing.T) {
	for _, rate := range []float64{3, 7, 1.0 / 3, 1000.0 / 7} {
		l := gcra.NewLimit(rate, 5)
		cost := l.CostTime(1)
		var f time.Duration
		allowed := 0
		const elapsed = 1000 * time.Second
		step := time.Duration(float64(time.Second) / rate / 10) // 10 tries per token
		for now := time.Duration(0); now <= elapsed; now += step {
			var ok bool
			if f, ok = l.Take(f, now, cost); ok {
				allowed++
			}
		}
		want := 5 + rate*elapsed.Seconds()
		if math.Abs(float64(allowed)-want) > 1 {
			t.Errorf("rate %v: allowed %d in %v, want %.1f ± 1", rate, allowed, elapsed, want)
		}
	}
}

func TestNewLimitMaxBurstTime(t *testing.T) {
	// The largest bucket the configuration accepts must not overflow.
	l := gcra.NewLimit(1.0/86400, 36500) // one a day, burst of 100 years
	if l.BurstTime <= 0 || l.BurstTime > gcra.MaxBurstTime {
		t.Fatalf("burstTime = %v", l.BurstTime)
	}
	f, ok := l.Take(0, math.MaxInt64/4, l.CostTime(36500))
	if !ok || f <= 0 {
		t.Fatalf("take at a far instant: f = %d, ok = %v", f, ok)
	}
}

// A bucket keeps its instant when its key's plan changes: under a smaller
// limit it owes at most that limit's whole bucket, from the change on,
// and refills at the new rate; under a larger one it keeps its debt, in
// time.
func TestBucketPlanChange(t *testing.T) {
	free, pro := gcra.NewLimit(1, 2), gcra.NewLimit(60, 5) // full in 2s; in 83.3ms
	var f time.Duration
	take := func(l gcra.Limit, now time.Duration, want bool) {
		t.Helper()
		var ok bool
		if f, ok = l.Take(f, now, l.CostTime(1)); ok != want {
			t.Fatalf("at %v: ok = %v, want %v", now, ok, want)
		}
	}
	take(free, 0, true)
	take(free, 0, true)
	take(free, 0, false) // free is empty: full at 2s
	// Now pro: clamped to pro's whole bucket, from now on.
	take(pro, 0, false)
	if f != pro.BurstTime {
		t.Fatalf("after the change the bucket is full at %v, want %v", f, pro.BurstTime)
	}
	take(pro, pro.TokenTime-1, false)
	take(pro, pro.TokenTime, true) // a token at pro's rate, not after free's 2s
	if d := pro.Debt(f, pro.TokenTime); d != pro.BurstTime {
		t.Fatalf("debt %v, want a whole pro bucket", d)
	}
	// Back to free: the debt carries over as is (83.3ms of 2s: 1.9 tokens).
	if got := free.WholeTokens(free.Debt(f, pro.TokenTime)); got != 1 {
		t.Fatalf("free has %d whole tokens after the change, want 1", got)
	}
	take(free, pro.TokenTime, true)
	take(free, pro.TokenTime, false)
}

// A change of a key's own limit keeps the tokens it had spent: the
// examples of the docs, a change of rate alone, and a ban's excess.
func TestBucketRetune(t *testing.T) {
	tokens := func(l gcra.Limit, fullAt time.Duration) float64 { return l.Tokens(l.Debt(fullAt, 0)) }
	two, ten := gcra.NewLimit(1, 2), gcra.NewLimit(1, 10)
	// Emptied at burst 2, raised to 10: 8 tokens at once.
	if got := tokens(ten, ten.Retune(two.BurstTime, 0, two)); got != 8 {
		t.Fatalf("burst 2 emptied, then 10: %v tokens, want 8", got)
	}
	// Back to 2 from 10 owing 8: it held 2, up to the burst of 2.
	if got := tokens(two, two.Retune(8*time.Second, 0, ten)); got != 2 {
		t.Fatalf("burst 10 holding 2, then 2: %v tokens, want 2", got)
	}
	// 50 of 100 left, lowered to 10: 10 (the tokens it had, up to its burst).
	hundred, ten10 := gcra.NewLimit(10, 100), gcra.NewLimit(10, 10)
	if got := tokens(ten10, ten10.Retune(5*time.Second, 0, hundred)); got != 10 {
		t.Fatalf("burst 100 holding 50, then 10: %v tokens, want 10", got)
	}
	// 95 spent of 100, lowered to 10: 5 tokens.
	if got := tokens(ten10, ten10.Retune(9500*time.Millisecond, 0, hundred)); got != 5 {
		t.Fatalf("burst 100 holding 5, then 10: %v tokens, want 5", got)
	}
	// A change of rate alone keeps the tokens: 4 of 10 at 1r/s are 4 of
	// 10 at 10r/s, and back.
	fast := gcra.NewLimit(10, 10)
	if got := tokens(fast, fast.Retune(6*time.Second, 0, ten)); got != 4 {
		t.Fatalf("4 tokens at 1r/s, then 10r/s: %v tokens, want 4", got)
	}
	if got := tokens(ten, ten.Retune(600*time.Millisecond, 0, fast)); got != 4 {
		t.Fatalf("4 tokens at 10r/s, then 1r/s: %v tokens, want 4", got)
	}
	// What a bucket owed beyond its whole bucket (a ban) is owed as it was.
	banned := two
	banned.Ban = time.Hour
	if got := ten.Retune(two.BurstTime+time.Hour, 0, banned); got != 2*time.Second+time.Hour {
		t.Fatalf("banned, then burst 10: full at %v, want the ban and 2 tokens", got)
	}
	// The same limit, and a full bucket, change nothing.
	if got := ten.Retune(3*time.Second, 0, ten); got != 3*time.Second {
		t.Fatalf("same limit: %v", got)
	}
	if got := ten.Retune(-time.Second, 0, two); got != -time.Second {
		t.Fatalf("a full bucket: %v", got)
	}
}

// The longest ban after the longest refill, 100 years each: a banned
// bucket owes 200 years, and a take of a whole bucket on it, 300 years,
// passes the 292 years a time.Duration holds. It is refused all the same,
// with the wait of the ban and the refill, and a charge on it leaves it
// owing what it owed, never full.
func TestBucketLongestBan(t *testing.T) {
	l := gcra.NewLimit(1/gcra.MaxBurstTime.Seconds(), 1)
	l.Ban = gcra.MaxBurstTime
	cost := l.CostTime(1)
	f, ok := l.Take(0, 0, cost)
	if !ok {
		t.Fatal("the first take was refused")
	}
	if f, ok = l.Take(f, time.Second, cost); ok || f != time.Second+2*gcra.MaxBurstTime {
		t.Fatalf("the take that bans: %v, full at %v; want refused, full at %v", ok, f, time.Second+2*gcra.MaxBurstTime)
	}
	for _, now := range []time.Duration{time.Second, time.Hour, gcra.MaxBurstTime} { // banned throughout
		nf, ok := l.Take(f, now, cost)
		if ok || nf != f {
			t.Fatalf("at %v: %v, full at %v; want refused, the bucket as it was (%v)", now, ok, nf, f)
		}
		debt := l.Debt(f, now)
		if w, next := l.Wait(debt, cost), l.NextToken(debt); w != f-now || next != f-now {
			t.Fatalf("at %v: wait %v, next token in %v; want both %v", now, w, next, f-now)
		}
	}
	if got := l.Adjust(f, time.Second, cost); got != f {
		t.Fatalf("a charge on the banned bucket leaves it full at %v, want %v: it owes all it may", got, f)
	}
}

// A sum of durations past what a time.Duration holds is the longest one,
// in whole seconds, and rounds up to seconds without wrapping around.
func TestAddSat(t *testing.T) {
	for _, tc := range []struct{ a, b, want time.Duration }{
		{time.Second, time.Second, 2 * time.Second},
		{time.Second, -2 * time.Second, -time.Second},
		{2 * gcra.MaxBurstTime, gcra.MaxBurstTime, gcra.MaxDuration},
		{gcra.MaxDuration, 1, gcra.MaxDuration},
		{math.MaxInt64, math.MaxInt64, gcra.MaxDuration},
	} {
		if got := gcra.AddSat(tc.a, tc.b); got != tc.want {
			t.Errorf("addSat(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

// A class below others keeps their reserves in the bucket: burst 10
// keeping 25% (2.5 tokens) gives that class 7 whole tokens, a wait until
// the bucket holds its cost above what it keeps, and, under a key's own
// burst of 20, 15.
func TestKept(t *testing.T) {
	l := gcra.NewLimit(1, 10).Keeping(0.25)
	if l.Kept != 2500*time.Millisecond || l.Capacity() != 7 {
		t.Fatalf("kept %v, capacity %d; want 2.5s, 7", l.Kept, l.Capacity())
	}
	var f time.Duration
	var ok bool
	for i := range 7 {
		if f, ok = l.Take(f, 0, l.TokenTime); !ok {
			t.Fatalf("take %d refused", i)
		}
	}
	if _, ok = l.Take(f, 0, l.TokenTime); ok {
		t.Fatal("the eighth take was allowed: it reached into the reserve")
	}
	debt := l.Debt(f, 0)
	if w, n, r := l.Wait(debt, l.TokenTime), l.NextToken(debt), l.WholeTokens(debt); w != 500*time.Millisecond || n != 500*time.Millisecond || r != 0 {
		t.Fatalf("wait %v, next token %v, %d left; want 500ms, 500ms, 0", w, n, r)
	}
	all := l.Keeping(0)
	if r := all.WholeTokens(debt); r != 3 {
		t.Fatalf("the highest class sees %d tokens, want 3", r)
	}
	if o := l.With(time.Second, 20); o.Kept != 5*time.Second || o.Capacity() != 15 {
		t.Fatalf("a burst of 20 keeps %v, capacity %d; want 5s, 15", o.Kept, o.Capacity())
	}
	if l.Keeping(0.9999999999).Kept >= l.BurstTime {
		t.Fatal("a share just below 1 keeps the whole bucket")
	}
}
