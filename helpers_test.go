// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// Tests that need Redis start their own throwaway redis-server processes on
// free ports (internal/redistest), so that they can kill, pause and
// restart them.

type redisServer = redistest.Server

func requireRedis(t testing.TB) { redistest.Require(t) }

func startRedis(t testing.TB, extra ...string) *redisServer { return redistest.Start(t, extra...) }

func startCluster(t testing.TB) []*redisServer { return redistest.StartCluster(t) }

func freePort(t testing.TB, bus int) int { return redistest.FreePort(t, bus) }

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
	storeConfigs.Store(h, h.StoreRaw)
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
		storeConfigs.Delete(h)
	})
	return h
}

// storeConfigs are the store configs of the handlers that newTestHandler
// made, which provisioning empties (Caddy lets go of a module's JSON once
// it is loaded): what the names of their keys in Redis follow.
var storeConfigs sync.Map // *Handler → json.RawMessage

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

// testTimeout is the Redis store's timeout in the tests that are not
// about timeouts: they check what Redis decides, and on a machine that
// other tests load a call may take longer than the default 100ms, after
// which fail_mode decides instead.
const testTimeout = `"timeout":"5s"`

// redisConfig is a handler config with one zone and a Redis store, with
// more store fields in storeCfg; its timeout is testTimeout unless
// storeCfg sets one.
func redisConfig(addr, zone, rate string, burst int, storeCfg string) string {
	if !strings.Contains(storeCfg, `"timeout":`) {
		storeCfg += "," + testTimeout
	}
	return fmt.Sprintf(`{"zones":[{"name":%q,"rate":%q,"burst":%d}],
		"store":{"backend":"redis","addresses":[%q],"key_prefix":"t:"%s}}`, zone, rate, burst, addr, storeCfg)
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

// The test Caddy's ports: its admin endpoint's, and the HTTP and HTTPS
// ports of the sites loaded into it. caddytest's Caddy listens on fixed
// ones by default (admin 2999), and a test whose Caddy finds that port
// taken loads its config into whichever Caddy holds it: two runs of the
// package at once (two `go test ./...`, or another checkout's) would
// serve each other's configs, and Caddy's listeners share a port
// (SO_REUSEPORT), so each run's requests would reach both. TestMain picks
// ports of this run instead (pickTestPorts); the configs and the clients
// name them through these.
var (
	adminPort, httpPort, httpsPort int
	// adminAddr is the admin endpoint, localhost:<adminPort>.
	adminAddr string
	// siteURL is the test site, http://localhost:<httpPort>, and siteIPURL
	// the same by its IP address, http://127.0.0.1:<httpPort>.
	siteURL, siteIPURL string
)

// pickTestPorts picks the test Caddy's ports: three that nothing listens
// on, each locked for this process (a lock file in the temporary folder,
// held until the process ends), so that two runs at once never pick one
// port. They lie below the kernel's ephemeral range, as caddytest's do:
// Caddy binds its listeners again at each config load, and a port of
// that range may be an outgoing connection's meanwhile, which the bind
// then finds in use.
func pickTestPorts() {
	const lo, hi = 20000, 32000 // the ephemeral range starts at 32768
	var ports []int
	for len(ports) < 3 {
		p := lo + rand.IntN(hi-lo)
		if p == 2999 || p == 9080 || p == 9443 || slices.Contains(ports, p) || !lockPort(p) {
			continue
		}
		if l, err := net.Listen("tcp", ":"+strconv.Itoa(p)); err == nil {
			l.Close()
			ports = append(ports, p)
		}
	}
	adminPort, httpPort, httpsPort = ports[0], ports[1], ports[2]
	adminAddr = "localhost:" + strconv.Itoa(adminPort)
	siteURL = "http://localhost:" + strconv.Itoa(httpPort)
	siteIPURL = "http://127.0.0.1:" + strconv.Itoa(httpPort)
	caddytest.Default.AdminPort = adminPort
}

// portLocks are the lock files of the test ports, open while the process
// lives (a file no longer referenced is closed, and its lock let go).
var portLocks []*os.File

// lockPort takes port p's lock file for this process, and reports
// whether it got it.
func lockPort(p int) bool {
	f, err := os.OpenFile(filepath.Join(os.TempDir(), fmt.Sprintf("ratelimit-test-port-%d.lock", p)), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return false
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return false
	}
	portLocks = append(portLocks, f)
	return true
}

// TestMain gives the test Caddy ports of its own (pickTestPorts) and a
// storage of its own, so that the local store's snapshots of one run
// never reach the next.
func TestMain(m *testing.M) {
	pickTestPorts()
	dir, err := os.MkdirTemp("", "ratelimit-test-storage-")
	if err != nil {
		panic(err)
	}
	caddy.DefaultStorage.Path = dir
	code := m.Run()
	os.RemoveAll(dir)
	if caddyBuild.dir != "" {
		os.RemoveAll(caddyBuild.dir)
	}
	os.Exit(code)
}

// jsonServer is a JSON config of the test Caddy whose one route runs
// handlers; the server trusts loopback proxies' X-Forwarded-For.
func jsonServer(handlers string) string {
	return fmt.Sprintf(`{
	"admin": {"listen": %q, "config": {"persist": false}},
	"apps": {
		"http": {
			"http_port": %d,
			"https_port": %d,
			"grace_period": 1,
			"servers": {
				"demo": {
					"listen": [":%[2]d"],
					"trusted_proxies": {"source": "static", "ranges": ["127.0.0.0/8"]},
					"routes": [{"handle": [%[4]s]}]
				}
			}
		},
		"pki": {"certificate_authorities": {"local": {"install_trust": false}}}
	}
}`, adminAddr, httpPort, httpsPort, handlers)
}

// jsonServerH2C is jsonServer whose server speaks HTTP/2 without TLS too
// (h2c), as gRPC clients do to a Caddy in front of gRPC services.
func jsonServerH2C(handlers string) string {
	listen := fmt.Sprintf(`"listen": [":%d"],`, httpPort)
	return strings.Replace(jsonServer(handlers), listen, listen+` "protocols": ["h1", "h2", "h2c"],`, 1)
}

// h2cClient is a client that speaks HTTP/2 without TLS (h2c), as a gRPC
// client does.
func h2cClient() *http.Client {
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	return &http.Client{Timeout: 10 * time.Second, Transport: tr}
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

// bucketReq is the demand of z's bucket for key, as decide makes it for a
// zone whose limit is fixed.
func bucketReq(z *Zone, key store.Key) store.BucketDemand {
	return store.BucketDemand{Zone: z.index, Key: key, Limit: z.limit, Cost: z.costTime, Soft: z.inDryRun}
}

// counterReq is the demand of z's quota counter for key, at now.
func counterReq(z *Zone, key store.Key, now time.Time) store.CounterDemand {
	return store.CounterDemand{Zone: z.index, Key: key, Limit: z.quota.limit, Cost: z.Cost, Window: z.quota.Window(now), Soft: z.inDryRun}
}

// bucketTableID is the key of zone z's bucket table in localTables: the
// one memstore.New asks the local store's pools for.
func bucketTableID(t *testing.T, z store.ZoneSpec) memstore.TableID {
	t.Helper()
	var ts bucketTables
	if _, err := memstore.New([]store.ZoneSpec{z}, &ts); err != nil || len(ts.ids) != 1 {
		t.Fatalf("zone %s: bucket tables %v, %v; want one", z.Name, ts.ids, err)
	}
	return ts.ids[0]
}

// bucketTables record the keys of the bucket tables a store asks for, and
// give it tables of its own.
type bucketTables struct{ ids []memstore.TableID }

func (ts *bucketTables) Buckets(id memstore.TableID, _ time.Duration) (*memstore.Table[memstore.Bucket], error) {
	ts.ids = append(ts.ids, id)
	return memstore.NewBuckets(1, time.Now()), nil
}

func (*bucketTables) Counters(memstore.TableID) (*memstore.Table[memstore.Counter], error) {
	return memstore.NewCounters(1, time.Now()), nil
}

func (*bucketTables) Slots(string) (*memstore.SlotTable, error) { return memstore.NewSlotTable(1), nil }

// slotsOf is the local slot table of h's zone z: the local store's, or
// that of the local buckets that decide when Redis fails; an empty one
// when there is neither (fail_mode open or closed).
func slotsOf(h *Handler, z *Zone) *memstore.SlotTable {
	for _, st := range []store.Store{h.fallback, h.store} {
		if ms, ok := st.(*memstore.Store); ok {
			return ms.SlotsOf(z.index)
		}
	}
	return memstore.NewSlotTable(1)
}

func init() {
	caddy.RegisterModule(passCounter{})
}

// passCounter is a handler for tests that counts the requests reaching
// it, so that a test knows what the handlers after it saw.
type passCounter struct {
	// The counter's name, for passed.
	Name string `json:"name"`
}

var passes sync.Map // name → *atomic.Int64

// passed is the number of requests that reached the passCounter
// handlers named name.
func passed(name string) *atomic.Int64 {
	v, _ := passes.LoadOrStore(name, new(atomic.Int64))
	return v.(*atomic.Int64)
}

func (passCounter) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit_test_pass_counter",
		New: func() caddy.Module { return new(passCounter) },
	}
}

