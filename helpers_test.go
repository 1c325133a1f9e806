// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// Tests that need Redis start their own throwaway redis-server processes on
// free ports, so that they can kill, pause and restart them.

// requireRedis skips the test, loudly, when redis-server is missing, and
// fails it in CI, where the Redis tests must run.
func requireRedis(t testing.TB) {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s not found: CI must run the Redis tests (apt-get install redis-server)", bin)
			}
			t.Skipf("REDIS TESTS SKIPPED: %s not found in PATH (apt-get install redis-server)", bin)
		}
	}
}

type redisServer struct {
	t    testing.TB
	port int
	dir  string
	args []string
	cmd  *exec.Cmd
}

// startRedis starts a redis-server that keeps nothing on disk.
func startRedis(t testing.TB, extra ...string) *redisServer {
	t.Helper()
	requireRedis(t)
	r := &redisServer{t: t, port: freePort(t, 0), dir: t.TempDir()}
	r.args = append([]string{"--bind", "127.0.0.1", "--port", strconv.Itoa(r.port),
		"--save", "", "--appendonly", "no", "--dir", r.dir}, extra...)
	r.start()
	t.Cleanup(r.kill)
	return r
}

func (r *redisServer) start() {
	r.t.Helper()
	r.cmd = exec.Command("redis-server", r.args...)
	r.cmd.Dir = r.dir
	if err := r.cmd.Start(); err != nil {
		r.t.Fatalf("starting redis-server: %v", err)
	}
	r.waitReady()
}

func (r *redisServer) waitReady() {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if out, err := r.tryCLI("PING"); err == nil && out == "PONG" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.t.Fatalf("redis-server on port %d did not start", r.port)
}

func (r *redisServer) addr() string { return "127.0.0.1:" + strconv.Itoa(r.port) }

// kill stops the server at once, as a crash would.
func (r *redisServer) kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Signal(syscall.SIGCONT)
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
		r.cmd = nil
	}
}

// restart starts the server again on the same port, empty.
func (r *redisServer) restart() { r.kill(); r.start() }

// pause freezes the server: connections stay open, nothing answers.
func (r *redisServer) pause()  { _ = r.cmd.Process.Signal(syscall.SIGSTOP) }
func (r *redisServer) resume() { _ = r.cmd.Process.Signal(syscall.SIGCONT) }

func (r *redisServer) tryCLI(args ...string) (string, error) {
	out, err := exec.Command("redis-cli", append([]string{"-p", strconv.Itoa(r.port)}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (r *redisServer) cli(args ...string) string {
	r.t.Helper()
	out, err := r.tryCLI(args...)
	if err != nil {
		r.t.Fatalf("redis-cli %v: %v: %s", args, err, out)
	}
	return out
}

// calls is how many times Redis has run a script.
func (r *redisServer) calls() int {
	r.t.Helper()
	n := 0
	for _, line := range strings.Split(r.cli("INFO", "commandstats"), "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd); ok {
				v, _, _ := strings.Cut(rest, ",")
				c, _ := strconv.Atoi(v)
				n += c
			}
		}
	}
	return n
}

// freePort finds a free TCP port; with bus > 0 also port+bus is free
// (Redis Cluster's bus port).
func freePort(t testing.TB, bus int) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if bus == 0 {
			return port
		}
		if port+bus < 65536 {
			if l2, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+bus)); err == nil {
				l2.Close()
				return port
			}
		}
	}
	t.Fatal("no free port")
	return 0
}

