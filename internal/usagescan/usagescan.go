// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package usagescan reads a request's true cost (its usage, such as an
// LLM API's tokens) from its response as the response passes, without
// decoding it: the number at a path of object keys in a JSON body or in
// the events of a text/event-stream, or in a header or trailer. It holds
// at most one event of a stream, and allocates nothing per response once
// warm. It knows nothing of zones, buckets or Caddy.
package usagescan

import (
	"bytes"
	"net/http"
	"net/textproto"
	"strings"
)

// A Spec is where a response tells its usage: the number at a path
// of object keys in a JSON body or an event stream's events, or a header
// or trailer.
type Spec struct {
	json   string   // the path as written
	path   []string // its keys
	key    needle   // the last key in quotes: an event without it has no usage
	header string   // the header, canonical
}

// JSON reads the number at path, object keys separated by dots (none
// empty).
func JSON(path string) Spec {
	keys := strings.Split(path, ".")
	return Spec{json: path, path: keys, key: newNeedle(`"` + keys[len(keys)-1] + `"`)}
}

// Header reads the number in the header (or trailer) field.
func Header(field string) Spec {
	return Spec{header: textproto.CanonicalMIMEHeaderKey(field)}
}

// same reports whether u and o read the same usage.
func (u *Spec) same(o *Spec) bool { return u.json == o.json && u.header == o.header }

// Bounds on what a response may make the scanner hold or read.
const (
	MaxBody  = 1 << 20             // a JSON body longer than this has no usage
	MaxEvent = 64 << 10            // an event longer than this is skipped
	Max      = 999_999_999_999_999 // usage above this is read as this: the largest burst
)

// A Reason is why a response has no usage: said in the log, without the
// key.
type Reason uint8

const (
	Found     Reason = iota
	NoField          // the response ended without the path or header
	NotNumber        // the value was not a number of at least 0
	NotJSON          // the response is neither JSON nor an event stream
	Encoded          // the response is compressed
	TooLong          // the JSON body is over MaxBody
	BadJSON          // the JSON body turned out not to be JSON
	Cut              // the response was cut off before its usage: the client left, or the upstream failed
)

func (r Reason) String() string { return reasons[r] }

var reasons = [...]string{
	NoField:   "the response has no such field",
	NotNumber: "the field is not a number of at least 0",
	NotJSON:   "the response is neither JSON nor an event stream",
	Encoded:   "the response is compressed (Content-Encoding): put rate_limit after encode, or have the upstream not compress",
	TooLong:   "the JSON body is over 1 MiB",
	BadJSON:   "the JSON body is not valid JSON",
	Cut:       "the response was cut off before its usage: the client left or the upstream failed",
}

// A Scanner finds a usage in a response as it passes, holding at
// most one event of a stream.
type Scanner struct {
	u         *Spec
	mode      uint8 // scanNone until the response starts, then what it is
	why       Reason
	n         int64  // bytes of a JSON body seen
	hdr       string // the header's last value as the response started
	hdrOK     bool   // the header was there
	announced bool   // the response announced the header as a trailer
	json      pathScanner
	events    sseScanner
}

const (
	scanStart  uint8 = iota // the response has not started
	scanOff                 // nothing to read in the body (why says why)
	scanJSON                // a JSON body
	scanEvents              // an event stream
	scanHeader              // a header or trailer, read at the end
)

// Reset readies s for a response of u, keeping a small event buffer: a
// large one is left to the garbage collector rather than pinned.
func (s *Scanner) Reset(u *Spec) {
	buf := s.events.buf
	if cap(buf) > 4<<10 {
		buf = nil
	}
	*s = Scanner{u: u, json: pathScanner{path: u.path}, events: sseScanner{path: u.path, key: &u.key, buf: buf[:0]}}
}

// Start reads the response's header: what its body is, or the usage
// header. That is read now, as the response starts, because Caddy's
// header handler hides a header from clients by deleting it when the
// response starts, after this handler, which runs inside it, has seen it.
func (s *Scanner) Start(h http.Header) {
	if s.u.header != "" {
		s.mode = scanHeader
		s.hdr, s.hdrOK = last(h[s.u.header])
		s.announced = announces(h["Trailer"], s.u.header)
		return
	}
	s.mode, s.why = scanOff, NotJSON
	switch {
	case IsEncoded(h):
		s.why = Encoded
	case IsJSON(h):
		s.mode = scanJSON
	case strings.EqualFold(mediaType(h), "text/event-stream"):
		s.mode = scanEvents
	}
}

// IsEncoded reports whether a body of header h is compressed: its
// Content-Encoding names a coding other than identity.
func IsEncoded(h http.Header) bool {
	e := h.Get("Content-Encoding")
	return e != "" && !strings.EqualFold(e, "identity")
}

