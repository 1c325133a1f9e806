// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package usagescan reads a request's true cost (its usage, such as an
// LLM API's tokens) from its response as the response passes, without
// decoding it: the number at a path of object keys in a JSON body or in
// the events of a text/event-stream, or in a header or trailer. It holds
// at most one event of a stream, and allocates nothing per response once
// warm. A request's JSON body it reads whole, once: the number at a path
// (an estimate), or the value at a path as a placeholder gives it. It
// knows nothing of zones, buckets or Caddy.
package usagescan

import (
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
	maxBody  = 1 << 20             // a JSON body longer than this has no usage
	maxEvent = 64 << 10            // an event longer than this is skipped
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
	TooLong          // the JSON body is over maxBody
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
// out not to be JSON has none (BadJSON), and a body over maxBody has
// none either (TooLong). A body without the path's last key is passed
// over at the speed of a search for one of its bytes.
func (u *Spec) Read(body []byte) (int64, Reason) {
	switch {
	case len(body) > maxBody:
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
		if s.n += int64(len(p)); s.n > maxBody {
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
