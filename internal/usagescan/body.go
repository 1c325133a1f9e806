// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

import (
	"io"
	"net/http"
)

// A Body is a request's body as the zones with estimate read it: once,
// for all of them, and only a JSON body that is not compressed, of at
// most maxBody bytes (Data; Whole when it is all of the body).
type Body struct {
	read  bool   // the body was looked at
	Data  []byte // what was read of it
	Whole bool   // data is the whole body
	why   string // why data is not a JSON body read whole: "" when it is
}

// JSON is r's body read whole, if it is a JSON body that can be, or why
// it is not.
func (b *Body) JSON(r *http.Request) ([]byte, string) {
	if !b.read {
		b.read = true
		b.readJSON(r)
	}
	return b.Data, b.why
}

func (b *Body) readJSON(r *http.Request) {
	switch {
	case IsEmpty(r):
		b.Whole, b.why = true, "the request has no body"
	case IsEncoded(r.Header):
		b.why = "the request's body is compressed (Content-Encoding)"
	case !IsJSON(r.Header):
		b.why = "the request's body is not JSON (its Content-Type)"
	case r.ContentLength > maxBody:
		b.why = "the request's body is over 1 MiB"
	default:
		b.readBody(r)
	}
}

// IsEmpty reports whether r has no body.
func IsEmpty(r *http.Request) bool {
	return r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0
}

// readBody reads r's body, up to maxBody bytes and one more,
// and puts in its place a body that gives what was read, then the rest
// as the client sends it: the handlers after this one read the body as
// it came, and a body over the bound is never held whole.
func (b *Body) readBody(r *http.Request) {
	limit := maxBody + 1
	size := 4 << 10
	if r.ContentLength > 0 {
		limit = int(r.ContentLength) // the server gives no more
		size = limit
	}
	buf := make([]byte, 0, size)
	var err error
	for len(buf) < limit && err == nil {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		var n int
		n, err = r.Body.Read(buf[len(buf):min(cap(buf), limit)])
		buf = buf[:len(buf)+n]
	}
	r.Body = &replayBody{body: r.Body, rest: buf, err: err}
	b.Data = buf
	switch {
	case err != nil && err != io.EOF:
		b.why = "the request's body could not be read: the client left, or sent less than it said"
	case len(buf) > maxBody:
		b.why = "the request's body is over 1 MiB"
	default:
		b.Whole = true
	}
}

// A replayBody is a request's body whose start the estimate read: it
// gives what was read, then what ended the read (the end of the body, or
// the client's error), or, when nothing did, the rest of the body.
type replayBody struct {
	body io.ReadCloser
	rest []byte // read and not given yet
	err  error  // what ended the read: nil when the body goes on
}

func (b *replayBody) Read(p []byte) (int, error) {
	if len(b.rest) > 0 {
		n := copy(p, b.rest)
		b.rest = b.rest[n:]
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.body.Read(p)
}

func (b *replayBody) Close() error { return b.body.Close() }
