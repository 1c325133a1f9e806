// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/grpcstatus"
)

func TestIsGRPC(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc":                true,
		"application/grpc+proto":          true,
		"application/grpc+json":           true,
		"application/grpc;charset=utf-8":  true,
		"application/grpc-web":            false,
		"application/grpc-web+proto":      false,
		"application/grpc-web-text":       false,
		"application/grpc-web-text+proto": false,
		"application/grpcx":               false,
		"application/json":                false,
		"":                                false,
	} {
		req := httptest.NewRequest(http.MethodPost, "/", nil)
		req.ProtoMajor, req.ProtoMinor = 2, 0
		if ct != "" {
			req.Header.Set("Content-Type", ct)
		}
		if got := isGRPC(req); got != want {
			t.Errorf("Content-Type %q: gRPC %t, want %t", ct, got, want)
		}
	}
	// gRPC is a POST over HTTP/2 or later: no other request is, whatever
	// its Content-Type.
	for _, tc := range []struct {
		method string
		major  int
		want   bool
	}{
		{http.MethodPost, 3, true},
		{http.MethodPost, 1, false},
		{http.MethodGet, 1, false},
		{http.MethodGet, 2, false},
		{http.MethodPut, 2, false},
	} {
		req := httptest.NewRequest(tc.method, "/", nil)
		req.ProtoMajor, req.ProtoMinor = tc.major, 0
		req.Header.Set("Content-Type", "application/grpc")
		if got := isGRPC(req); got != tc.want {
			t.Errorf("%s over HTTP/%d: gRPC %t, want %t", tc.method, tc.major, got, tc.want)
		}
	}
}

// serveGRPC sends a gRPC request (a POST over HTTP/2) from ip through h.
// It returns the handler's error and the response.
func serveGRPC(h *Handler, ip string) (*httptest.ResponseRecorder, error) {
	req, rr := newRequest(ip, "Content-Type", "application/grpc+proto")
	req.Method, req.Proto, req.ProtoMajor, req.ProtoMinor = http.MethodPost, "HTTP/2.0", 2, 0
	err := h.ServeHTTP(rr, req, okHandler)
	return rr, err
}

// checkGRPCRefusal checks a Trailers-Only refusal: HTTP 200, no body, no
// cache to keep it, the gRPC code and message, a pushback of at least 1
// and at most maxMS milliseconds, and the same code, message and delay in
// grpc-status-details-bin.
func checkGRPCRefusal(t *testing.T, rr *httptest.ResponseRecorder, err error, code int, msg string, maxMS int64) {
	t.Helper()
	hdr := rr.Header()
	if err != nil || rr.Code != http.StatusOK || rr.Body.Len() != 0 || hdr.Get("Content-Type") != "application/grpc" {
		t.Fatalf("error %v, status %d, body %q, Content-Type %q; want a Trailers-Only response written by the handler",
			err, rr.Code, rr.Body, hdr.Get("Content-Type"))
	}
	if got := hdr.Get("Cache-Control"); got != "no-store" {
		t.Errorf("Cache-Control %q, want no-store: a refusal is no 200 to keep", got)
	}
	if got := hdr.Get("Grpc-Status"); got != strconv.Itoa(code) {
		t.Errorf("grpc-status %s, want %d", got, code)
	}
	if got := hdr.Get("Grpc-Message"); got != msg {
		t.Errorf("grpc-message %q, want %q", got, msg)
	}
	ms, perr := strconv.ParseInt(hdr.Get("Grpc-Retry-Pushback-Ms"), 10, 64)
	if perr != nil || ms < 1 || ms > maxMS {
		t.Errorf("grpc-retry-pushback-ms %q, want 1 to %d", hdr.Get("Grpc-Retry-Pushback-Ms"), maxMS)
	}
	unescaped, uerr := url.PathUnescape(msg)
	if uerr != nil {
		t.Fatal(uerr)
	}
	bin := hdr.Get("Grpc-Status-Details-Bin")
	details, derr := base64.RawStdEncoding.DecodeString(bin)
	if derr != nil {
		t.Fatalf("grpc-status-details-bin %q is not unpadded base64: %v", bin, derr)
	}
	if want := grpcstatus.Details(code, unescaped, msecs(ms)); string(details) != string(want) {
		t.Errorf("grpc-status-details-bin %x, want %x", details, want)
	}
	if hdr.Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
}