func (p *passCounter) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	passed(p.Name).Add(1)
	return next.ServeHTTP(w, r)
}

// aliceHash is the bcrypt hash (cost 4, cheap for tests) of alice's
// password, "right-password".
const aliceHash = "$2a$04$y2ldnWvya6B.N76lJ5bFie1sdWRJroZP5scTca.wUnCmgcMqWxyhS"

// basicAuth is basic_auth's JSON: one account, alice.
const basicAuth = `{"handler":"authentication","providers":{"http_basic":{
	"hash":{"algorithm":"bcrypt"},
	"accounts":[{"username":"alice","password":"` + aliceHash + `"}]}}}`

// password is the Authorization header of alice with password pw.
func password(pw string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte("alice:"+pw))
}

// storeJSON is the handler's store config: local, or Redis on addrs with
// testTimeout.
func storeJSON(addrs ...string) string {
	if len(addrs) == 0 {
		return `{"backend":"local"}`
	}
	quoted := make([]string, len(addrs))
	for i, a := range addrs {
		quoted[i] = strconv.Quote(a)
	}
	return `{"backend":"redis","addresses":[` + strings.Join(quoted, ",") + `],` + testTimeout + `}`
}

// hit sends one request to the test site from client IP ip (the server
// trusts loopback's X-Forwarded-For) with header name/value pairs, and
// returns the status, the body and the Retry-After seconds (0 if none).
func hit(t *testing.T, c *http.Client, path, ip string, header ...string) (int, string, int) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, siteIPURL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Forwarded-For", ip)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	return resp.StatusCode, string(body), retry
}

