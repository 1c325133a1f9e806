// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package grpcform checks the refusals of gRPC requests with real gRPC:
// a grpc-go client through a real Caddy, whose reverse_proxy h2c:// leads
// to a grpc-go server of the health service. It lives in the bench module
// so that grpc-go never enters the plugin's go.mod.
package grpcform

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	_ "github.com/caddy-tokenbucket/ratelimit"
	"github.com/caddy-tokenbucket/ratelimit/bench/internal/benchkit"
)

// A zone of 4r/s burst 1: a token every 250 ms, per X-Client.
const site = `http://127.0.0.1:%d {
	rate_limit {
		zone grpc {
			key {http.request.header.X-Client}
			rate 4r/s
			burst 1
		}
%s	}
	@upstream header Content-Type application/grpc*
	handle @upstream {
		reverse_proxy h2c://%s
	}
	handle {
		respond "ok"
	}
%s}
`

// retryPolicy retries RESOURCE_EXHAUSTED up to 4 times, 10 ms apart
// without pushback: a retry that ignored the pushback would be refused
// again.
const retryPolicy = `{"methodConfig": [{
	"name": [{"service": "grpc.health.v1.Health"}],
	"retryPolicy": {
		"maxAttempts": 5,
		"initialBackoff": "0.01s",
		"maxBackoff": "0.01s",
		"backoffMultiplier": 1,
		"retryableStatusCodes": ["RESOURCE_EXHAUSTED"]
	}
}]}`