// A gRPC request refused by a bucket gets RESOURCE_EXHAUSTED in gRPC's
// form, written by the handler even where error routes would take a
// plain refusal (newTestHandler's handler has writeRefusals false), with
// the pushback of the bucket's wait in milliseconds; it is counted as a
// denial as any other.
func TestGRPCDenial(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"grpc é%","key":"static","rate":"4r/s","burst":1}]}`)
	if rr, err := serveGRPC(h, "192.0.2.1"); err != nil || rr.Code != http.StatusOK || rr.Header().Get("Grpc-Status") != "" {
		t.Fatalf("first request: error %v, status %d, grpc-status %q; want it through", err, rr.Code, rr.Header().Get("Grpc-Status"))
	}
	rr, err := serveGRPC(h, "192.0.2.1")
	checkGRPCRefusal(t, rr, err, grpcResourceExhausted, "zone grpc %C3%A9%25: rate limit exceeded", 250)
	if rr.Header().Get("X-Ratelimit-Limit") != "1" || rr.Header().Get("Ratelimit") == "" {
		t.Errorf("rate-limit headers %v, want them with the refusal", rr.Header())
	}
	if st := h.Zones[0].state; st.denied.Load() != 1 || st.allowed.Load() != 1 {
		t.Errorf("denied %d, allowed %d; want 1 and 1", st.denied.Load(), st.allowed.Load())
	}
	// Other requests of the zone get the plain 429 error, gRPC-Web's too,
	// and an HTTP/1.1 GET with gRPC's Content-Type.
	for _, ct := range []string{"", "application/grpc-web+proto", "application/grpc-web-text", "application/grpc"} {
		req, rr := newRequest("192.0.2.1", "Content-Type", ct)
		if err := h.ServeHTTP(rr, req, okHandler); statusOf(err) != http.StatusTooManyRequests || rr.Header().Get("Grpc-Status") != "" {
			t.Errorf("Content-Type %q: error %v, grpc-status %q; want the 429 error", ct, err, rr.Header().Get("Grpc-Status"))
		}
	}
}

// grpc_status chooses the code of a 429, or turns the gRPC form off.
func TestGRPCStatusOption(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"grpc_unavailable","key":"static","rate":"1r/m","burst":1}],"grpc_status":"unavailable"}`)
	serveGRPC(h, "192.0.2.1")
	rr, err := serveGRPC(h, "192.0.2.1")
	checkGRPCRefusal(t, rr, err, grpcUnavailable, "zone grpc_unavailable: rate limit exceeded", 60_000)

	h = newTestHandler(t, `{"zones":[{"name":"grpc_off","key":"static","rate":"1r/m","burst":1}],"grpc_status":"off"}`)
	serveGRPC(h, "192.0.2.1")
	if rr, err := serveGRPC(h, "192.0.2.1"); statusOf(err) != http.StatusTooManyRequests || rr.Header().Get("Grpc-Status") != "" {
		t.Errorf("grpc_status off: error %v, grpc-status %q; want the 429 error", err, rr.Header().Get("Grpc-Status"))
	}
	h.writeRefusals = true
	if rr, err := serveGRPC(h, "192.0.2.1"); err != nil || rr.Code != http.StatusTooManyRequests || rr.Header().Get("Grpc-Status") != "" {
		t.Errorf("grpc_status off, written: error %v, status %d, grpc-status %q; want a bare 429", err, rr.Code, rr.Header().Get("Grpc-Status"))
	}

	checkValidate(t, `{"zones":[{"name":"a","rate":"1r/s"}],"grpc_status":"RESOURCE_EXHAUSTED"}`,
		"invalid grpc_status 'RESOURCE_EXHAUSTED': expected resource_exhausted, unavailable or off")
}

