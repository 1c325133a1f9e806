// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package gcra is the token-bucket math: pure functions of instants and
// durations. It knows nothing of HTTP, Caddy, Redis or zones, and never
// reads a clock: every instant is a parameter.
//
// A token bucket with rate r and capacity C is kept as one number, the
// instant fullAt at which it will be full again (GCRA's "theoretical
// arrival time"). At instant now it holds C − r·max(0, fullAt−now) tokens;
// taking n tokens moves fullAt to max(fullAt, now) + n/r, which is allowed
// while the result lies no further than C/r ahead of now (with a delay
// d, C/r + d: the request then waits until it lies C/r ahead, so that its
// tokens are there when it goes on). A bucket with
// fullAt ≤ now is full and carries no information, so it can be forgotten
// without changing any decision.
//
// Instants are durations since an epoch of the caller's choosing (a
// table's creation, Redis's 2025-01-01), so that the math is plain
// arithmetic on time.Duration.
package gcra

import (
	"math"
	"time"
)

// A Limit is the shape of a token bucket, in time: a token is worth
// TokenTime of refill, a full bucket BurstTime = burst·TokenTime. Both are
// whole nanoseconds, so that the sums the math makes are exact: a full
// bucket always gives burst tokens at once, and nothing drifts. (A rate
// whose token is not a whole number of nanoseconds, such as 7r/s, is kept
// to the nearest one: 1 part in 10⁸ at most.)
type Limit struct {
	TokenTime time.Duration // 1/r: time to refill one token
	BurstTime time.Duration // C/r: time to refill the whole bucket from empty
	Burst     int64         // C: capacity in tokens
	// ban: a denial of a bucket that is not banned yet empties it for
	// this long (then it refills as usual): fullAt moves to now + ban +
	// BurstTime. 0: no ban. A bucket that owes more than BurstTime is
	// banned for the excess.
	Ban time.Duration
	// delay: a take that finds too few tokens but would have them within
	// delay reserves them now, so the bucket may owe up to BurstTime +
	// delay, and its request waits out the excess before it goes on.
	// 0: no delay. A limit has a ban or a delay, never both: both read a
	// debt beyond BurstTime, one as a ban, the other as reservations.
	Delay time.Duration
	// owe: an adjustment may leave the bucket owing this much more than
	// a whole bucket: how far the true cost of a zone with usage, known
	// after the response, may take it past empty (a zone with usage). A take
	// still needs its tokens, so a bucket in debt refuses until it holds
	// them again. 0: none. Never with a ban or a delay.
	Owe time.Duration
	// NoDelay: take as if the delay were 0 (the handler lets no more
	// requests wait); the bucket may still owe what earlier takes
	// reserved.
	NoDelay bool
	// Kept: the part of the whole bucket that a take must leave in it,
	// for the classes of request above the request's (their reserves):
	// the bucket behaves, for this take, as if its whole bucket were
	// BurstTime − Kept. Its tokens, its next token and its capacity are
	// counted alike. 0 for none; always below BurstTime. Never with a ban
	// or a delay.
	Kept time.Duration
}

// MaxBurstTime bounds C/r, and a ban: a bucket owes at most two of them,
// 200 years, which an instant holds. Sums beyond that (a take's cost on a
// banned bucket, jitter on its wait) pass the 292 years of a
// time.Duration: they are made with AddSat.
const MaxBurstTime = 100 * 365 * 24 * time.Hour

// maxDuration is the longest duration a sum of durations gives (AddSat):
// about 292 years, in whole seconds, so that rounding it up to seconds or
// milliseconds stays within a time.Duration.
const maxDuration = math.MaxInt64 / time.Second * time.Second

// AddSat is a + b, or maxDuration when that is longer: a sum that would
// wrap around to a negative duration is the longest instead, so that a
// wait never turns into none.
func AddSat(a, b time.Duration) time.Duration {
	if s := a + b; b <= 0 || s >= a && s <= maxDuration {
		return s
	}
	return maxDuration
}

// MaxRate is the fastest rate: a token a nanosecond.
const MaxRate = 1e9

// NewLimit is the shape of a bucket. The caller checks that the rate is
// at most MaxRate and that burst·TokenTime is at most MaxBurstTime.
func NewLimit(ratePerSec float64, burst int64) Limit {
	tokenTime := max(time.Duration(math.Round(float64(time.Second)/ratePerSec)), 1)
	return Limit{TokenTime: tokenTime, BurstTime: time.Duration(burst) * tokenTime, Burst: burst}
}

// CostTime is the time that n tokens are worth. n is at most the burst:
// configurations that ask for more are refused.
func (l *Limit) CostTime(n int64) time.Duration {
	return time.Duration(n) * l.TokenTime
}

