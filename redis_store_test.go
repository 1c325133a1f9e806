// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func TestRedisKeysAndTTL(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "ttl", "7r/s", 5, ""))
	if code, _ := serve(h, "192.0.2.7"); code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	c := newRedisClient(t, r.Addr())
	ctx := context.Background()
	hash, field := bucketOf(h, 0, "192.0.2.7")
	if !strings.HasPrefix(hash, "t:{") || len(hash) != len("t:{0000}") || !regexp.MustCompile(`^ttl:[A-Za-z0-9_-]{4}:192\.0\.2\.7$`).MatchString(field) {
		t.Fatalf("bucket %q %q, want field ttl:<shape>:192.0.2.7 of t:{<group>}", hash, field)
	}
	ttl, err := c.PTTL(ctx, hash).Result()
	if err != nil || ttl <= 0 || ttl > 143*time.Millisecond {
		t.Fatalf("PTTL %s = %v, %v; want about 143ms (one token's refill)", hash, ttl, err)
	}
	// The instant is whole nanoseconds since 2025, stored as an integer:
	// a token of 7r/s is not a whole number of microseconds, and its
	// nanoseconds survive the trip through Lua.
	v, err := c.HGet(ctx, hash, field).Result()
	ns, perr := strconv.ParseInt(v, 10, 64)
	if err != nil || perr != nil || ns < 5e16 || ns%1000 == 0 {
		t.Fatalf("stored instant %q, %v, %v", v, err, perr)
	}
	if enc, _ := c.ObjectEncoding(ctx, hash).Result(); enc != "listpack" && enc != "ziplist" {
		t.Fatalf("hash encoding %q, want listpack", enc)
	}
	time.Sleep(ttl + 20*time.Millisecond)
	if n, _ := c.Exists(ctx, hash).Result(); n != 0 {
		t.Fatal("hash outlived its bucket's refill")
	}

	// IPv6 clients are grouped by /64, and hash_keys hides the address.
	h = newTestHandler(t, redisConfig(r.Addr(), "v6", "10r/s", 5, `,"hash_keys":true`))
	serve(h, "2001:db8::1")
	hash, field = bucketOf(h, 0, "2001:db8::1")
	fields, _ := c.HKeys(ctx, hash).Result()
	if len(fields) != 1 || fields[0] != field || strings.Contains(field, "2001") || len(field) != len("v6:tag_:")+32 {
		t.Fatalf("fields %q: want one hashed key", fields)
	}
	serve(h, "2001:db8::2:3")
	if fields, _ := c.HKeys(ctx, hash).Result(); len(fields) != 1 {
		t.Fatalf("fields %q: one /64 must share one bucket", fields)
	}
}

// The names of the keys the Redis store writes, as docs/redis.md lays
// them out, for what a test reads and writes in Redis behind the store.

// redisKeysOf are the names of the Redis store of h, a handler that
// newTestHandler made: its key_prefix, and hash_keys.
func redisKeysOf(h *Handler) rediswire.Keys {
	raw, _ := storeConfigs.Load(h)
	var s RedisStore
	if err := json.Unmarshal(raw.(json.RawMessage), &s); err != nil {
		panic(err)
	}
	return rediswire.Keys{Prefix: cmp.Or(s.KeyPrefix, defaultKeyPrefix), Hash: s.HashKeys}
}

// bucketField is how the fields of the buckets of a zone named name, of
// limit l, start: its name and its shape (the zero limit for a zone whose
// limit comes with each request).
func bucketField(name string, l gcra.Limit) string {
	return rediswire.BucketField(name, fmt.Sprintf("%d/%d", l.TokenTime, l.Burst))
}

// bucketOf names the Redis hash and field of key's bucket in h's zone i.
func bucketOf(h *Handler, i int, key string) (hash, field string) {
	z := h.Zones[i]
	return redisKeysOf(h).Bucket(bucketField(z.Name, z.spec().Shape), z.keyFor(key).String())
}

// bucketName names the Redis hash and field of a bucket, as a store with
// key_prefix prefix writes it for key (not an IP, not hashed) in a zone
// of that rate and burst; rate "" for a zone whose limit comes with each
// request.
func bucketName(t testing.TB, prefix, zone, rate string, burst int64, key string) (hash, field string) {
	var l gcra.Limit
	if rate != "" {
		perSec, _, err := parseRate(rate)
		if err != nil {
			t.Fatal(err)
		}
		l = gcra.NewLimit(perSec, burst)
	}
	return rediswire.Keys{Prefix: prefix}.Bucket(bucketField(zone, l), key)
}

// slotKeyName is the key of a key's slots in a zone, with key_prefix
// prefix.
func slotKeyName(prefix, zone, key string) string {
	return rediswire.Keys{Prefix: prefix}.Slots(rediswire.ZoneField(zone), key)
}

// counterKeyOf is the key of the quota counter of key in h's zone i.
func counterKeyOf(h *Handler, i int, key string) string {
	z := h.Zones[i]
	return redisKeysOf(h).Counter(rediswire.CounterZone(z.Name, z.quotaID()), z.keyFor(key).String())
}

// pair is two strings as a slice, for a command's arguments.
func pair(a, b string) []string { return []string{a, b} }