// loopback is a client whose connections come from the loopback address
// 127.0.0.<n>, so that the server sees a client of its own.
func loopback(n int) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(n))}, Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, "127.0.0.1:"+strconv.Itoa(httpPort))
		},
	}}
}

// sendExpect makes a request of the client and checks its status; header holds
// name/value pairs. It returns the response's headers.
func sendExpect(t *testing.T, c *http.Client, method, path string, want int, header ...string) http.Header {
	t.Helper()
	req, err := http.NewRequest(method, siteURL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != want {
		t.Errorf("%s %s %q: status %d, want %d (RateLimit: %s)", method, path, header, resp.StatusCode, want, resp.Header.Get("RateLimit"))
	}
	return resp.Header
}

// resetBucket empties nothing and fills one bucket through the admin API,
// so that a zone name used by an earlier config starts afresh.
func resetBucket(t *testing.T, zone, key string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodDelete, "http://"+adminAddr+"/rate_limit/"+url.PathEscape(zone)+"/"+url.PathEscape(key), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
		t.Fatalf("resetting %s/%s: status %d", zone, key, resp.StatusCode)
	}
}

// loadJSON loads a JSON config into the test Caddy and waits until only
// its listeners are left (see waitLoaded).
func loadJSON(t *testing.T, config string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(config, "json")
	if t.Failed() {
		t.FailNow()
	}
	waitLoaded(t, tester)
	return tester
}

// waitLoaded waits, after a config load into the test Caddy, until only
// the new config's listeners are left, and has the clients drop the
// connections they keep alive, so that the next request reaches the new
// config. Caddy restarts its admin endpoint at every load: the new one
// listens beside the old one (SO_REUSEPORT), and the old one shuts down
// in a goroutine of its own, which on a busy machine may run after the
// load has answered. A connection that lands in the old listener
// meanwhile is reset when it closes, and one that the old server
// answered and kept alive is closed under the next request sent on it.
// Go's client sends a GET again on a fresh connection then, but not a
// PUT or a DELETE: the first admin change after a load failed with
// "connection reset by peer". caddytest's own requests (the load, its
// GETs of /config/) go through http.DefaultTransport, as do the
// package's admin requests.
func waitLoaded(t *testing.T, tester *caddytest.Tester) {
	t.Helper()
	waitOneListener(t, httpPort)
	waitOneListener(t, adminPort)
	// No new connection can reach the old admin endpoint now; drop
	// those it may have kept alive.
	http.DefaultClient.CloseIdleConnections()
	tester.Client.CloseIdleConnections()
}

// hashOf is the 32 hex digits of a key's SHA-256 that the Redis store
// names a hashed key by.
func hashOf(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:16])
}

// buildCaddy returns a Caddy built from ./cmd/caddy, and a temporary
// folder of the test's. The binary is built once a run, for the tests
// that run it (each build took a minute on a loaded machine, of the ten
// the package has), and removed when the run ends.
func buildCaddy(t *testing.T) (bin, dir string) {
	t.Helper()
	caddyBuild.once.Do(func() {
		d, err := os.MkdirTemp("", "ratelimit-test-caddy-")
		if err != nil {
			caddyBuild.err = err
			return
		}
		caddyBuild.dir, caddyBuild.bin = d, filepath.Join(d, "caddy")
		if out, err := exec.Command("go", "build", "-o", caddyBuild.bin, "./cmd/caddy").CombinedOutput(); err != nil {
			caddyBuild.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if caddyBuild.err != nil {
		t.Fatal(caddyBuild.err)
	}
	return caddyBuild.bin, t.TempDir()
}

// caddyBuild is buildCaddy's binary, its folder, and what its build
// said.
var caddyBuild struct {
	once     sync.Once
	bin, dir string
	err      error
}

// binaryGlobal is the global options of a Caddy built by buildCaddy: its
// admin API and HTTP port, its storage in dir.
func binaryGlobal(admin, port int, dir string) string {
	return fmt.Sprintf(`{
	admin localhost:%d
	http_port %d
	storage file_system %s
	persist_config off
	grace_period 1s
}
`, admin, port, filepath.Join(dir, "storage"))
}

// t0 is a named instant, as in golang.org/x/time/rate's tests.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// key is the key of text s.
func key(s string) store.Key { return store.Key{Text: s} }