// Debt is how long a bucket full at fullAt needs, seen at now, to be full
// again: 0 when it is full, never more than it may owe (a clock that went
// backwards must not leave a bucket owing more).
func (l *Limit) Debt(fullAt, now time.Duration) time.Duration {
	return min(max(fullAt-now, 0), l.Most())
}

// Most is the most a bucket may owe: a whole bucket, and a ban, a delay
// or a debt.
func (l *Limit) Most() time.Duration { return l.BurstTime + l.Ban + l.Delay + l.Owe }

// Take charges cost (from l.CostTime) to a bucket full at fullAt. It
// returns the bucket's new instant and whether the tokens were there, or,
// with a delay, will be there within it (see Delayed). When they were
// not, the bucket is unchanged, unless the limit bans and the bucket was
// not banned yet: then the denial starts a ban.
//
// Either way the instant returned is clamped to now plus a whole bucket
// (and a ban or a delay): a bucket that owes more, under a larger limit
// (its key's plan changed) or a clock that went back, is
// from now on an empty bucket of this limit, refilling at its rate.
//
// A cost above the whole bucket is never there, delay or not, and its
// refusal bans no one: it is the limit's fault, not the client's (a key's
// own burst below a cost that comes with each request).
func (l *Limit) Take(fullAt, now, cost time.Duration) (time.Duration, bool) {
	d := l.Debt(fullAt, now)
	if AddSat(d, cost) <= l.Reach() && cost <= l.Room() {
		return now + d + cost, true
	}
	if l.StartsBan(d, cost) {
		return now + l.Ban + l.BurstTime, false
	}
	return l.Clamp(fullAt, now), false
}

// StartsBan reports whether a refused take of cost from a bucket that
// owes debt bans it: the limit bans, the bucket is not banned yet, and
// the cost is one a whole bucket holds.
func (l *Limit) StartsBan(debt, cost time.Duration) bool {
	return l.Ban > 0 && !l.Banned(debt) && cost <= l.BurstTime
}

// Adjust charges cost (a duration of tokens, as in take) to a bucket full
// at fullAt, refusing nothing: it returns the bucket's new instant. The
// bucket may owe up to l.Most(); a negative
// cost gives back, but never to a banned bucket: a ban is never
// shortened.
func (l *Limit) Adjust(fullAt, now, cost time.Duration) time.Duration {
	d := l.Debt(fullAt, now)
	if cost < 0 && l.Banned(d) {
		return fullAt
	}
	return now + min(max(AddSat(d, cost), 0), l.Most())
}

// Spend is the time n tokens are worth, n being any count a response
// reports: beyond what a bucket may owe, more than it may owe.
func (l *Limit) Spend(n int64) time.Duration {
	if n > int64(l.Most()/l.TokenTime) {
		return l.Most() + l.TokenTime
	}
	return time.Duration(n) * l.TokenTime
}

// Rescale is, on l's time line, the instant of a bucket full at fullAt,
// seen at now, that a limit of whole bucket from wrote (its key's plan
// changed): it owes the same fraction of its bucket, and what it owed
// beyond a whole bucket (a ban, a delay's reservations) as it was. So a
// change of plan hands back no tokens and takes none: a client that
// emptied its bucket finds the other plan's empty too, refilling at that
// plan's rate. from 0 (not known) or l's own whole bucket changes nothing.
// The fraction is computed in float64, as the Redis script computes it,
// to the nanosecond below.
func (l *Limit) Rescale(fullAt, now, from time.Duration) time.Duration {
	d := fullAt - now
	if d <= 0 || from <= 0 || from == l.BurstTime {
		return fullAt
	}
	part := min(d, from)
	return now + time.Duration(float64(part)/float64(from)*float64(l.BurstTime)) + d - part
}

// Retune is, on l's time line, the instant of a bucket full at fullAt,
// seen at now, that the limit from wrote: its key's own limit (an
// override) was set, changed or removed, or ran out. The bucket keeps the
// tokens it had spent: a larger burst adds its extra tokens at once, a
// smaller one keeps the tokens the bucket held, up to its burst (emptied
// at burst 2 then raised to 10, it holds 8; holding 50 of 100 then
// lowered to 10, it holds 10). Tokens are counted as tokens, whatever
// the two rates, so a change never refills what was spent. What it owed
// beyond a whole bucket (a ban, a delay's reservations, a debt) it owes
// as it was. The sums are made in float64, as the Redis script makes
// them, exact while the durations are under 2⁵³ ns (104 days).
func (l *Limit) Retune(fullAt, now time.Duration, from Limit) time.Duration {
	d := fullAt - now
	if d <= 0 || from.TokenTime == l.TokenTime && from.BurstTime == l.BurstTime || from.TokenTime <= 0 {
		return fullAt
	}
	part := min(d, from.BurstTime)
	p := float64(part)
	x := math.Max(0, math.Min(p, p+float64(l.Burst)*float64(from.TokenTime)-float64(from.BurstTime)))
	if from.TokenTime != l.TokenTime {
		x = math.Floor(x / float64(from.TokenTime) * float64(l.TokenTime))
	}
	return now + time.Duration(x) + d - part
}