// SCRIPT FLUSH (or a restart) empties Redis's script cache: the next
// decision loads the script again and goes on where it left off.
func TestRedisScriptFlush(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "flush", "1r/m", 4, ""))
	for i := range 2 {
		if code, hdr := serve(h, "192.0.2.1"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != fmt.Sprint(3-i) {
			t.Fatalf("request %d: %d, remaining %s", i, code, hdr.Get("X-Ratelimit-Remaining"))
		}
	}
	r.CLI("SCRIPT", "FLUSH")
	if code, hdr := serve(h, "192.0.2.1"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != "1" {
		t.Fatalf("after SCRIPT FLUSH: %d, remaining %s", code, hdr.Get("X-Ratelimit-Remaining"))
	}
}

// Each fail_mode does what it promises while Redis is down or frozen, no
// request waits much longer than the timeout, and limiting goes back to
// Redis as soon as it answers again.
func TestRedisFailModes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	const timeout = 50 * time.Millisecond
	for _, mode := range []string{"local", "open", "closed"} {
		t.Run(mode, func(t *testing.T) {
			r := startRedis(t)
			h := newTestHandler(t, redisConfig(r.Addr(), "fail-"+mode, "1r/m", 3,
				fmt.Sprintf(`,"fail_mode":%q,"timeout":%d`, mode, timeout)))
			ip := "203.0.113.1"
			// Requests to a handler of the local store, served while the
			// outages' are: the slowest is what the machine's load added
			// to a request meanwhile (the tests run under -race beside
			// others), which the bound on waiting allows for besides the
			// timeout.
			local := newTestHandler(t, `{"zones":[{"name":"fail_control","rate":"1000000r/s"}]}`)
			// Another key first, until Redis has decided one: the first
			// call loads the script, which a loaded machine may not do
			// within the short timeout. (The store's check at load ran
			// a script of its own.)
			checked := r.Calls()
			for deadline := time.Now().Add(5 * time.Second); r.Calls() == checked; {
				if time.Now().After(deadline) {
					t.Fatal("Redis decided nothing in 5s")
				}
				serve(h, "203.0.113.254")
			}
			if code, _ := serve(h, ip); code != http.StatusOK {
				t.Fatalf("with Redis up: %d", code)
			}

			for _, outage := range []string{"killed", "frozen"} {
				if outage == "killed" {
					r.Kill()
				} else {
					r.Pause()
				}
				control, stop := newTally(), make(chan struct{})
				waitControl := loop(1, time.Millisecond, stop, func(int, int) {
					start := time.Now()
					code, _ := serve(local, "192.0.2.10")
					control.note(reply{status: code, took: time.Since(start)})
				})
				var codes []int
				var slowest time.Duration
				for range 6 {
					start := time.Now()
					code, hdr := serve(h, ip)
					slowest = max(slowest, time.Since(start))
					codes = append(codes, code)
					if code == http.StatusServiceUnavailable && hdr.Get("Retry-After") == "" {
						t.Fatal("503 without Retry-After")
					}
				}
				close(stop)
				waitControl()
				if slowest > timeout+100*time.Millisecond+control.slowest {
					t.Fatalf("%s: a request waited %v with timeout %v, beyond the slowest request to the local store (%v)", outage, slowest, timeout, control.slowest)
				}
				var want []int
				switch mode {
				case "local": // fresh local buckets of 3
					want = []int{200, 200, 200, 429, 429, 429}
				case "open":
					want = []int{200, 200, 200, 200, 200, 200}
				case "closed":
					want = []int{503, 503, 503, 503, 503, 503}
				}
				if mode == "local" && outage == "frozen" {
					want = []int{429, 429, 429, 429, 429, 429} // same local buckets
				}
				if fmt.Sprint(codes) != fmt.Sprint(want) {
					t.Fatalf("Redis %s: statuses %v, want %v", outage, codes, want)
				}
				if outage == "killed" {
					r.Start()
				} else {
					r.Resume()
				}
			}

			// Back: Redis decides again within the breaker's backoff.
			deadline := time.Now().Add(3 * time.Second)
			c := newRedisClient(t, r.Addr())
			hash, field := bucketOf(h, 0, "203.0.113.99")
			for {
				serve(h, "203.0.113.99")
				if ok, _ := c.HExists(context.Background(), hash, field).Result(); ok {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("limiting did not return to Redis")
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// On a cluster, keys spread over the nodes, and a request denied in one
// slot gets back what it took in another.
func TestRedisCluster(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"ip","rate":"1r/m","burst":5},
		{"name":"user","key":"{http.request.header.X-User}","rate":"1r/m","burst":1}],
		"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s"}}`, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
	for i := range 60 {
		if code, _ := serve(h, fmt.Sprintf("10.0.%d.1", i)); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	for _, n := range nodes {
		if keys := n.CLI("DBSIZE"); keys == "0" {
			t.Fatalf("node %s holds no keys: keys did not spread over slots", n.Addr())
		}
	}

	// The user zone lives in another slot than the ip zone.
	ip := "10.1.0.1"
	if code, _ := serve(h, ip, "X-User", "alice"); code != http.StatusOK {
		t.Fatalf("first: %d", code)
	}
	code, hdr := serve(h, ip, "X-User", "alice")
	if code != http.StatusTooManyRequests {
		t.Fatalf("second: %d", code)
	}
	if got := hdr.Get("Ratelimit"); !strings.Contains(got, `"ip";r=4`) {
		t.Fatalf("RateLimit %q: the denied request kept tokens of zone ip", got)
	}
	if _, hdr := serve(h, ip); !strings.Contains(hdr.Get("Ratelimit"), `"ip";r=3`) {
		t.Fatalf("RateLimit %q: want 3 left in zone ip", hdr.Get("Ratelimit"))
	}
}

// A request with three zones in three slots, which the last one denies
// (Redis, not the over-limit cache), gets its tokens back in the first two: each refunded in its own call,
// as one call for keys in two slots would be refused (CROSSSLOT).
func TestRedisClusterRefundsEachSlot(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"ip","rate":"1r/m","burst":5},
		{"name":"api","key":"{http.request.header.X-Key}","rate":"1r/m","burst":5},
		{"name":"user","key":"{http.request.header.X-User}","rate":"1r/m","burst":1}],
		"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s","disable_over_limit_cache":true}}`, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
	slotOf := func(zone, key string) string {
		hash, _ := bucketName(t, "", zone, "1r/m", 5, key) // the hash is the key's alone
		return nodes[0].CLI("CLUSTER", "KEYSLOT", hash)
	}
	ip, user := "10.2.0.1", "bob"
	key := ""
	for i := 0; key == ""; i++ {
		k := fmt.Sprintf("key-%d", i)
		if s := slotOf("api", k); s != slotOf("ip", ip) && s != slotOf("user", user) && slotOf("ip", ip) != slotOf("user", user) {
			key = k
		}
		if i > 1000 {
			t.Fatal("no key in a third slot")
		}
	}
	if code, _ := serve(h, ip, "X-Key", key, "X-User", user); code != http.StatusOK {
		t.Fatalf("first: %d", code)
	}
	code, hdr := serve(h, ip, "X-Key", key, "X-User", user)
	if code != http.StatusTooManyRequests {
		t.Fatalf("second: %d", code)
	}
	for _, want := range []string{`"ip";r=4`, `"api";r=4`} {
		if got := hdr.Get("Ratelimit"); !strings.Contains(got, want) {
			t.Fatalf("RateLimit %q, want %s: the denied request kept tokens", got, want)
		}
	}
	if _, hdr := serve(h, ip, "X-Key", key); !strings.Contains(hdr.Get("Ratelimit"), `"ip";r=3`) || !strings.Contains(hdr.Get("Ratelimit"), `"api";r=3`) {
		t.Fatalf("RateLimit %q: want 3 left in zones ip and api", hdr.Get("Ratelimit"))
	}
}

// On a cluster, a zone in dry run whose bucket lies in another slot and
// lacks refuses nothing, and is given nothing back when a zone after it
// refuses: it was charged nothing.
func TestRedisClusterDryRunApart(t *testing.T) {
	nodes := startCluster(t)
	h := newTestHandler(t, fmt.Sprintf(`{"zones":[
		{"name":"ip","rate":"1r/m","burst":5},
		{"name":"dry","key":"{http.request.header.X-User}","rate":"1r/m","burst":1,"dry_run":true},
		{"name":"api","key":"{http.request.header.X-Key}","rate":"1r/m","burst":1}],
		"store":{"backend":"redis","addresses":[%q,%q,%q],"timeout":"5s","disable_over_limit_cache":true}}`, nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr()))
	ip, user, key := "10.3.0.1", "carol", "key-1"
	if code, _ := serve(h, ip, "X-User", user, "X-Key", key); code != http.StatusOK {
		t.Fatalf("first: %d", code)
	}
	// dry lacks, and refuses nothing; api refuses: ip gets its token back.
	if code, _ := serve(h, ip, "X-User", user, "X-Key", key); code != http.StatusTooManyRequests {
		t.Fatalf("second: %d, want 429 from api", code)
	}
	// dry lacks still: no token came back to it.
	code, hdr := serve(h, ip, "X-User", user)
	if code != http.StatusOK || !strings.Contains(hdr.Get("Ratelimit"), `"ip";r=3`) {
		t.Fatalf("third: %d, RateLimit %q; want 200 and 3 left in zone ip", code, hdr.Get("Ratelimit"))
	}
	if n := h.Zones[1].state.dryRunDenied.Load(); n != 2 {
		t.Fatalf("dry run would have refused %d requests, want 2: it was given a token it was not charged", n)
	}
}

// Sentinel: after a failover the store follows the new master.
func TestRedisSentinelFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for seconds")
	}
	master := startRedis(t)
	replica := startRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(master.Port))
	sdir := t.TempDir()
	sport := freePort(t, 0)
	conf := writeFile(t, sdir, "sentinel.conf", fmt.Sprintf(
		"port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor mymaster 127.0.0.1 %d 1\n"+
			"sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n",
		sport, sdir, master.Port))
	sentinel := &redisServer{T: t, Port: sport, Dir: sdir, Args: []string{conf, "--sentinel"}}
	sentinel.Start()
	t.Cleanup(sentinel.Kill)
	waitFor(t, 10*time.Second, "replica in sync", func() bool {
		return strings.Contains(replica.CLI("INFO", "replication"), "master_link_status:up")
	})

	h := newTestHandler(t, fmt.Sprintf(`{"zones":[{"name":"s","rate":"1r/m","burst":10}],
		"store":{"backend":"redis","addresses":[%q],"sentinel":"mymaster","timeout":"200ms","fail_mode":"closed"}}`, sentinel.Addr()))
	hash, field := bucketOf(h, 0, "192.0.2.50")
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.50"); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	// Replication is asynchronous: wait for the third take, not the
	// first, to reach the replica before it is promoted.
	want := master.CLI("HGET", hash, field)
	waitFor(t, 5*time.Second, "key replicated", func() bool {
		return want != "" && replica.CLI("HGET", hash, field) == want
	})
	sentinel.CLI("SENTINEL", "FAILOVER", "mymaster")
	// The promotion closes the new master's client connections (Sentinel
	// sends CLIENT KILL TYPE normal with it), so a poll may meet a reset.
	waitFor(t, 15*time.Second, "failover", func() bool {
		info, err := replica.TryCLI("INFO", "replication")
		return err == nil && strings.Contains(info, "role:master")
	})
	// The store reconnects to the new master; the bucket kept its state.
	// Until Sentinel has the old master follow the new one, a take may
	// still land on the old one and go with its writes (replication is
	// asynchronous), the longer on a loaded machine: the test waits for a
	// take that landed on the new master.
	waitFor(t, 10*time.Second, "a take on the new master", func() bool {
		code, _ := serve(h, "192.0.2.50")
		got, err := replica.TryCLI("HGET", hash, field)
		return code == http.StatusOK && err == nil && got != "" && got != want
	})
	// Three requests before the failover, at least two after: a bucket
	// that lost its state would have 9 left.
	_, hdr := serve(h, "192.0.2.50")
	if got, err := strconv.Atoi(hdr.Get("X-Ratelimit-Remaining")); err != nil || got > 5 {
		t.Fatalf("remaining %q after failover: the bucket lost its state", hdr.Get("X-Ratelimit-Remaining"))
	}
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A Redis that refuses the scripts, to an ACL user without +evalsha and
// +eval or as a server that has none, is said once, when the config
// loads: which commands the store needs, and why. Then fail_mode decides
// every request at once, without a call to Redis or a line in the log,
// and the store decides again soon after the user is granted them.
func TestRedisScriptsRefused(t *testing.T) {
	requireRedis(t)
	c := startFaultCaddy(t, `respond "idle"`, false)
	noScripts := []string{"--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""}
	for _, tc := range []struct {
		name, mode, says string
		server           []string // the server's arguments
	}{
		{"acl local", "local", "redis refuses this user the scripts", nil},
		{"acl open", "open", "redis refuses this user the scripts", nil},
		{"acl closed", "closed", "redis refuses this user the scripts", nil},
		{"no scripts closed", "closed", "redis cannot run the scripts", noScripts},
		{"no scripts local", "local", "redis cannot run the scripts", noScripts},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startRedis(t, tc.server...)
			r.CLI("ACL", "SETUSER", "limited", "on", ">pw-limited", "~*", "+@all", "-eval", "-evalsha", "-script")
			mark := c.logs.mark()
			c.load(fmt.Sprintf(`rate_limit {
		zone refused {
			key {http.request.header.X-Key}
			rate 1r/m
			burst 2
		}
		store redis {
			address %s
			timeout 5s
			username limited
			password pw-limited
			fail_mode %s
		}
	}
	respond "ok"`, r.Addr(), tc.mode))
			refusal := waitLogLine(t, c, mark, tc.says)
			for _, want := range []string{`"level":"error"`, "+evalsha +eval", "EVALSHA", `"user":"limited"`, `"fail_mode":"` + tc.mode + `"`} {
				if tc.server != nil && want == "+evalsha +eval" {
					want = "Lua scripting"
				}
				if !strings.Contains(refusal, want) {
					t.Errorf("the refusal does not say %s: %s", want, refusal)
				}
			}

			// Every request is decided by fail_mode, none by a call.
			refused := errorReplies(t, r)
			began := time.Now()
			want := map[string]string{"local": "200 200 429", "open": "200 200 200", "closed": "503 503 503"}[tc.mode]
			for k := range 10 {
				var codes []string
				for range 3 {
					codes = append(codes, strconv.Itoa(send(c.client, c.url, "X-Key", fmt.Sprintf("keysecret-%d", k)).status))
				}
				if got := strings.Join(codes, " "); got != want {
					t.Errorf("key %d: %s, want %s (fail_mode %s)", k, got, want, tc.mode)
				}
			}
			// The probes alone ask Redis, at most every half second
			// (docs/redis.md).
			probes := int(time.Since(began)/(500*time.Millisecond)) + 2
			if n := errorReplies(t, r) - refused; n > probes {
				t.Errorf("Redis refused %d calls during 30 requests, more than the %d probes: requests still ask Redis", n, probes)
			}
			lines := storeLines(c.logs.since(mark))
			if len(lines) != 1 {
				t.Errorf("%d warnings and errors from the handler and store, want the refusal alone:\n%s", len(lines), strings.Join(lines, "\n"))
			}
			for _, l := range lines {
				if strings.Contains(l, "keysecret") {
					t.Errorf("a log line holds a key: %s", l)
				}
			}
			if tc.server != nil {
				return
			}

			// Granted the scripts, the store decides again by Redis.
			r.CLI("ACL", "SETUSER", "limited", "+evalsha", "+eval")
			hash, field := bucketName(t, "rl:", "refused", "1r/m", 2, "granted")
			waitFor(t, 2*time.Second, "the store to decide by Redis", func() bool {
				send(c.client, c.url, "X-Key", "granted")
				return r.CLI("HEXISTS", hash, field) == "1"
			})
			waitLogLine(t, c, mark, "redis store available again")
		})
	}
}