func TestGRPCRefusals(t *testing.T) {
	defer caddy.Stop()
	up := startHealth(t)

	// By default, a 429 is RESOURCE_EXHAUSTED with the bucket's wait.
	port := load(t, up.addr, "", "")
	cc := dial(t, port, "")
	t0 := time.Now()
	call(t, cc, "a").ok(t)
	refused := call(t, cc, "a")
	elapsed := time.Since(t0)
	ms := refused.refusal(t, codes.ResourceExhausted, "zone grpc: rate limit exceeded")
	// The wait is 250 ms less the time between the two decisions, at
	// most the time between sending the first call and the second's
	// answer; rounded up to whole milliseconds.
	if low := (250*time.Millisecond - elapsed).Milliseconds(); ms < low || ms > 250 {
		t.Errorf("pushback %d ms, want %d to 250: the bucket's wait, %v after the first call", ms, low, elapsed)
	}
	if tr := refused.trailer; first(tr, "retry-after") != "1" || first(tr, "x-ratelimit-limit") != "1" || first(tr, "ratelimit") == "" {
		t.Errorf("metadata %v, want Retry-After and the rate-limit headers", tr)
	}

	// A retry policy for RESOURCE_EXHAUSTED waits out the pushback, and
	// its retry is not refused again: the upstream sees the call once,
	// after exactly one earlier attempt.
	retrying := dial(t, port, retryPolicy)
	call(t, retrying, "b").ok(t)
	call(t, retrying, "b").ok(t)
	if got := up.attempts("b"); fmt.Sprint(got) != "[0 1]" {
		t.Errorf("the upstream saw calls after %v earlier attempts, want [0 1]: the second call retried once, after its pushback", got)
	}

	// Plain HTTP requests of the zone get the plain 429.
	get(t, port, "c", http.StatusOK, "")
	if hdr := get(t, port, "c", http.StatusTooManyRequests, ""); hdr.Get("Retry-After") != "1" || hdr.Get("Grpc-Status") != "" {
		t.Errorf("plain 429: Retry-After %q, grpc-status %q; want 1 and none", hdr.Get("Retry-After"), hdr.Get("Grpc-Status"))
	}
	// So does a request over HTTP/1.1 with gRPC's Content-Type: gRPC is
	// HTTP/2.
	if hdr := post(t, port, "c"); hdr.Get("Grpc-Status") != "" {
		t.Errorf("HTTP/1.1 with gRPC's Content-Type: grpc-status %q, want the plain 429", hdr.Get("Grpc-Status"))
	}

	// handle_errors shapes the plain 429s; gRPC's are written by the
	// handler, which a gRPC client can read.
	port = load(t, up.addr, "", `	handle_errors 429 {
		respond "slow down" 429
	}
`)
	cc = dial(t, port, "")
	call(t, cc, "d").ok(t)
	call(t, cc, "d").refusal(t, codes.ResourceExhausted, "zone grpc: rate limit exceeded")
	get(t, port, "e", http.StatusOK, "")
	get(t, port, "e", http.StatusTooManyRequests, "slow down")

	// With grpc_status off, a handle_errors route of docs/grpc.md answers
	// gRPC requests in gRPC's form itself.
	port = load(t, up.addr, "\t\tgrpc_status off\n", `	handle_errors 429 {
		@grpc {
			method POST
			protocol http/2+
			header Content-Type application/grpc*
		}
		header @grpc {
			Content-Type application/grpc
			Cache-Control no-store
			Grpc-Status 8
			Grpc-Message "zone {http.rate_limit.exceeded.name}: rate limit exceeded"
		}
		respond @grpc 200
		respond "slow down" 429
	}
`)
	cc = dial(t, port, "")
	call(t, cc, "i").ok(t)
	if st := status.Convert(call(t, cc, "i").err); st.Code() != codes.ResourceExhausted || st.Message() != "zone grpc: rate limit exceeded" {
		t.Errorf("handle_errors in gRPC's form: %v, want RESOURCE_EXHAUSTED", st)
	}
	get(t, port, "j", http.StatusOK, "")
	get(t, port, "j", http.StatusTooManyRequests, "slow down")
	post(t, port, "j") // gRPC's Content-Type over HTTP/1.1: the route's 429, not its 200

	// grpc_status unavailable, for retry policies of UNAVAILABLE only.
	port = load(t, up.addr, "\t\tgrpc_status unavailable\n", "")
	cc = dial(t, port, "")
	call(t, cc, "f").ok(t)
	if ms := call(t, cc, "f").refusal(t, codes.Unavailable, "zone grpc: rate limit exceeded"); ms > 250 {
		t.Errorf("pushback %d ms, want at most 250", ms)
	}

	// grpc_status off: the plain 429, which grpc-go reads as UNAVAILABLE
	// without a pushback.
	port = load(t, up.addr, "\t\tgrpc_status off\n", "")
	cc = dial(t, port, "")
	call(t, cc, "g").ok(t)
	off := call(t, cc, "g")
	if st := status.Convert(off.err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "429") || first(off.trailer, "grpc-retry-pushback-ms") != "" {
		t.Errorf("grpc_status off: %v, metadata %v; want the HTTP 429 as UNAVAILABLE, no pushback", off.err, off.trailer)
	}
	if hdr := post(t, port, "g"); hdr.Get("Retry-After") != "1" {
		t.Errorf("grpc_status off: Retry-After %q, want 1", hdr.Get("Retry-After"))
	}

	// fail_mode closed's 503 is UNAVAILABLE, with the pushback of its
	// Retry-After.
	dead := freePort(t)
	port = load(t, up.addr, fmt.Sprintf(`		store redis {
			address 127.0.0.1:%d
			fail_mode closed
			timeout 50ms
		}
`, dead), "")
	cc = dial(t, port, "")
	if ms := call(t, cc, "h").refusal(t, codes.Unavailable, "rate limit store unavailable"); ms != 1000 {
		t.Errorf("fail_mode closed: pushback %d ms, want 1000", ms)
	}
	if hdr := get(t, port, "h", http.StatusServiceUnavailable, ""); hdr.Get("Retry-After") != "1" {
		t.Errorf("fail_mode closed, plain: Retry-After %q, want 1", hdr.Get("Retry-After"))
	}
}

// An answer is what a call of the health service's Check got.
type answer struct {
	err     error
	trailer metadata.MD
}

func (a answer) ok(t *testing.T) {
	t.Helper()
	if a.err != nil {
		t.Fatalf("call: %v, want it through", a.err)
	}
}

