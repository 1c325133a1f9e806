// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"math"
	"time"
)

// This file holds the token-bucket math only. It knows nothing of HTTP,
// Caddy or Redis, and never reads a clock: every instant is a parameter.
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

// A limit is the shape of a token bucket, in time: a token is worth
// tokenTime of refill, a full bucket burstTime = burst·tokenTime. Both are
// whole nanoseconds, so that the sums the math makes are exact: a full
// bucket always gives burst tokens at once, and nothing drifts. (A rate
// whose token is not a whole number of nanoseconds, such as 7r/s, is kept
// to the nearest one: 1 part in 10⁸ at most.)
type limit struct {
	tokenTime time.Duration // 1/r: time to refill one token
	burstTime time.Duration // C/r: time to refill the whole bucket from empty
	burst     int64         // C: capacity in tokens
	// ban: a denial of a bucket that is not banned yet empties it for
	// this long (then it refills as usual): fullAt moves to now + ban +
	// burstTime. 0: no ban. A bucket that owes more than burstTime is
	// banned for the excess.
	ban time.Duration
	// delay: a take that finds too few tokens but would have them within
	// delay reserves them now, so the bucket may owe up to burstTime +
	// delay, and its request waits out the excess before it goes on.
	// 0: no delay. A limit has a ban or a delay, never both: both read a
	// debt beyond burstTime, one as a ban, the other as reservations.
	delay time.Duration
	// owe: an adjustment may leave the bucket owing this much more than
	// a whole bucket: how far the true cost of a zone with usage, known
	// after the response, may take it past empty (see usage.go). A take
	// still needs its tokens, so a bucket in debt refuses until it holds
	// them again. 0: none. Never with a ban or a delay.
	owe time.Duration
	// noDelay: take as if the delay were 0 (the handler lets no more
	// requests wait); the bucket may still owe what earlier takes
	// reserved.
	noDelay bool
}

// maxBurstTime bounds C/r, and a ban: a bucket owes at most two of them,
// 200 years, which an instant holds. Sums beyond that (a take's cost on a
// banned bucket, jitter on its wait) pass the 292 years of a
// time.Duration: they are made with addSat.
const maxBurstTime = 100 * 365 * 24 * time.Hour

// maxDuration is the longest duration a sum of durations gives (addSat):
// about 292 years, in whole seconds, so that rounding it up to seconds or
// milliseconds stays within a time.Duration.
const maxDuration = math.MaxInt64 / time.Second * time.Second

// addSat is a + b, or maxDuration when that is longer: a sum that would
// wrap around to a negative duration is the longest instead, so that a
// wait never turns into none.
func addSat(a, b time.Duration) time.Duration {
	if s := a + b; b <= 0 || s >= a && s <= maxDuration {
		return s
	}
	return maxDuration
}

// maxRate is the fastest rate: a token a nanosecond.
const maxRate = 1e9

// newLimit is the shape of a bucket. The caller checks that the rate is
// at most maxRate and that burst·tokenTime is at most maxBurstTime.
func newLimit(ratePerSec float64, burst int64) limit {
	tokenTime := max(time.Duration(math.Round(float64(time.Second)/ratePerSec)), 1)
	return limit{tokenTime: tokenTime, burstTime: time.Duration(burst) * tokenTime, burst: burst}
}

// costTime is the time that n tokens are worth. n is at most the burst:
// configurations that ask for more are refused.
func (l *limit) costTime(n int64) time.Duration {
	return time.Duration(n) * l.tokenTime
}

// debt is how long a bucket full at fullAt needs, seen at now, to be full
// again: 0 when it is full, never more than it may owe (a clock that went
// backwards must not leave a bucket owing more).
func (l *limit) debt(fullAt, now time.Duration) time.Duration {
	return min(max(fullAt-now, 0), l.most())
}

// most is the most a bucket may owe: a whole bucket, and a ban, a delay
// or a debt.
func (l *limit) most() time.Duration { return l.burstTime + l.ban + l.delay + l.owe }

// take charges cost (from l.costTime) to a bucket full at fullAt. It
// returns the bucket's new instant and whether the tokens were there, or,
// with a delay, will be there within it (see delayed). When they were
// not, the bucket is unchanged, unless the limit bans and the bucket was
// not banned yet: then the denial starts a ban.
//
// Either way the instant returned is clamped to now plus a whole bucket
// (and a ban or a delay): a bucket that owes more, under a larger limit
// (its key's plan changed, see plans.go) or a clock that went back, is
// from now on an empty bucket of this limit, refilling at its rate.
//
// A cost above the whole bucket is never there, delay or not, and its
// refusal bans no one: it is the limit's fault, not the client's (a key's
// own burst below a cost that comes with each request: see
// Handler.costAboveOwnBurst).
func (l *limit) take(fullAt, now, cost time.Duration) (time.Duration, bool) {
	d := l.debt(fullAt, now)
	if addSat(d, cost) <= l.reach() && cost <= l.burstTime {
		return now + d + cost, true
	}
	if l.startsBan(d, cost) {
		return now + l.ban + l.burstTime, false
	}
	return l.clamp(fullAt, now), false
}

