// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

import (
	"bytes"
	"strings"
)

// A pathScanner finds the number at a path of object keys in a JSON
// text fed to it in pieces, without decoding it: it follows the objects
// on the path, and skips every other value by counting brackets outside
// strings. The last number found at the path counts, and only in a text
// that ends (done) and is JSON as far as the scanner checks: the objects
// on the path, the number, and nothing but spaces after the text. A
// usage read from a text that turns out not to be JSON is not charged:
// the upstream is broken, and its client could not read it either.
type pathScanner struct {
	path   []string
	state  uint8
	depth  int  // containers open
	on     int  // of them, the outer ones on the path: objects, each the value of the next key
	key    int  // in a key: its bytes matched so far; -1 when it is not the path's key
	hit    bool // the key read is the path's
	esc    bool // in a string: the next byte is escaped
	done   bool // the text ended
	broken bool // the text is not JSON
	num    number
	found  bool  // a value was read at the path
	bad    bool  // the last value at the path was not a number
	value  int64 // the last number at the path
	at     int   // where the last value at the path starts, in its piece (see Spec.Value)
}

const (
	jStart      uint8 = iota // before the text
	jKeyOrEnd                // in an object on the path: a key or its end
	jNextKey                 // in an object on the path, after a comma
	jKey                     // in a key
	jColon                   // after a key
	jValue                   // after a colon
	jNumber                  // in the number at the path
	jScalar                  // in another number or a literal
	jString                  // in a string value
	jAfter                   // after a value in an object on the path
	jSkip                    // in a container off the path
	jSkipString              // in a string in a container off the path
	jTrail                   // after the text: spaces only
	jEnd                     // after the text, or in one that is not an object or not JSON
)

// class is what a byte means to the skipping states: 1 opens a
// container, 2 closes one, 3 starts a string.
var class = [256]uint8{'{': 1, '[': 1, '}': 2, ']': 2, '"': 3}

// after is the state after a string that ends in a state.
var after = [...]uint8{jString: jAfter, jSkipString: jSkip}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (j *pathScanner) feed(p []byte) {
	for i := 0; i < len(p); {
		c := p[i]
		switch j.state {
		case jStart, jKeyOrEnd, jNextKey, jAfter, jColon, jTrail:
			j.punctuation(c)
			i++
		case jKey:
			i = j.readKey(p, i)
		case jValue:
			if !isSpace(c) {
				j.startValue(c, i)
			}
			if j.state != jNumber {
				i++
			}
		case jNumber:
			if j.num.add(c) {
				i++
			} else {
				j.endNumber()
			}
		case jScalar:
			if c == ',' || c == '}' || c == ']' || isSpace(c) {
				j.state = jAfter
				continue
			}
			i++
		case jString, jSkipString:
			var closed bool
			if i, closed = j.skipString(p, i); closed {
				j.state = after[j.state]
			}
		case jSkip:
			i = j.skip(p, i)
		case jEnd:
			return
		}
	}
}

// punctuation reads a byte between the keys and values of the objects
// on the path.
func (j *pathScanner) punctuation(c byte) {
	switch {
	case isSpace(c):
	case j.state == jStart && c == '{':
		j.depth, j.on, j.state = 1, 1, jKeyOrEnd
	case (j.state == jKeyOrEnd || j.state == jNextKey) && c == '"':
		j.key, j.state = 0, jKey
	case j.state == jAfter && c == ',':
		j.state = jNextKey
	case (j.state == jKeyOrEnd || j.state == jAfter) && c == '}':
		j.close()
	case j.state == jColon && c == ':':
		j.state = jValue
	case j.state == jStart:
		j.state = jEnd // not an object: nothing to find
	default:
		j.broken, j.state = true, jEnd
	}
}

// startValue reads the first byte of a value, c, at i in its piece.
func (j *pathScanner) startValue(c byte, i int) {
	hit := j.hit
	j.hit = false
	switch {
	case hit && j.on == len(j.path) && (c == '-' || c >= '0' && c <= '9'):
		j.num, j.state, j.at = number{}, jNumber, i
	case hit && j.on == len(j.path):
		j.found, j.bad, j.at = true, true, i // not a number
		j.startValue(c, i)
	case c == '{' && hit:
		j.depth++
		j.on++
		j.state = jKeyOrEnd
	case c == '{' || c == '[':
		j.depth++
		j.state = jSkip
	case c == '"':
		j.esc, j.state = false, jString
	default:
		j.state = jScalar
	}
}