// A zone with concurrency refuses a gRPC request with RESOURCE_EXHAUSTED
// and an adaptive limit sheds it with UNAVAILABLE, both with a pushback
// of a second, as their Retry-After.
func TestGRPCInFlight(t *testing.T) {
	for _, tc := range []struct {
		zone, msg string
		code      int
	}{
		{`"name":"grpc_slots","concurrency":1`, "zone grpc_slots: rate limit exceeded: no slot free", grpcResourceExhausted},
		{`"name":"grpc_shed","concurrency_adaptive":{"min":1,"max":1}`, "zone grpc_shed: rate limit: load shed", grpcUnavailable},
	} {
		h := newTestHandler(t, `{"zones":[{"key":"static",`+tc.zone+`}]}`)
		release := hold(t, h, newGate(http.StatusOK), 1)
		rr, err := serveGRPC(h, "192.0.2.1")
		release()
		checkGRPCRefusal(t, rr, err, tc.code, tc.msg, 1000)
		if got := rr.Header().Get("Grpc-Retry-Pushback-Ms"); got != "1000" {
			t.Errorf("%s: pushback %s, want 1000", tc.msg, got)
		}
	}
}

// fail_mode closed refuses a gRPC request with UNAVAILABLE, and a pushback
// of its Retry-After: 1.
func TestGRPCFailClosed(t *testing.T) {
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t, 0))
	h := newTestHandler(t, redisConfig(dead, "grpc_closed", "1r/m", 5, `,"fail_mode":"closed","timeout":"50ms"`))
	rr, err := serveGRPC(h, "192.0.2.1")
	checkGRPCRefusal(t, rr, err, grpcUnavailable, "rate limit store unavailable", 1000)
	if st := h.Zones[0].state; st.storeErrors.Load() != 1 || st.denied.Load() != 0 {
		t.Errorf("store errors %d, denied %d; want 1 and 0", st.storeErrors.Load(), st.denied.Load())
	}
}

func msecs(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

// Only a gRPC request, a POST over HTTP/2, gets gRPC's form, through a
// real Caddy: a refused HTTP/1.1 GET, or a GET over HTTP/2, that carries
// gRPC's Content-Type gets the 429 a plain request gets, never an empty
// 200 that a shared cache could keep for the URL. gRPC's own refusal
// says that no cache may keep it.
func TestGRPCFormOnlyForGRPC(t *testing.T) {
	loadJSON(t, jsonServerH2C(`{"handler":"rate_limit","zones":[{"name":"grpc-only","key":"{http.request.header.X-Client}","rate":"1r/m","burst":1}]},
		{"handler":"static_response","body":"page"}`))
	h1, h2c := &http.Client{Timeout: 10 * time.Second}, h2cClient()
	const path = "/app.js"
	sendExpect(t, h1, http.MethodGet, path, http.StatusOK, "X-Client", "a")
	for _, tc := range []struct {
		name   string
		c      *http.Client
		method string
	}{
		{"HTTP/1.1 GET", h1, http.MethodGet},
		{"HTTP/1.1 POST", h1, http.MethodPost},
		{"HTTP/2 GET", h2c, http.MethodGet},
	} {
		hdr := sendExpect(t, tc.c, tc.method, path, http.StatusTooManyRequests, "X-Client", "a", "Content-Type", "application/grpc")
		if hdr.Get("Grpc-Status") != "" || hdr.Get("Retry-After") == "" {
			t.Errorf("%s with gRPC's Content-Type: grpc-status %q, Retry-After %q; want the plain 429",
				tc.name, hdr.Get("Grpc-Status"), hdr.Get("Retry-After"))
		}
	}
	hdr := sendExpect(t, h2c, http.MethodPost, path, http.StatusOK, "X-Client", "a", "Content-Type", "application/grpc")
	if hdr.Get("Content-Type") != "application/grpc" || hdr.Get("Grpc-Status") != strconv.Itoa(grpcResourceExhausted) || hdr.Get("Cache-Control") != "no-store" {
		t.Errorf("gRPC request: headers %v; want a Trailers-Only RESOURCE_EXHAUSTED with Cache-Control: no-store", hdr)
	}
}