// IsJSON reports whether a body of header h is JSON: its media type is
// application/json, or ends in +json.
func IsJSON(h http.Header) bool {
	mt := mediaType(h)
	return strings.EqualFold(mt, "application/json") || len(mt) > 5 && strings.EqualFold(mt[len(mt)-5:], "+json")
}

// mediaType is the media type of h's Content-Type, without parameters.
func mediaType(h http.Header) string {
	mt, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	return strings.TrimSpace(mt)
}

// Read is the number at u's path in body, a whole JSON text such as a
// request's, read by the rules of a response's usage: a fraction rounds
// up, a number above Max is read as Max, a text that ends early or turns
// out not to be JSON has none (BadJSON), and a body over MaxBody has
// none either (TooLong). A body without the path's last key is passed
// over at the speed of a search for one of its bytes.
func (u *Spec) Read(body []byte) (int64, Reason) {
	switch {
	case len(body) > MaxBody:
		return 0, TooLong
	case !u.key.in(body):
		return 0, NoField
	}
	j := pathScanner{path: u.path}
	j.feed(body)
	if !j.done && j.state != jEnd {
		return 0, BadJSON // the text did not end
	}
	return j.result()
}

// Reads reports whether s reads the usage u says.
func (s *Scanner) Reads(u *Spec) bool { return s.u.same(u) }

// Reading reports whether s reads the body.
func (s *Scanner) Reading() bool { return s.mode == scanJSON || s.mode == scanEvents }

// Write reads a piece of the body.
func (s *Scanner) Write(p []byte) {
	switch s.mode {
	case scanJSON:
		if s.n += int64(len(p)); s.n > MaxBody {
			s.mode, s.why = scanOff, TooLong
			return
		}
		s.json.feed(p)
	case scanEvents:
		s.events.feed(p)
	}
}

// End reads the end of the response, of header h: whole says whether it
// ended as it should. It reports the usage, or why there is none. A
// response cut off still has the usage read before the cut: a stream's
// complete event, a JSON text that had ended. The client had it, and
// could leave before the last bytes just to be charged less.
func (s *Scanner) End(h http.Header, whole bool) (int64, Reason) {
	if s.mode == scanStart {
		s.Start(h)
	}
	switch s.mode {
	case scanHeader:
		// A trailer wins: set with Go's TrailerPrefix, or announced in
		// the Trailer header and then given to the header map under its
		// own name, after the header's values, as reverse_proxy does.
		v, ok := last(h[http.TrailerPrefix+s.u.header])
		if !ok && s.announced {
			v, ok = last(h[s.u.header])
		}
		if !ok {
			v, ok = s.hdr, s.hdrOK
		}
		if !ok {
			return 0, NoField
		}
		return readUsage(strings.TrimSpace(v))
	case scanJSON:
		if !s.json.done && s.json.state != jEnd {
			return 0, Cut
		}
		return s.json.result()
	case scanEvents:
		switch {
		case s.events.found:
			return s.events.value, Found
		case !whole:
			return 0, Cut
		}
		return 0, cmpReason(s.events.why, NoField)
	}
	return 0, s.why
}

// last is the last of a field's values: the one the response gave last.
func last(v []string) (string, bool) {
	if len(v) == 0 {
		return "", false
	}
	return v[len(v)-1], true
}

// announces reports whether the values of a Trailer header name the
// field, canonical.
func announces(trailer []string, field string) bool {
	for _, v := range trailer {
		for v != "" {
			var name string
			name, v, _ = strings.Cut(v, ",")
			if strings.EqualFold(strings.TrimSpace(name), field) {
				return true
			}
		}
	}
	return false
}

func cmpReason(a, b Reason) Reason {
	if a != Found {
		return a
	}
	return b
}

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
				j.startValue(c)
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