// Stores that share a connection to a Redis that refuses the scripts,
// each with its own fail_mode: the refusal is said once for each
// fail_mode, naming its zones, whichever store found it, and each store
// decides as its line says.
func TestRedisScriptsRefusedSharedConnection(t *testing.T) {
	requireRedis(t)
	c := startFaultCaddy(t, `respond "idle"`, false)
	r := startRedis(t)
	r.CLI("ACL", "SETUSER", "limited", "on", ">pw-limited", "~*", "+@all", "-eval", "-evalsha", "-script")
	var site strings.Builder
	for _, mode := range []string{"local", "open", "closed"} {
		fmt.Fprintf(&site, `handle /%[1]s {
		rate_limit {
			zone shared-%[1]s {
				key {http.request.header.X-Key}
				rate 1r/m
				burst 2
			}
			store redis {
				address %[2]s
				username limited
				password pw-limited
				fail_mode %[1]s
			}
		}
		respond "ok"
	}
	`, mode, r.Addr())
	}
	mark := c.logs.mark()
	c.load(site.String())
	waitLogLine(t, c, mark, "redis refuses this user the scripts")
	said := map[string][]string{}
	lines := storeLines(c.logs.since(mark))
	for _, l := range lines {
		var line struct {
			Msg      string
			FailMode string   `json:"fail_mode"`
			Zones    []string `json:"zones"`
		}
		if err := json.Unmarshal([]byte(l), &line); err != nil || !strings.Contains(line.Msg, "redis refuses this user the scripts") {
			t.Errorf("a warning or error besides the refusal: %s", l)
			continue
		}
		if _, ok := said[line.FailMode]; ok {
			t.Errorf("fail_mode %s said twice: %s", line.FailMode, l)
		}
		said[line.FailMode] = line.Zones
	}
	if fmt.Sprint(said) != "map[closed:[shared-closed] local:[shared-local] open:[shared-open]]" {
		t.Errorf("the refusal said the fail_modes and zones %v, want each mode once with its zone", said)
	}
	for mode, want := range map[string]string{"local": "200 200 429", "open": "200 200 200", "closed": "503 503 503"} {
		var codes []string
		for range 3 {
			codes = append(codes, strconv.Itoa(send(c.client, c.url+"/"+mode, "X-Key", "k").status))
		}
		if got := strings.Join(codes, " "); got != want {
			t.Errorf("fail_mode %s: %s, want %s", mode, got, want)
		}
	}
	if n := len(storeLines(c.logs.since(mark))); n != len(lines) {
		t.Errorf("%d warnings and errors from the handlers and stores after the requests, want the %d of the refusal alone", n, len(lines))
	}
}