// startsBan reports whether a refused take of cost from a bucket that
// owes debt bans it: the limit bans, the bucket is not banned yet, and
// the cost is one a whole bucket holds.
func (l *limit) startsBan(debt, cost time.Duration) bool {
	return l.ban > 0 && !l.banned(debt) && cost <= l.burstTime
}

// adjust charges cost (a duration of tokens, as in take) to a bucket full
// at fullAt, refusing nothing: it returns the bucket's new instant. The
// bucket may owe up to l.most(); a negative
// cost gives back, but never to a banned bucket: a ban is never
// shortened.
func (l *limit) adjust(fullAt, now, cost time.Duration) time.Duration {
	d := l.debt(fullAt, now)
	if cost < 0 && l.banned(d) {
		return fullAt
	}
	return now + min(max(addSat(d, cost), 0), l.most())
}

// spend is the time n tokens are worth, n being any count a response
// reports: beyond what a bucket may owe, more than it may owe.
func (l *limit) spend(n int64) time.Duration {
	if n > int64(l.most()/l.tokenTime) {
		return l.most() + l.tokenTime
	}
	return time.Duration(n) * l.tokenTime
}

// rescale is, on l's time line, the instant of a bucket full at fullAt,
// seen at now, that a limit of whole bucket from wrote (its key's plan
// changed): it owes the same fraction of its bucket, and what it owed
// beyond a whole bucket (a ban, a delay's reservations) as it was. So a
// change of plan hands back no tokens and takes none: a client that
// emptied its bucket finds the other plan's empty too, refilling at that
// plan's rate. from 0 (not known) or l's own whole bucket changes nothing.
// The fraction is computed in float64, as the Redis script computes it,
// to the nanosecond below.
func (l *limit) rescale(fullAt, now, from time.Duration) time.Duration {
	d := fullAt - now
	if d <= 0 || from <= 0 || from == l.burstTime {
		return fullAt
	}
	part := min(d, from)
	return now + time.Duration(float64(part)/float64(from)*float64(l.burstTime)) + d - part
}

// retune is, on l's time line, the instant of a bucket full at fullAt,
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
func (l *limit) retune(fullAt, now time.Duration, from limit) time.Duration {
	d := fullAt - now
	if d <= 0 || from.tokenTime == l.tokenTime && from.burstTime == l.burstTime || from.tokenTime <= 0 {
		return fullAt
	}
	part := min(d, from.burstTime)
	p := float64(part)
	x := math.Max(0, math.Min(p, p+float64(l.burst)*float64(from.tokenTime)-float64(from.burstTime)))
	if from.tokenTime != l.tokenTime {
		x = math.Floor(x / float64(from.tokenTime) * float64(l.tokenTime))
	}
	return now + time.Duration(x) + d - part
}

// with is l with the rate (tokenTime) and burst of a key's own limit: its
// ban, delay and the debt it may run up stay l's.
func (l limit) with(tokenTime time.Duration, burst int64) limit {
	l.tokenTime, l.burst, l.burstTime = tokenTime, burst, time.Duration(burst)*tokenTime
	return l
}

// clamp is the instant of a bucket full at fullAt, seen at now, owing no
// more than it may.
func (l *limit) clamp(fullAt, now time.Duration) time.Duration {
	if fullAt <= now {
		return fullAt
	}
	return now + l.debt(fullAt, now)
}

// reach is the most a take may leave the bucket owing: a whole bucket,
// and the delay unless noDelay.
func (l *limit) reach() time.Duration {
	if l.noDelay {
		return l.burstTime
	}
	return l.burstTime + l.delay
}

// banned reports whether a bucket that owes debt is banned: the limit
// bans, and the bucket owes more than a whole bucket.
func (l *limit) banned(debt time.Duration) bool { return l.ban > 0 && debt > l.burstTime }

// banLeft is how long a bucket that owes debt stays banned.
func (l *limit) banLeft(debt time.Duration) time.Duration {
	if l.ban == 0 {
		return 0
	}
	return max(debt-l.burstTime, 0)
}

// delayed is how long a request waits whose take left its bucket owing
// debt: the time its tokens are still short, at most the delay.
func (l *limit) delayed(debt time.Duration) time.Duration {
	return min(max(debt-l.burstTime, 0), l.delay)
}

// tokens is the number of tokens, possibly fractional, in a bucket that
// owes debt.
func (l *limit) tokens(debt time.Duration) float64 {
	return float64(l.burstTime-debt) / float64(l.tokenTime)
}

// wholeTokens is the number of whole tokens in a bucket that owes debt.
func (l *limit) wholeTokens(debt time.Duration) int64 {
	return min(max(int64((l.burstTime-debt)/l.tokenTime), 0), l.burst)
}

// nextToken is how long a bucket that owes debt needs to hold one more
// whole token than it does: 0 when it is full.
func (l *limit) nextToken(debt time.Duration) time.Duration {
	whole := l.wholeTokens(debt)
	if whole >= l.burst {
		return 0
	}
	return debt - l.burstTime + time.Duration(whole+1)*l.tokenTime
}

// wait is how long a bucket that owes debt needs before a take of cost
// succeeds: before it can give cost, less the delay that the take may
// wait out itself.
func (l *limit) wait(debt, cost time.Duration) time.Duration {
	return max(debt-l.reach()+cost, 0)
}