// refusal checks a refusal in gRPC's form: the code, the message and
// google.rpc.RetryInfo, whose delay is the pushback. It returns the
// pushback in milliseconds.
func (a answer) refusal(t *testing.T, code codes.Code, msg string) int64 {
	t.Helper()
	st := status.Convert(a.err)
	if st.Code() != code || st.Message() != msg {
		t.Fatalf("call: %v, want %v %q", a.err, code, msg)
	}
	ms, err := strconv.ParseInt(first(a.trailer, "grpc-retry-pushback-ms"), 10, 64)
	if err != nil || ms < 1 {
		t.Fatalf("grpc-retry-pushback-ms %q, want a positive number: %v", a.trailer["grpc-retry-pushback-ms"], err)
	}
	details := st.Details()
	if len(details) != 1 {
		t.Fatalf("details %v, want one RetryInfo", details)
	}
	info, isInfo := details[0].(*errdetails.RetryInfo)
	if !isInfo || info.GetRetryDelay().AsDuration() != time.Duration(ms)*time.Millisecond {
		t.Errorf("details %v, want a RetryInfo of %d ms, the pushback", details, ms)
	}
	return ms
}

func call(t *testing.T, cc *grpc.ClientConn, client string) answer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "x-client", client)
	var a answer
	_, a.err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&a.trailer))
	return a
}

func dial(t *testing.T, port int, serviceConfig string) *grpc.ClientConn {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if serviceConfig != "" {
		opts = append(opts, grpc.WithDefaultServiceConfig(serviceConfig))
	}
	cc, err := grpc.NewClient(fmt.Sprintf("passthrough:///127.0.0.1:%d", port), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

// get sends a plain GET of client and checks its status and, if wantBody
// is not empty, its body.
func get(t *testing.T, port int, client string, wantStatus int, wantBody string) http.Header {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
	if err != nil {
		t.Fatal(err)
	}
	return send(t, req, client, wantStatus, wantBody)
}

// post sends a gRPC request's Content-Type over HTTP/1.1, and wants a
// 429.
func post(t *testing.T, port int, client string) http.Header {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/grpc.health.v1.Health/Check", port), strings.NewReader("\x00\x00\x00\x00\x00"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/grpc")
	return send(t, req, client, http.StatusTooManyRequests, "")
}

func send(t *testing.T, req *http.Request, client string, wantStatus int, wantBody string) http.Header {
	t.Helper()
	req.Header.Set("X-Client", client)
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != wantStatus || wantBody != "" && string(body) != wantBody {
		t.Fatalf("%s %s from %s: %d %q, want %d %q", req.Method, req.URL.Path, client, resp.StatusCode, body, wantStatus, wantBody)
	}
	return resp.Header
}

// upstream is the gRPC server behind Caddy: the health service, which
// notes, for each client, the earlier attempts of each call it gets.
type upstream struct {
	addr string
	mu   sync.Mutex
	seen map[string][]int
}

func startHealth(t *testing.T) *upstream {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &upstream{addr: l.Addr().String(), seen: map[string][]int{}}
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		n, _ := strconv.Atoi(first(md, "grpc-previous-rpc-attempts"))
		u.mu.Lock()
		u.seen[first(md, "x-client")] = append(u.seen[first(md, "x-client")], n)
		u.mu.Unlock()
		return handler(ctx, req)
	}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return u
}

func (u *upstream) attempts(client string) []int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.seen[client]
}

// load runs the site with the handler's extra options and the site's
// extra directives (whole lines, indented), with h2c, on a port of its own (the old server's
// shutdown must not touch the new one's connections), and returns the
// port.
func load(t *testing.T, upstream, options, directives string) int {
	t.Helper()
	port := freePort(t)
	caddyfile := `{
	admin off
	persist_config off
	log {
		level ERROR
	}
	grace_period 1s
	servers {
		protocols h1 h2c
	}
}
` + fmt.Sprintf(site, port, options, upstream, directives)
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		t.Fatalf("adapt: %v\n%s", err, caddyfile)
	}
	for _, w := range warnings {
		t.Errorf("adapt: %s", w)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	return port
}

func freePort(t *testing.T) int {
	t.Helper()
	port, err := benchkit.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return port
}