// waitLogLine waits for the first line of c's log since mark that holds
// text, and returns it.
func waitLogLine(t *testing.T, c *faultCaddy, mark int, text string) string {
	t.Helper()
	var found string
	waitFor(t, 5*time.Second, "a log line that says "+text, func() bool {
		for _, l := range c.logs.since(mark) {
			if strings.Contains(l.text, text) {
				found = l.text
				return true
			}
		}
		return false
	})
	return found
}

// storeLines are the warnings and errors of the handler and its stores
// among lines, but the warning of fail_mode open that each load gives.
func storeLines(lines []logLine) []string {
	var out []string
	for _, l := range lines {
		var e struct{ Level, Logger, Msg string }
		if json.Unmarshal([]byte(l.text), &e) != nil || !strings.HasPrefix(e.Logger, "http.handlers.rate_limit") ||
			e.Level != "warn" && e.Level != "error" || strings.HasPrefix(e.Msg, "fail_mode open") {
			continue
		}
		out = append(out, l.text)
	}
	return out
}

// errorReplies is how many error replies Redis has sent: the calls it
// refused among them.
func errorReplies(t *testing.T, r *redisServer) int {
	t.Helper()
	for _, line := range strings.Split(r.CLI("INFO", "stats"), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "total_error_replies:"); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("INFO stats has no total_error_replies")
	return 0
}

