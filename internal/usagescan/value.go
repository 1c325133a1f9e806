// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

import (
	"bytes"
	"unicode/utf16"
	"unicode/utf8"
)

// Value is the value at u's path in body, a whole JSON text such as a
// request's, as a placeholder gives it: a string unescaped, a number in
// its JSON text, true or false. The path is followed as Read follows it
// (a key written with an escape is not the path's), and the last value
// at the path counts. ok is false when there is none: the body is over
// maxBody, is not an object, or turns out not to be JSON, or the path's
// last value is absent, null, an object or an array. A body without the
// path's last key is passed over at the speed of a search for one of its
// bytes.
func (u *Spec) Value(body []byte) (v string, ok bool) {
	if len(body) > maxBody || !u.key.in(body) {
		return "", false
	}
	j := pathScanner{path: u.path}
	j.feed(body) // in one piece: j.at is a place in body
	if j.broken || !j.found || !j.done && j.state != jEnd {
		return "", false
	}
	return valueAt(body[j.at:])
}

// valueAt is the value that starts b, a JSON text whose scan found no
// fault, as Value gives it.
func valueAt(b []byte) (string, bool) {
	switch c := b[0]; {
	case c == '"':
		return unquote(b[1:])
	case c == '-' || c >= '0' && c <= '9':
		var n number
		i := 0
		for i < len(b) && n.add(b[i]) {
			i++
		}
		return string(b[:i]), true
	}
	for _, lit := range [...]string{"true", "false"} {
		if len(b) > len(lit) && string(b[:len(lit)]) == lit && ends(b[len(lit)]) {
			return lit, true
		}
	}
	return "", false // null, an object, an array, or no JSON literal
}

// ends reports whether c ends a literal in an object.
func ends(c byte) bool { return c == ',' || c == '}' || isSpace(c) }

// unquote is the JSON string that b starts with, after its opening
// quote, unescaped.
func unquote(b []byte) (string, bool) {
	q := bytes.IndexByte(b, '"')
	if q < 0 {
		return "", false
	}
	if bytes.IndexByte(b[:q], '\\') < 0 {
		return string(b[:q]), true
	}
	return unescape(b)
}

// unescape is unquote for a string with escapes, read as encoding/json
// reads them: a \u escape of half a surrogate pair not followed by the
// other half is U+FFFD. An escape that JSON has not is no string.
func unescape(b []byte) (string, bool) {
	out := make([]byte, 0, len(b))
	for i := 0; i < len(b); {
		switch c := b[i]; {
		case c == '"':
			return string(out), true
		case c != '\\':
			out = append(out, c)
			i++
			continue
		case i+1 == len(b):
			return "", false
		}
		switch e := b[i+1]; e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := hex4(b[i+2:])
			if !ok {
				return "", false
			}
			i += 6
			if utf16.IsSurrogate(r) {
				r2, ok := rune(-1), len(b) > i+1 && b[i] == '\\' && b[i+1] == 'u'
				if ok {
					r2, ok = hex4(b[i+2:])
				}
				if r = utf16.DecodeRune(r, r2); r != utf8.RuneError && ok {
					i += 6
				}
			}
			out = utf8.AppendRune(out, r)
			continue
		default:
			return "", false
		}
		i += 2
	}
	return "", false
}

// hex4 reads the four hex digits of a \u escape at the start of b.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}
