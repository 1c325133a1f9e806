// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package storetest

import "time"

// The table of steps: requests at instants since the replay's start, and
// what every store must answer them. Each step's zones are letters of
// zones (zoneConfigs): "ab" is a request that zones a and b match,
// and an upper-case letter is the quota of the zone of that letter, so
// that "rR" is zone r's bucket and its quota.

// A step is one request: its instant, its key, its zones, whether the
// store allows it, the whole tokens (or units) left per letter after the
// decision, and the letters whose ban it started.
type step struct {
	at    time.Duration // since the replay's start
	key   string
	zones string // which zones the request matches, e.g. "ab"
	ok    bool
	rem   []int64 // whole tokens left per zone, after the decision
	ban   string  // the zones whose ban the step started
}

var steps = []step{
	{0, "k", "a", true, []int64{2}, ""},
	{0, "k", "a", true, []int64{1}, ""},
	{0, "k", "a", true, []int64{0}, ""},
	{0, "k", "a", false, []int64{0}, ""},
	{100 * time.Millisecond, "k", "a", true, []int64{0}, ""},
	// a is empty: b must not be charged.
	{100 * time.Millisecond, "k", "ab", false, []int64{0, 2}, ""},
	{100 * time.Millisecond, "k", "b", true, []int64{1}, ""},
	{100 * time.Millisecond, "k", "b", true, []int64{0}, ""},
	// b is empty: a must not be charged.
	{300 * time.Millisecond, "k", "ab", false, []int64{2, 0}, ""},
	{300 * time.Millisecond, "k", "a", true, []int64{1}, ""},
	{300 * time.Millisecond, "k", "c", true, []int64{2}, ""},
	{300 * time.Millisecond, "k", "c", true, []int64{0}, ""},
	{800 * time.Millisecond, "k", "c", false, []int64{1}, ""},
	{1300 * time.Millisecond, "k", "c", true, []int64{0}, ""},
	{1300 * time.Millisecond, "j", "abc", true, []int64{2, 1, 2}, ""},
	{1300 * time.Millisecond, "j", "abc", true, []int64{1, 0, 0}, ""},
	{1300 * time.Millisecond, "j", "abc", false, []int64{1, 0, 0}, ""},
	{100 * time.Second, "k", "abc", true, []int64{2, 1, 2}, ""},
	// A whole burst at once, though a token is not a whole number of µs.
	{0, "k", "d", true, []int64{6}, ""},
	{0, "k", "d", true, []int64{5}, ""},
	{0, "k", "d", true, []int64{4}, ""},
	{0, "k", "d", true, []int64{3}, ""},
	{0, "k", "d", true, []int64{2}, ""},
	{0, "k", "d", true, []int64{1}, ""},
	{0, "k", "d", true, []int64{0}, ""},
	{0, "k", "d", false, []int64{0}, ""},
	{142 * time.Millisecond, "k", "d", false, []int64{0}, ""},
	{143 * time.Millisecond, "k", "d", true, []int64{0}, ""},
	// A denial in e bans the key for 10s; denials during the ban start no
	// other, and spend nothing in the request's other zones.
	{200 * time.Second, "b", "e", true, []int64{1}, ""},
	{200 * time.Second, "b", "e", true, []int64{0}, ""},
	{200 * time.Second, "b", "e", false, []int64{0}, "e"},
	{205 * time.Second, "b", "e", false, []int64{0}, ""},
	{205 * time.Second, "b", "ae", false, []int64{3, 0}, ""},
	{209900 * time.Millisecond, "b", "e", false, []int64{0}, ""},
	// Then the bucket refills from empty: a token a second.
	{211 * time.Second, "b", "e", true, []int64{0}, ""},
	{211 * time.Second, "b", "e", false, []int64{0}, "e"},
	// A request that another zone denies starts e's ban only if e denies
	// it too.
	{300 * time.Second, "c", "ae", true, []int64{2, 1}, ""},
	{300 * time.Second, "c", "ae", true, []int64{1, 0}, ""},
	{300 * time.Second, "c", "ae", false, []int64{1, 0}, "e"},
	{300 * time.Second, "c", "a", true, []int64{0}, ""},
	// A quota counts per window, and a request it refuses takes no
	// tokens from the request's buckets.
	{0, "q", "Q", true, []int64{2}, ""},
	{0, "q", "Q", true, []int64{1}, ""},
	{0, "q", "aQ", true, []int64{2, 0}, ""},
	{0, "q", "aQ", false, []int64{2, 0}, ""},
	{0, "q", "a", true, []int64{1}, ""},
	{99 * time.Second, "q", "Q", false, []int64{0}, ""},
	// The next window starts from 0.
	{100 * time.Second, "q", "Q", true, []int64{2}, ""},
	{150 * time.Second, "q", "Q", true, []int64{1}, ""},
	{250 * time.Second, "q", "Q", true, []int64{2}, ""},
	// A request a bucket refuses is not counted.
	{0, "p", "a", true, []int64{2}, ""},
	{0, "p", "a", true, []int64{1}, ""},
	{0, "p", "a", true, []int64{0}, ""},
	{0, "p", "aQ", false, []int64{0, 3}, ""},
	{0, "p", "Q", true, []int64{2}, ""},
	// A zone with a rate and a quota: both apply, all or nothing.
	{0, "r", "rR", true, []int64{1, 2}, ""},
	{0, "r", "rR", true, []int64{0, 1}, ""},
	{0, "r", "rR", false, []int64{0, 1}, ""},
	{time.Second, "r", "rR", true, []int64{0, 0}, ""},
	{2 * time.Second, "r", "rR", false, []int64{1, 0}, ""},
	{2 * time.Second, "r", "r", true, []int64{0}, ""},
	{3 * time.Second, "r", "rRbQ", false, []int64{1, 0, 2, 3}, ""},
	{3 * time.Second, "r", "bQ", true, []int64{1, 2}, ""},
	// A zone in dry run refuses nothing: the request is decided without
	// its bucket or counter when they lack, which are charged nothing; a
	// refusal starts its ban all the same.
	{400 * time.Second, "s", "as", true, []int64{2, 1}, ""},
	{400 * time.Second, "s", "as", true, []int64{1, 0}, ""},
	{400 * time.Second, "s", "as", true, []int64{0, 0}, "s"},
	{400 * time.Second, "s", "as", false, []int64{0, 0}, ""},
	{400 * time.Second, "s", "bs", true, []int64{1, 0}, ""},
	{0, "t", "T", true, []int64{1}, ""},
	{0, "t", "T", true, []int64{0}, ""},
	{0, "t", "T", true, []int64{0}, ""},
	{0, "t", "aT", true, []int64{2, 0}, ""},
	{0, "t", "QT", true, []int64{2, 0}, ""},
	{0, "t", "aQT", true, []int64{1, 1, 0}, ""},
}