// The store talks TLS to a Redis that only speaks TLS, trusting the CA
// it is given, and refuses a server its CA did not sign.
func TestRedisTLS(t *testing.T) {
	requireRedis(t)
	dir := t.TempDir()
	caPEM, certPEM, keyPEM := testCertificates(t)
	ca := writeFile(t, dir, "ca.pem", caPEM)
	port := freePort(t, 0)
	r := &redisServer{T: t, Port: port, Dir: dir, Args: []string{"--bind", "127.0.0.1", "--port", "0",
		"--tls-port", strconv.Itoa(port), "--tls-cert-file", writeFile(t, dir, "cert.pem", certPEM),
		"--tls-key-file", writeFile(t, dir, "key.pem", keyPEM), "--tls-ca-cert-file", ca,
		"--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", dir}}
	r.Cmd = exec.Command(redistest.ServerBin(), r.Args...)
	if err := r.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Kill)
	waitFor(t, 10*time.Second, "the server with TLS", func() bool {
		_, err := r.TryCLI("--tls", "--cacert", ca, "PING")
		return err == nil
	})

	h := newTestHandler(t, redisConfig(r.Addr(), "tls", "1r/m", 1, fmt.Sprintf(`,"tls":{"ca":%q},"fail_mode":"closed"`, ca)))
	codes := fmt.Sprint(statusOnly(serve(h, "192.0.2.70")), statusOnly(serve(h, "192.0.2.70")))
	if codes != "200 429" {
		t.Fatalf("over TLS: %s, want 200 429", codes)
	}
	if out, _ := r.TryCLI(append([]string{"--tls", "--cacert", ca, "HEXISTS"}, pair(bucketOf(h, 0, "192.0.2.70"))...)...); out != "1" {
		t.Fatalf("the bucket is not in Redis: %q", out)
	}

	// Without the CA, the server is not trusted: Redis fails, fail_mode
	// closed answers 503.
	h = newTestHandler(t, redisConfig(r.Addr(), "tls", "1r/m", 1, `,"tls":{},"fail_mode":"closed","pool_size":2`))
	if code, _ := serve(h, "192.0.2.71"); code != http.StatusServiceUnavailable {
		t.Fatalf("untrusted server: %d, want 503", code)
	}
	h = newTestHandler(t, redisConfig(r.Addr(), "tls", "1r/m", 1, `,"tls":{"insecure_skip_verify":true},"fail_mode":"closed","pool_size":3`))
	if code, _ := serve(h, "192.0.2.72"); code != http.StatusOK {
		t.Fatalf("insecure_skip_verify: %d, want 200", code)
	}
}

