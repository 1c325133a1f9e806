// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/grpcstatus"
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
	hdr["Grpc-Message"] = []string{grpcstatus.Message(msg)}
	hdr["Grpc-Retry-Pushback-Ms"] = []string{strconv.FormatInt(int64(ms), 10)}
	// gRPC's binary headers are base64 without padding.
	hdr["Grpc-Status-Details-Bin"] = []string{base64.RawStdEncoding.EncodeToString(grpcstatus.Details(code, msg, ms*time.Millisecond))}
	w.WriteHeader(http.StatusOK)
}