// delayStep is a step of zone f (10r/s, burst 2, delay 300ms) and the
// zones beside it, replayed after the steps.
type delayStep struct {
	step
	delays  []time.Duration // per zone, of an allowed request: how long it waits for that zone
	wait    time.Duration   // of a denied request: until its zones would take it
	refund  bool            // give the step's tokens back instead of taking them
	noDelay bool            // decide as if the zones had no delay (max_delayed reached)
}

var delaySteps = []delayStep{
	{step: step{400 * time.Second, "k", "f", true, []int64{1}, ""}, delays: []time.Duration{0}},
	{step: step{400 * time.Second, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{0}},
	// The bucket is empty: requests wait for the tokens to come, up to
	// the delay.
	{step: step{400 * time.Second, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{100 * time.Millisecond}},
	{step: step{400 * time.Second, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{200 * time.Millisecond}},
	{step: step{400 * time.Second, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{300 * time.Millisecond}},
	{step: step{400 * time.Second, "k", "f", false, []int64{0}, ""}, wait: 100 * time.Millisecond},
	{step: step{400*time.Second + 50*time.Millisecond, "k", "f", false, []int64{0}, ""}, wait: 50 * time.Millisecond},
	{step: step{400*time.Second + 100*time.Millisecond, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{300 * time.Millisecond}},
	// A client that leaves gives its tokens back: the next request
	// waits as long as it would have.
	{step: step{400*time.Second + 100*time.Millisecond, "k", "f", true, []int64{0}, ""}, refund: true},
	{step: step{400*time.Second + 100*time.Millisecond, "k", "f", true, []int64{0}, ""}, delays: []time.Duration{300 * time.Millisecond}},
	{step: step{400*time.Second + 100*time.Millisecond, "k", "f", false, []int64{0}, ""}, wait: 100 * time.Millisecond},
	// Decided as if without the delay, a request that would wait is
	// refused, and charged nothing.
	{step: step{402 * time.Second, "n", "f", true, []int64{1}, ""}, delays: []time.Duration{0}},
	{step: step{402 * time.Second, "n", "f", true, []int64{0}, ""}, delays: []time.Duration{0}},
	{step: step{402 * time.Second, "n", "f", false, []int64{0}, ""}, wait: 100 * time.Millisecond, noDelay: true},
	{step: step{402 * time.Second, "n", "f", true, []int64{0}, ""}, delays: []time.Duration{100 * time.Millisecond}},
	// The reservations made stay owed: 300ms now, and such a request
	// lacks 200ms.
	{step: step{402 * time.Second, "n", "f", false, []int64{0}, ""}, wait: 200 * time.Millisecond, noDelay: true},
	{step: step{402 * time.Second, "n", "f", true, []int64{0}, ""}, delays: []time.Duration{200 * time.Millisecond}},
	// All or nothing: a refuses (it has no delay), and f, which would
	// have let the request wait, is not charged.
	{step: step{404 * time.Second, "m", "af", true, []int64{2, 1}, ""}, delays: []time.Duration{0, 0}},
	{step: step{404 * time.Second, "m", "af", true, []int64{1, 0}, ""}, delays: []time.Duration{0, 0}},
	{step: step{404 * time.Second, "m", "af", true, []int64{0, 0}, ""}, delays: []time.Duration{0, 100 * time.Millisecond}},
	{step: step{404 * time.Second, "m", "af", false, []int64{0, 0}, ""}, wait: 100 * time.Millisecond},
	{step: step{404 * time.Second, "m", "f", true, []int64{0}, ""}, delays: []time.Duration{200 * time.Millisecond}},
	{step: step{404*time.Second + 100*time.Millisecond, "m", "af", true, []int64{0, 0}, ""}, delays: []time.Duration{0, 200 * time.Millisecond}},
}