func statusOnly(code int, _ http.Header) int { return code }

// testCertificates makes a CA and a certificate it signs for 127.0.0.1.
func testCertificates(t *testing.T) (caPEM, certPEM, keyPEM string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "redis"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
	}
	caCert, _ := x509.ParseCertificate(caDER)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	encode := func(typ string, b []byte) string { return string(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b})) }
	return encode("CERTIFICATE", caDER), encode("CERTIFICATE", der), encode("EC PRIVATE KEY", keyDER)
}

// Caddy cleans up a config's handlers while their requests still run. A
// request waiting on a hung Redis when its config is cleaned up keeps its
// client, and finishes under fail_mode when Redis does not answer in time;
// one that arrives after the cleanup and its config's last request finds
// the client closed, and is decided the same way: no nil store, no
// panic, no race.
func TestRedisCleanupUnderRunningRequests(t *testing.T) {
	r := startRedis(t)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := new(Handler)
	if err := json.Unmarshal([]byte(redisConfig(r.Addr(), "cleanup", "1r/m", 5, `,"timeout":"2s"`)), h); err != nil {
		t.Fatal(err)
	}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	serve(h, "192.0.2.90") // connected
	r.Pause()
	defer r.Resume()
	var wg sync.WaitGroup
	codes := make([]int, 20)
	for i := range codes {
		wg.Go(func() { codes[i], _ = serve(h, fmt.Sprintf("192.0.2.%d", 100+i)) })
	}
	time.Sleep(100 * time.Millisecond) // all waiting on Redis
	cancel()                           // the config goes: Cleanup closes the client
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusOK {
			t.Errorf("request %d: %d, want 200 from fail_mode local's fresh buckets", i, code)
		}
	}
	// A request that arrives after the cleanup is decided the same way.
	if code, _ := serve(h, "192.0.2.91"); code != http.StatusOK {
		t.Errorf("after cleanup: %d", code)
	}
}

// A reload that changes the Redis store's connection settings makes a
// new client, and the old config is cleaned up at once; a stream started
// under the old config, in flight across the reload, still settles its
// usage in the bucket and the quota after its response, and gives its
// slot back, through the client it was decided with.
func TestRedisReloadSettlesRequestsInFlight(t *testing.T) {
	r := startRedis(t)
	up := startLLMUpstream(t)
	up.resume = make(chan struct{}) // streams wait after their first chunk
	site := func(timeout string) string {
		return fmt.Sprintf(`http://localhost {
	rate_limit {
		zone reload_llm {
			key {http.request.header.X-Key}
			rate 100/m
			burst 100
			usage json usage.total_tokens
			quota 1000 per day
		}
		zone reload_conc {
			key {http.request.header.X-Key}
			concurrency 1
		}
		store redis {
			address %s
			timeout %s
		}
	}
	reverse_proxy %s {
		flush_interval -1
	}
}
`, r.Addr(), timeout, strings.TrimPrefix(up.URL, "http://"))
	}
	tester := startCaddy(t, "", site("200ms"))
	done := make(chan string)
	go func() {
		code, _, body := llmGetAt(t, siteURL, "/sse?tokens=60", "X-Key", "k")
		done <- fmt.Sprint(code, " ", strings.Contains(body, `"total_tokens":60`))
	}()
	select {
	case <-up.first:
	case <-time.After(5 * time.Second):
		t.Fatal("the stream did not reach the upstream")
	}
	reload(t, tester, "", site("300ms"))
	// The new config shares the slot in Redis: taken by the stream.
	if code, _, body := llmGetAt(t, siteURL, "/json?tokens=1", "X-Key", "k"); code != http.StatusTooManyRequests {
		t.Fatalf("while the stream runs: %d %q, want 429 (its slot is taken)", code, body)
	}
	close(up.resume)
	if got := <-done; got != "200 true" {
		t.Fatalf("the stream: %s, want 200 with its usage", got)
	}
	// The slot goes back after the settlement, as the handler returns,
	// which may be after the client has read the end of the stream.
	var inFlight any
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if inFlight = adminKeyAt(t, adminAddr, "reload_conc", "k")["in_flight"]; inFlight == float64(0) {
			break
		}
	}
	if inFlight != float64(0) {
		t.Errorf("in flight %v, want 0: the stream gave its slot back", inFlight)
	}
	adminKeyInfo(t, "reload_llm", "k", func(info map[string]any) {
		// 100 less 60, and what came back since at 100/m.
		if tok, _ := info["tokens"].(float64); tok < 40 || tok > 50 {
			t.Errorf("tokens %v, want about 40: the stream's usage of 60 settled", info["tokens"])
		}
		if q, _ := info["quota"].(map[string]any); q["used"] != float64(60) {
			t.Errorf("quota %v, want 60 used", info["quota"])
		}
	})
	if code, _, body := llmGetAt(t, siteURL, "/json?tokens=1", "X-Key", "k"); code != http.StatusOK {
		t.Fatalf("after the stream: %d %q, want 200", code, body)
	}
}

