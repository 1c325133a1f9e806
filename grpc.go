// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
)

// A gRPC client never sees a 429: a response without grpc-status is
// UNAVAILABLE to it, whatever its HTTP status, and it ignores
// Retry-After. So a refused gRPC request is answered in gRPC's form (the
// grpc/grpc repository's doc/PROTOCOL-HTTP2.md and
// doc/http-grpc-status-mapping.md, and gRFC A6 for the pushback): a
// Trailers-Only response, HTTP 200 with grpc-status and grpc-message in
// its headers and no body, with grpc-retry-pushback-ms for the client's
// retry policy and google.rpc.RetryInfo for its application code.

// The gRPC status codes a refusal is answered with.
const (
	grpcResourceExhausted = 8  // a per-user quota or rate limit
	grpcUnavailable       = 14 // the server cannot serve now
)

// grpcStatuses are the values of grpc_status: the code of a 429 for a
// gRPC request, 0 for no gRPC form.
var grpcStatuses = map[string]int{
	"resource_exhausted": grpcResourceExhausted,
	"unavailable":        grpcUnavailable,
	"off":                0,
}

func checkGRPCStatus(s string) error {
	if _, ok := grpcStatuses[s]; !ok {
		return fmt.Errorf("invalid grpc_status '%s': expected resource_exhausted, unavailable or off", s)
	}
	return nil
}

// isGRPC reports whether r is a gRPC request: a POST over HTTP/2 or
// later (gRPC is nothing else: PROTOCOL-HTTP2.md) whose Content-Type is
// application/grpc, or that followed by "+codec" or, as grpc-go's server
// also accepts, by ";". Any other request gets the plain refusal, whatever
// its Content-Type: an HTTP/1.1 GET that carries gRPC's would otherwise
// turn a 429 into an empty 200, which a shared cache in front of Caddy
// may keep for the URL and serve to everyone. gRPC-Web
// (application/grpc-web...) is not gRPC either: its clients read HTTP
// statuses.
func isGRPC(r *http.Request) bool {
	if r.ProtoMajor < 2 || r.Method != http.MethodPost {
		return false
	}
	ct := r.Header["Content-Type"]
	if len(ct) == 0 {
		return false
	}
	rest, ok := strings.CutPrefix(ct[0], "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// writeGRPC answers a refused gRPC request in gRPC's form: the refusal's
// HTTP status (429, or 503) as its gRPC code, msg with the zone z (if
// any) as grpc-message, and wait as the pushback and the RetryInfo, in
// whole milliseconds rounded up, so that a retry after it comes when the
// tokens are there. The rate-limit headers already set go with it.
func (h *Handler) writeGRPC(w http.ResponseWriter, status int, wait time.Duration, z *Zone, msg string) {
	code := grpcUnavailable
	if status == http.StatusTooManyRequests {
		code = h.grpcCode
	}
	if z != nil {
		msg = "zone " + z.Name + ": " + msg
	}
	ms := gcra.AddSat(wait, time.Millisecond-1) / time.Millisecond
	hdr := w.Header()
	hdr["Content-Type"] = []string{"application/grpc"}
	// An HTTP 200 that is no success: no cache keeps it (gRPC clients
	// read the header as metadata, and ignore it).
	hdr["Cache-Control"] = []string{"no-store"}
	hdr["Grpc-Status"] = []string{strconv.Itoa(code)}
	hdr["Grpc-Message"] = []string{percentEncode(msg)}
	hdr["Grpc-Retry-Pushback-Ms"] = []string{strconv.FormatInt(int64(ms), 10)}
	// gRPC's binary headers are base64 without padding.
	hdr["Grpc-Status-Details-Bin"] = []string{base64.RawStdEncoding.EncodeToString(statusProto(code, msg, ms*time.Millisecond))}
	w.WriteHeader(http.StatusOK)
}

// percentEncode encodes a grpc-message: UTF-8 with every byte outside
// printable ASCII, and '%', as %XX.
func percentEncode(s string) string {
	const hex = "0123456789ABCDEF"
	var b []byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= ' ' && c <= '~' && c != '%' {
			if b != nil {
				b = append(b, c)
			}
			continue
		}
		if b == nil {
			b = append(make([]byte, 0, len(s)+16), s[:i]...)
		}
		b = append(b, '%', hex[c>>4], hex[c&15])
	}
	if b == nil {
		return s
	}
	return string(b)
}

// retryInfoType is the type URL of google.rpc.RetryInfo in an Any.
const retryInfoType = "type.googleapis.com/google.rpc.RetryInfo"

// statusProto is the protobuf encoding of a google.rpc.Status of code and
// msg, whose one detail is a google.rpc.RetryInfo of delay:
//
//	Status    { int32 code = 1; string message = 2; repeated Any details = 3; }
//	Any       { string type_url = 1; bytes value = 2; }
//	RetryInfo { Duration retry_delay = 1; }
//	Duration  { int64 seconds = 1; int32 nanos = 2; }
//
// Fields of zero value are left out, as proto3 encodes them.
func statusProto(code int, msg string, delay time.Duration) []byte {
	var d []byte
	if s := uint64(delay / time.Second); s != 0 {
		d = protoVarint(d, 1, s)
	}
	if n := uint64(delay % time.Second); n != 0 {
		d = protoVarint(d, 2, n)
	}
	info := protoBytes(nil, 1, d)
	detail := protoBytes(protoBytes(nil, 1, retryInfoType), 2, info)
	st := protoVarint(nil, 1, uint64(code))
	if msg != "" {
		st = protoBytes(st, 2, msg)
	}
	return protoBytes(st, 3, detail)
}

// protoVarint appends field number f as a varint (wire type 0).
func protoVarint(b []byte, f, v uint64) []byte {
	return binary.AppendUvarint(binary.AppendUvarint(b, f<<3), v)
}

// protoBytes appends field number f as length-delimited bytes (wire type
// 2): a string, or an embedded message.
func protoBytes[T string | []byte](b []byte, f uint64, v T) []byte {
	b = binary.AppendUvarint(binary.AppendUvarint(b, f<<3|2), uint64(len(v)))
	return append(b, v...)
}