// startValue reads the first byte of a value.
func (j *pathScanner) startValue(c byte) {
	hit := j.hit
	j.hit = false
	switch {
	case hit && j.on == len(j.path) && (c == '-' || c >= '0' && c <= '9'):
		j.num, j.state = number{}, jNumber
	case hit && j.on == len(j.path):
		j.found, j.bad = true, true // not a number
		j.startValue(c)
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

// An sseScanner reads the events of a text/event-stream: each event's
// data, up to MaxEvent bytes, is read as JSON for the path. Lines
// end with LF, CR or CRLF; a field without a colon has an empty value.
type sseScanner struct {
	path  []string
	key   *needle // the path's last key in quotes: an event without it has no usage
	buf   []byte  // the event's data
	state uint8
	name  [4]byte // the field name so far
	nn    int
	over  bool // the event's data is over MaxEvent: skipped
	cr    bool // the last byte was a CR: a LF now ends no line
	bom   int  // the stream's first bytes that match a byte order mark; len(bom) once past it
	found bool
	value int64
	why   Reason // why the last event with the path had no usage
}

const (
	sLine  uint8 = iota // at a line's start
	sName               // in a field's name
	sSpace              // after the colon: one space is skipped
	sData               // in a data field's value
	sOther              // in a line that is not data
)

func (e *sseScanner) feed(p []byte) {
	if e.bom < len(bom) {
		if p = e.skipBOM(p); len(p) == 0 {
			return
		}
	}
	if e.state == sLine && !e.cr && bytes.IndexByte(p, '\r') < 0 {
		if len(e.buf) == 0 && !e.over && bytes.HasSuffix(p, blankLine) && !e.key.in(p) {
			return // whole events, none of which has the path
		}
		p = e.lines(p)
	}
	for i := 0; i < len(p); {
		c := p[i]
		if e.cr {
			e.cr = false
			if c == '\n' {
				i++
				continue
			}
		}
		switch e.state {
		case sLine:
			if c == '\n' || c == '\r' {
				e.dispatch()
				e.cr = c == '\r'
				i++
				continue
			}
			e.nn, e.state = 0, sName
		case sName:
			e.name1(c)
			i++
		case sSpace:
			e.state = sData
			if c == ' ' {
				i++
			}
		case sData, sOther:
			end := lineEnd(p[i:])
			if e.state == sData {
				e.add(p[i : i+end])
			}
			if i += end; i < len(p) {
				if e.state == sData {
					e.add(nil)
				}
				e.cr, e.state = p[i] == '\r', sLine
				i++
			}
		}
	}
}

// bom is UTF-8's byte order mark, which a stream may start with: the
// SSE spec has it ignored.
var bom = []byte("\xEF\xBB\xBF")

// skipBOM passes over the byte order mark at the start of the stream,
// whatever its pieces, and returns the rest of p.
func (e *sseScanner) skipBOM(p []byte) []byte {
	for ; e.bom < len(bom) && len(p) > 0; p = p[1:] {
		if p[0] != bom[e.bom] {
			// Not a BOM: the bytes that looked like one are the stream's.
			seen := e.bom
			e.bom = len(bom)
			e.feed(bom[:seen])
			return p
		}
		e.bom++
	}
	return p
}

// name1 reads a byte of a field's name.
func (e *sseScanner) name1(c byte) {
	switch {
	case c == ':':
		e.state = sOther
		if e.isData() {
			e.state = sSpace
		}
	case c == '\n' || c == '\r':
		if e.isData() {
			e.add(nil) // data with an empty value
		}
		e.cr, e.state = c == '\r', sLine
	default:
		if e.nn < len(e.name) {
			e.name[e.nn] = c
		}
		e.nn++
	}
}

func (e *sseScanner) isData() bool { return e.nn == 4 && string(e.name[:]) == "data" }

// add appends a piece of a data line to the event's data, or, with nil,
// the line feed that ends the line.
func (e *sseScanner) add(p []byte) {
	if e.over {
		return
	}
	if p == nil {
		p = newline
	}
	if len(e.buf)+len(p) > MaxEvent {
		e.over, e.buf = true, e.buf[:0]
		return
	}
	e.buf = append(e.buf, p...)
}

var newline, blankLine = []byte{'\n'}, []byte("\n\n")

// lineEnd is the length of p's line: up to its first CR or LF.
func lineEnd(p []byte) int {
	n := bytes.IndexByte(p, '\n')
	if n < 0 {
		n = len(p)
	}
	if r := bytes.IndexByte(p[:n], '\r'); r >= 0 {
		return r
	}
	return n
}

// dispatch ends an event: its data is read for the path.
func (e *sseScanner) dispatch() {
	data, over := e.buf, e.over
	e.buf, e.over = e.buf[:0], false
	if !over {
		e.read(data)
	}
}

// lines reads the whole lines of p, which starts a line and holds no CR
// (most streams), and returns what is left: the start of a line. An
// event of one data line whole in p is read where it is, not copied.
func (e *sseScanner) lines(p []byte) []byte {
	for {
		n := bytes.IndexByte(p, '\n')
		if n < 0 {
			return p
		}
		line := p[:n]
		p = p[n+1:]
		switch {
		case n == 0:
			e.dispatch()
		case n >= 5 && string(line[:5]) == "data:":
			v := line[5:]
			if len(v) > 0 && v[0] == ' ' {
				v = v[1:]
			}
			if len(e.buf) == 0 && !e.over && len(p) > 0 && p[0] == '\n' {
				if len(v)+1 <= MaxEvent {
					e.read(v) // the event is this line
				}
				p = p[1:]
				continue
			}
			e.add(v)
			e.add(nil)
		case string(line) == "data":
			e.add(nil)
		}
	}
}

// read reads an event's data for the path.
func (e *sseScanner) read(data []byte) {
	if len(data) == 0 || !e.key.in(data) {
		return
	}
	j := pathScanner{path: e.path}
	j.feed(data)
	if !j.done {
		return // [DONE], or not JSON
	}
	switch v, why := j.result(); why {
	case Found:
		e.found, e.value, e.why = true, v, Found
	case NotNumber:
		e.why = why
	}
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