// With is l with the rate (TokenTime) and burst of a key's own limit: its
// ban, delay and the debt it may run up stay l's.
//
// What it keeps for the classes above (Kept) is the same share of the new
// whole bucket, computed in float64 as the Redis script computes it.
func (l Limit) With(tokenTime time.Duration, burst int64) Limit {
	from := l.BurstTime
	l.TokenTime, l.Burst, l.BurstTime = tokenTime, burst, time.Duration(burst)*tokenTime
	if l.Kept > 0 && from > 0 {
		l.Kept = ScaleKept(l.Kept, from, l.BurstTime)
	}
	return l
}

// ScaleKept is what a bucket of whole bucket to keeps of its own when
// one of whole bucket from keeps kept: the same share, to the nanosecond
// below.
func ScaleKept(kept, from, to time.Duration) time.Duration {
	return time.Duration(math.Floor(float64(kept) / float64(from) * float64(to)))
}

// Keeping is l keeping share (from 0 to below 1) of its whole bucket for
// the classes above a request's (see Kept).
func (l Limit) Keeping(share float64) Limit {
	l.Kept = 0
	if share > 0 {
		l.Kept = min(time.Duration(math.Floor(share*float64(l.BurstTime))), l.BurstTime-1)
	}
	return l
}

// Room is the whole bucket as the request's class sees it: the whole
// bucket less what it keeps for the classes above.
func (l *Limit) Room() time.Duration { return l.BurstTime - l.Kept }

// Capacity is the most whole tokens the request's class may take from a
// full bucket: the burst less the reserves of the classes above.
func (l *Limit) Capacity() int64 {
	if l.Kept == 0 {
		return l.Burst
	}
	return int64(l.Room() / l.TokenTime)
}

// Clamp is the instant of a bucket full at fullAt, seen at now, owing no
// more than it may.
func (l *Limit) Clamp(fullAt, now time.Duration) time.Duration {
	if fullAt <= now {
		return fullAt
	}
	return now + l.Debt(fullAt, now)
}

// Reach is the most a take may leave the bucket owing: a whole bucket
// less what it keeps for the classes above, and the delay unless
// NoDelay.
func (l *Limit) Reach() time.Duration {
	if l.NoDelay {
		return l.BurstTime - l.Kept
	}
	return l.BurstTime - l.Kept + l.Delay
}

// Banned reports whether a bucket that owes debt is banned: the limit
// bans, and the bucket owes more than a whole bucket.
func (l *Limit) Banned(debt time.Duration) bool { return l.Ban > 0 && debt > l.BurstTime }

// BanLeft is how long a bucket that owes debt stays banned.
func (l *Limit) BanLeft(debt time.Duration) time.Duration {
	if l.Ban == 0 {
		return 0
	}
	return max(debt-l.BurstTime, 0)
}

// Delayed is how long a request waits whose take left its bucket owing
// debt: the time its tokens are still short, at most the delay.
func (l *Limit) Delayed(debt time.Duration) time.Duration {
	return min(max(debt-l.BurstTime, 0), l.Delay)
}

// Tokens is the number of tokens, possibly fractional, in a bucket that
// owes debt, as the request's class sees it (less what it keeps for the
// classes above).
func (l *Limit) Tokens(debt time.Duration) float64 {
	return float64(l.Room()-debt) / float64(l.TokenTime)
}

// WholeTokens is the number of whole tokens in a bucket that owes debt,
// as the request's class sees it.
func (l *Limit) WholeTokens(debt time.Duration) int64 {
	return min(max(int64((l.Room()-debt)/l.TokenTime), 0), l.Capacity())
}

// NextToken is how long a bucket that owes debt needs to hold one more
// whole token than it does, as the request's class sees it: 0 when it
// holds all the class may take.
func (l *Limit) NextToken(debt time.Duration) time.Duration {
	whole := l.WholeTokens(debt)
	if whole >= l.Capacity() {
		return 0
	}
	return debt - l.Room() + time.Duration(whole+1)*l.TokenTime
}

// Wait is how long a bucket that owes debt needs before a take of cost
// succeeds: before it can give cost, less the delay that the take may
// wait out itself.
func (l *Limit) Wait(debt, cost time.Duration) time.Duration {
	return max(debt-l.Reach()+cost, 0)
}
