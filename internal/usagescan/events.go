// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

import "bytes"

// An sseScanner reads the events of a text/event-stream: each event's
// data, up to maxEvent bytes, is read as JSON for the path. Lines
// end with LF, CR or CRLF; a field without a colon has an empty value.
type sseScanner struct {
	path  []string
	key   *needle // the path's last key in quotes: an event without it has no usage
	buf   []byte  // the event's data
	state uint8
	name  [4]byte // the field name so far
	nn    int
	over  bool // the event's data is over maxEvent: skipped
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
	if len(e.buf)+len(p) > maxEvent {
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
				if len(v)+1 <= maxEvent {
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
