// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

// readUsage reads a usage from a header: a number as JSON writes it, at
// least 0, a fraction rounded up. Inf, NaN, hex and a sign of + are no
// numbers.
func readUsage(s string) (int64, Reason) {
	var n number
	for i := 0; i < len(s); i++ {
		if !n.add(s[i]) {
			return 0, NotNumber
		}
	}
	return n.usage()
}

// A number reads a JSON number a byte at a time and rounds it up to a
// whole usage exactly, however many digits it has: it keeps the first
// significant digits, more than a usage's whole part can have, and
// notes whether a digit after them is not 0. A float would read
// 1.0000000000000000000000000001 as 1 and round it up to 1, not 2, and
// 1e400 as no number rather than a big one.
type number struct {
	state  uint8
	neg    bool
	digits int64 // the first significant digits
	nd     int   // how many: at most maxDigits
	more   bool  // a significant digit after those is not 0
	point  int   // the number is 0.<digits> × 10^(point ± exp)
	exp    int
	expNeg bool
}

// maxDigits is how many significant digits a number keeps: more than
// Max has, and few enough for an int64.
const maxDigits = 18

const (
	nStart   uint8 = iota // before the number
	nMinus                // after its minus
	nZero                 // after a whole part of 0
	nWhole                // in the whole part
	nPoint                // after the decimal point
	nFrac                 // in the fraction
	nE                    // after the e
	nExpSign              // after the exponent's sign
	nExp                  // in the exponent
)

// add reads the number's next byte, and reports whether it was one: a
// byte that cannot go on the number ends it.
func (n *number) add(c byte) bool {
	digit := c >= '0' && c <= '9'
	switch s := n.state; {
	case s == nStart && c == '-':
		n.neg, n.state = true, nMinus
	case (s == nStart || s == nMinus) && c == '0':
		n.state = nZero
	case (s == nStart || s == nMinus || s == nWhole) && digit:
		n.state = nWhole
		n.point++
		n.significant(c)
	case (s == nZero || s == nWhole) && c == '.':
		n.state = nPoint
	case (s == nPoint || s == nFrac) && digit:
		n.state = nFrac
		if n.nd == 0 && c == '0' {
			n.point-- // a zero before the first significant digit
		} else {
			n.significant(c)
		}
	case (s == nZero || s == nWhole || s == nFrac) && (c == 'e' || c == 'E'):
		n.state = nE
	case s == nE && (c == '+' || c == '-'):
		n.expNeg, n.state = c == '-', nExpSign
	case (s == nE || s == nExpSign || s == nExp) && digit:
		// Past 2^20, any number is 0 or more than Max.
		n.exp, n.state = min(n.exp*10+int(c-'0'), 1<<20), nExp
	default:
		return false
	}
	return true
}

// significant reads a significant digit.
func (n *number) significant(c byte) {
	switch {
	case n.nd < maxDigits:
		n.digits = n.digits*10 + int64(c-'0')
		n.nd++
	case c != '0':
		n.more = true
	}
}

// complete reports whether the bytes read are a number, not the start
// of one.
func (n *number) complete() bool {
	return n.state == nZero || n.state == nWhole || n.state == nFrac || n.state == nExp
}

// usage is the number read, rounded up to a whole usage and at most
// Max, or why it is none.
func (n *number) usage() (int64, Reason) {
	switch {
	case !n.complete():
		return 0, NotNumber // "-", "1.", "2e"
	case n.nd == 0:
		return 0, Found // 0, or -0
	case n.neg:
		return 0, NotNumber
	}
	e := n.point + n.exp // the whole part's digits
	if n.expNeg {
		e = n.point - n.exp
	}
	switch {
	case e <= 0:
		return 1, Found // more than 0, less than 1
	case e >= maxDigits:
		return Max, Found // at least 10^17
	}
	whole, frac := n.digits, n.more
	for d := n.nd; d > e; d-- {
		frac = frac || whole%10 != 0
		whole /= 10
	}
	for d := n.nd; d < e; d++ {
		whole *= 10
	}
	if frac {
		whole++
	}
	return min(whole, Max), Found
}