// fail_mode closed answers 503 with Retry-After: 1, written directly on a
// server without error routes (as Caddy would, minus its ERROR log line
// with the request's headers for every request of an outage), returned
// as an error where handle_errors is there to shape it, and counted as a
// store error, not as a denial.
func TestRedisFailClosedAnswers503(t *testing.T) {
	requireRedis(t)
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t, 0))
	h := newTestHandler(t, redisConfig(dead, "closed503", "1r/m", 5, `,"fail_mode":"closed","timeout":"50ms"`))
	for _, direct := range []bool{true, false} {
		h.writeRefusals = direct
		for range 4 {
			req, rr := newRequest("192.0.2.120")
			err := h.ServeHTTP(rr, req, okHandler)
			code := rr.Code
			if err != nil {
				code = statusOf(err)
			}
			if code != http.StatusServiceUnavailable || rr.Header().Get("Retry-After") != "1" {
				t.Fatalf("direct %t: %d, Retry-After %q; want 503, 1", direct, code, rr.Header().Get("Retry-After"))
			}
			if direct != (err == nil) {
				t.Fatalf("direct %t: error %v", direct, err)
			}
		}
	}
	st := h.Zones[0].state
	if got := fmt.Sprint(st.storeErrors.Load(), st.denied.Load(), st.allowed.Load()); got != "8 0 0" {
		t.Fatalf("store errors, denied, allowed = %s, want 8 0 0", got)
	}
}

// When a call fails, fail_mode local's bucket starts from what Redis last
// said of it: a client that emptied its bucket gets the tokens that came
// back since, not a fresh burst.
func TestRedisFailLocalStartsFromWhatRedisSaid(t *testing.T) {
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "carry", "2r/s", 3, `,"timeout":100000000`))
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.8"); code != http.StatusOK {
			t.Fatalf("request %d: %d, want 200", i, code)
		}
	}
	if code, _ := serve(h, "192.0.2.8"); code != http.StatusTooManyRequests {
		t.Fatalf("4th request: %d, want 429", code)
	}
	time.Sleep(600 * time.Millisecond) // one token back
	r.Kill()
	allowed := 0
	for range 3 {
		if code, _ := serve(h, "192.0.2.8"); code == http.StatusOK {
			allowed++
		}
	}
	if allowed != 1 {
		t.Errorf("%d of 3 allowed while Redis is down, want the 1 token that came back", allowed)
	}
	// A client Redis never saw gets its whole burst from fail_mode local.
	allowed = 0
	for range 4 {
		if code, _ := serve(h, "192.0.2.9"); code == http.StatusOK {
			allowed++
		}
	}
	if allowed != 3 {
		t.Errorf("a new client: %d of 4 allowed, want its burst of 3", allowed)
	}
}

// The ACL user of docs/redis.md is enough: as that user, a store of
// every kind of zone decides, reads, sets and removes keys' own limits
// and resets a key with no error, and Redis refuses it nothing. A server
// that knows CLIENT SETINFO (Redis 7.2 and later, Valkey) is given the
// page's addition for it too.
func TestRedisDocumentedACLUser(t *testing.T) {
	r := startRedis(t)
	doc, err := os.ReadFile("docs/redis.md")
	if err != nil {
		t.Fatal(err)
	}
	user := regexp.MustCompile(`(?m)^\s*user caddy on >secret (.+)$`).FindSubmatch(doc)
	if user == nil {
		t.Fatal("docs/redis.md gives no ACL user `user caddy on >secret ...`")
	}
	rules := strings.Fields(string(user[1]))
	if r.CLI("COMMAND", "INFO", "client|setinfo") != "" {
		setinfo := regexp.MustCompile("(?m)^\\s*- On Redis 7\\.2 and later[^`]*, add `(\\+client\\|setinfo)`").FindSubmatch(doc)
		if setinfo == nil {
			t.Fatal("docs/redis.md does not say to add `+client|setinfo` on Redis 7.2 and later")
		}
		rules = append(rules, string(setinfo[1]))
	}
	r.CLI(append([]string{"ACL", "SETUSER", "caddy", "on", ">secret"}, rules...)...)
	hs := everyKind(t, r.Addr(), `"username":"caddy","password":"secret","fail_mode":"closed"`)
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).serve(rec, httptest.NewRequest(http.MethodDelete, "/rate_limit/mon_q/192.0.2.9", nil)); err != nil || rec.Code != http.StatusOK {
		t.Errorf("admin reset as the user: %d, %v", rec.Code, err)
	}
	for _, h := range hs {
		for _, z := range h.Zones {
			if n := z.state.storeErrors.Load(); n != 0 {
				t.Errorf("zone %s: %d decisions failed as the user", z.Name, n)
			}
		}
	}
	if log := r.CLI("ACL", "LOG"); log != "" {
		t.Errorf("Redis refused the user:\n%s", log)
	}
}