// endNumber reads the number at the path.
func (j *pathScanner) endNumber() {
	if !j.num.complete() { // "-", "1.", "2e"
		j.broken, j.state = true, jEnd
		return
	}
	v, why := j.num.usage()
	j.found, j.value, j.bad, j.state = true, v, why != Found, jAfter
}

// close ends an object on the path.
func (j *pathScanner) close() {
	j.depth--
	j.on--
	j.state = jAfter
	if j.depth == 0 {
		j.done, j.state = true, jTrail
	}
}

// readKey reads the key that starts at p[i], or goes on from an earlier
// piece, and reports where it stopped.
func (j *pathScanner) readKey(p []byte, i int) int {
	end, closed := j.skipString(p, i)
	seg := p[i:end]
	if closed {
		seg = seg[:len(seg)-1]
	}
	want := j.path[j.on-1]
	switch {
	case j.key < 0:
	case bytes.IndexByte(seg, '\\') >= 0 || j.key+len(seg) > len(want) || string(seg) != want[j.key:j.key+len(seg)]:
		j.key = -1
	default:
		j.key += len(seg)
	}
	if closed {
		j.hit, j.state = j.key == len(want), jColon
	}
	return end
}

// skipString skips a string from p[i], whose opening quote is behind,
// and reports where it stopped, after the closing quote if it found it.
// It finds quotes with bytes.IndexByte, so a long string costs little.
func (j *pathScanner) skipString(p []byte, i int) (int, bool) {
	for i < len(p) {
		if j.esc {
			j.esc = false
			i++
			continue
		}
		q := bytes.IndexByte(p[i:], '"')
		if q < 0 {
			j.esc = trailingBackslashes(p[i:])%2 == 1
			return len(p), false
		}
		q += i
		if trailingBackslashes(p[i:q])%2 == 0 {
			return q + 1, true
		}
		i = q + 1
	}
	return i, false
}

func trailingBackslashes(p []byte) int {
	n := 0
	for n < len(p) && p[len(p)-1-n] == '\\' {
		n++
	}
	return n
}

// skip passes over a container off the path from p[i].
func (j *pathScanner) skip(p []byte, i int) int {
	for ; i < len(p); i++ {
		switch class[p[i]] {
		case 1:
			j.depth++
		case 2:
			if j.depth--; j.depth == j.on {
				j.state = jAfter
				return i + 1
			}
		case 3:
			j.esc, j.state = false, jSkipString
			return i + 1
		}
	}
	return i
}

// result is what the scanner found in a text that ended.
func (j *pathScanner) result() (int64, Reason) {
	switch {
	case j.broken:
		return 0, BadJSON
	case !j.found:
		return 0, NoField
	case j.bad:
		return 0, NotNumber
	}
	return j.value, Found
}

// A needle is a text to find in events, by its rarest byte: a search for
// its first byte would stop at every quote or common letter of a JSON
// text.
type needle struct {
	b     []byte
	pivot int // the place in b of its rarest byte
}

// commonness ranks the bytes of JSON texts, the most common last; other
// bytes are rarer than all of these.
const commonness = `zqjxkvbywgpfmucdlhrsnioate0123456789,:{}"`

func newNeedle(s string) needle {
	n := needle{b: []byte(s)}
	rank := func(c byte) int { return strings.IndexByte(commonness, c) }
	for i := range n.b {
		if rank(n.b[i]) < rank(n.b[n.pivot]) {
			n.pivot = i
		}
	}
	return n
}

// in reports whether n is in data.
func (n *needle) in(data []byte) bool {
	c, last := n.b[n.pivot], len(data)-len(n.b)+n.pivot // the last place the pivot can be at
	for i := n.pivot; i <= last; i++ {
		j := bytes.IndexByte(data[i:last+1], c)
		if j < 0 {
			return false
		}
		i += j
		if bytes.Equal(data[i-n.pivot:i-n.pivot+len(n.b)], n.b) {
			return true
		}
	}
	return false
}