// startCluster starts a Redis Cluster of three masters.
func startCluster(t testing.TB) []*redisServer {
	t.Helper()
	requireRedis(t)
	var nodes []*redisServer
	var addrs []string
	for range 3 {
		r := &redisServer{t: t, port: freePort(t, 10000), dir: t.TempDir()}
		r.args = []string{"--bind", "127.0.0.1", "--port", strconv.Itoa(r.port), "--save", "", "--appendonly", "no",
			"--dir", r.dir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"}
		r.start()
		t.Cleanup(r.kill)
		nodes = append(nodes, r)
		addrs = append(addrs, r.addr())
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v: %s", err, out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, n := range nodes {
		for !strings.Contains(n.cli("CLUSTER", "INFO"), "cluster_state:ok") {
			if time.Now().After(deadline) {
				t.Fatal("cluster did not come up")
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nodes
}

// writeFile writes a file into dir and returns its path.
func writeFile(t testing.TB, dir, name, text string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// newTestHandler provisions a handler from its JSON config, as Caddy
// would, and cleans it up when the test ends.
func newTestHandler(t testing.TB, config string) *Handler {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := new(Handler)
	if err := json.Unmarshal([]byte(config), h); err != nil {
		t.Fatalf("config: %v", err)
	}
	if err := h.Provision(ctx); err != nil {
		cancel()
		t.Fatalf("provision: %v", err)
	}
	if err := h.Validate(); err != nil {
		cancel()
		t.Fatalf("validate: %v", err)
	}
	t.Cleanup(func() {
		if err := h.Cleanup(); err != nil {
			t.Error(err)
		}
		cancel()
	})
	return h
}

// newRequest is a request from client IP ip, as Caddy's server would
// hand it to a handler, with header name/value pairs.
func newRequest(ip string, header ...string) (*http.Request, *httptest.ResponseRecorder) {
	req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, map[string]any{"client_ip": ip}))
	caddyhttp.NewTestReplacer(req)
	return req, httptest.NewRecorder()
}

// okHandler is the next handler: it answers 200.
var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// statusOf is the status Caddy would answer for a handler's error.
func statusOf(err error) int {
	var he caddyhttp.HandlerError
	if errors.As(err, &he) {
		return he.StatusCode
	}
	return -1
}

// serve sends one request from client IP ip through h and returns the
// status the client would get and the response headers.
func serve(h *Handler, ip string, header ...string) (int, http.Header) {
	req, rr := newRequest(ip, header...)
	if err := h.ServeHTTP(rr, req, okHandler); err != nil {
		return statusOf(err), rr.Header()
	}
	return rr.Code, rr.Header()
}

// nowForTest is the clock reading a test passes to a store.
func nowForTest() time.Time { return time.Now() }

// redisConfig is a handler config with one zone and a Redis store.
func redisConfig(addr, zone, rate string, burst int, store string) string {
	return fmt.Sprintf(`{"zones":[{"name":%q,"rate":%q,"burst":%d}],
		"store":{"backend":"redis","addresses":[%q],"key_prefix":"t:"%s}}`, zone, rate, burst, addr, store)
}

// newRedisClient is a plain client for checking what the store wrote.
func newRedisClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return c
}

// waitOneListener waits until one socket listens on port. A config load
// opens the new config's listener beside the old one (SO_REUSEPORT) and
// closes the old one shortly after: a connection that lands in the old
// one meanwhile is reset, which a scenario must not count against the
// handler.
func waitOneListener(t *testing.T, port int) {
	t.Helper()
	suffix := fmt.Sprintf(":%04X", port)
	deadline := time.Now().Add(5 * time.Second)
	for {
		n := 0
		for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return // not Linux: nothing to wait for
			}
			for _, line := range strings.Split(string(b), "\n")[1:] {
				fields := strings.Fields(line)
				if len(fields) > 3 && fields[3] == "0A" && strings.HasSuffix(fields[1], suffix) {
					n++
				}
			}
		}
		if n <= 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sockets still listen on port %d", n, port)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestMain gives the test Caddy a storage of its own, so that the local
// store's snapshots of one run never reach the next.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ratelimit-test-storage-")
	if err != nil {
		panic(err)
	}
	caddy.DefaultStorage.Path = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// jsonServer is a JSON config of the test Caddy whose one route runs
// handlers; the server trusts loopback proxies' X-Forwarded-For.
func jsonServer(handlers string) string {
	return `{
	"admin": {"listen": "localhost:2999", "config": {"persist": false}},
	"apps": {
		"http": {
			"http_port": 9080,
			"https_port": 9443,
			"grace_period": 1,
			"servers": {
				"demo": {
					"listen": [":9080"],
					"trusted_proxies": {"source": "static", "ranges": ["127.0.0.0/8"]},
					"routes": [{"handle": [` + handlers + `]}]
				}
			}
		},
		"pki": {"certificate_authorities": {"local": {"install_trust": false}}}
	}
}`
}

// checkValidate decodes a handler's JSON, refusing unknown fields, and
// checks that Validate fails with an error containing wantErr, or
// succeeds when wantErr is "".
func checkValidate(t *testing.T, in, wantErr string) {
	t.Helper()
	var h Handler
	dec := json.NewDecoder(strings.NewReader(in))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		t.Fatalf("decoding %s: %v", in, err)
	}
	err := h.Validate()
	switch {
	case wantErr == "" && err != nil:
		t.Errorf("unexpected error: %v", err)
	case wantErr != "" && err == nil:
		t.Errorf("expected error containing %q, got none", wantErr)
	case wantErr != "" && !strings.Contains(err.Error(), wantErr):
		t.Errorf("error %q does not contain %q", err, wantErr)
	}
}