// everyKind has a handler of the store at addr, with the store's fields
// store (JSON), decide every kind of zone: keys with their own limit set
// and one removed, the admin API's reads, a flood of one key. It returns
// the handlers, the flood's last.
func everyKind(t *testing.T, addr, storeCfg string) []*Handler {
	h := newTestHandler(t, `{"zones":[
		{"name":"mon_a","rate":"1r/m","burst":3},
		{"name":"mon_b","rate":"1r/m","burst":1,"ban":"1h"},
		{"name":"mon_d","rate":"1r/m","burst":1,"delay":"10ms"},
		{"name":"mon_q","quota":2,"quota_period":"day"},
		{"name":"mon_k","concurrency":2},
		{"name":"mon_p","rate":"{http.vars.plan_rate}","burst":2},
		{"name":"mon_n","rate":"1r/m","burst":2,"count":{"status_code":[401]}},
		{"name":"mon_s","concurrency":1,"dry_run":true}],
		"store":{"backend":"redis","addresses":["`+addr+`"],"timeout":"5s",`+storeCfg+`}}`)
	// Keys with their own limit: the script reads and writes their
	// buckets under it, beside the others.
	for _, z := range []*Zone{h.Zones[0], h.Zones[5]} {
		o, err := z.overrideOf(limitBody{Rate: "2r/m", Burst: new(int64(4))}, time.Now())
		if err == nil {
			err = h.store.SetOverride(context.Background(), time.Now(), z.index, z.keyFor("192.0.2.9"), o)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	// While the first request holds its slots, every zone's state in
	// Redis, through the admin API.
	peek := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		for _, z := range h.Zones {
			rec := httptest.NewRecorder()
			if err := (adminAPI{}).serve(rec, httptest.NewRequest(http.MethodGet, "/rate_limit/"+z.Name+"/192.0.2.9", nil)); err != nil {
				t.Errorf("admin GET of zone %s: %v", z.Name, err)
			}
		}
		return nil
	})
	for i := range 4 {
		req, rr := newRequest("192.0.2.9")
		caddyhttp.SetVar(req.Context(), "plan_rate", "2r/m")
		next := okHandler
		if i == 0 {
			next = peek
		}
		_ = h.ServeHTTP(rr, req, next)
	}
	// A flood of one key: many takes in one call.
	flood := newTestHandler(t, `{"zones":[{"name":"mon_f","rate":"1r/m","burst":5}],
		"store":{"backend":"redis","addresses":["`+addr+`"],"timeout":"5s",`+storeCfg+`,"disable_over_limit_cache":true}}`)
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() { serve(flood, "192.0.2.10") })
	}
	wg.Wait()
	// A key's own limit removed, with its place in the zone's list.
	if _, err := h.store.DeleteOverride(context.Background(), time.Now(), h.Zones[0].index, h.Zones[0].keyFor("192.0.2.9")); err != nil {
		t.Fatal(err)
	}
	return []*Handler{h, flood}
}

// BenchmarkServeHTTPRedis is the handler's whole cost for one request
// with the Redis store, one caller at a time, on keys that never run out:
// allocations, and calls to Redis per request.
func BenchmarkServeHTTPRedis(b *testing.B) {
	r := startRedis(b)
	for _, tc := range []struct{ name, zone string }{
		{"allowed", `"rate":"1000000r/s"`},
		{"allowed-ban", `"rate":"1000000r/s","ban":"15m"`},
		// Keys used rarely in a zone with share: plain takes that read
		// the holders beside the bucket.
		{"allowed-share", `"rate":"1000000r/s","share":"1s"`},
		// The response, a 200, does not match: the tokens go back.
		{"allowed-count", `"rate":"1000000r/s","count":{"status_code":[401]}`},
		// A slot taken in the decision's call, given back in a second
		// one when the handlers return.
		{"allowed-concurrency", `"concurrency":1000`},
		{"allowed-rate+concurrency", `"rate":"1000000r/s","concurrency":1000`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rh-%s",%s}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"1s"}}`, tc.name, tc.zone, r.Addr()))
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			ips := make([]any, 10000) // boxed once: the loop allocates nothing of its own
			for i := range ips {
				ips[i] = fmt.Sprintf("10.%d.%d.1", i>>8, i&0xff)
			}
			req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
			vars := map[string]any{"client_ip": ips[0]}
			req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
			caddyhttp.NewTestReplacer(req)
			w := &headerSink{h: make(http.Header)}
			calls := r.Calls()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				vars["client_ip"] = ips[i%len(ips)]
				clear(w.h)
				if err := h.ServeHTTP(w, req, next); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(float64(r.Calls()-calls)/float64(i), "calls/op")
		})
	}
}

// BenchmarkServeHTTPRedisParallel is the handler's cost per request with
// the Redis store when 50 requests are in flight at once, as under load:
// all from one client (the load run's case: one bucket), or
// each from its own. Each request comes with a context of its own, as
// net/http gives it (two of the allocations are the benchmark's).
func BenchmarkServeHTTPRedisParallel(b *testing.B) {
	r := startRedis(b)
	for _, tc := range []struct {
		name string
		keys int
	}{{"one-client", 1}, {"many-clients", 10000}} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, fmt.Sprintf(`{"zones":[{"name":"rp-%s","rate":"1000000000r/s"}],
		"store":{"backend":"redis","addresses":[%q],"timeout":"1s"}}`, tc.name, r.Addr()))
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			ips := make([]any, tc.keys)
			for i := range ips {
				ips[i] = fmt.Sprintf("10.%d.%d.1", i>>8, i&0xff)
			}
			var seq atomic.Int64
			calls, usec := r.ScriptStats()
			b.ReportAllocs()
			b.SetParallelism(max(1, 50/runtime.GOMAXPROCS(0)))
			b.RunParallel(func(pb *testing.PB) {
				req := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
				vars := map[string]any{}
				req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, vars))
				caddyhttp.NewTestReplacer(req)
				base := req.Context()
				w := &headerSink{h: make(http.Header)}
				for pb.Next() {
					vars["client_ip"] = ips[int(seq.Add(1))%len(ips)]
					ctx, cancel := context.WithCancel(base)
					clear(w.h)
					if err := h.ServeHTTP(w, req.WithContext(ctx), next); err != nil {
						b.Error(err)
					}
					cancel()
				}
			})
			calls2, usec2 := r.ScriptStats()
			b.ReportMetric(float64(calls2-calls)/float64(b.N), "calls/op")
			b.ReportMetric(float64(usec2-usec)/float64(b.N), "redis-µs/op")
		})
	}
}
