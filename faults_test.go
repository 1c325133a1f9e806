// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// Fault and attack scenarios: what the plugin must hold to when Redis
// fails, when the config reloads under a flood, and when clients choose
// hostile keys or flood one key or many. See faults_helpers_test.go for
// the short and the long version.

var faultModes = []string{"local", "open", "closed"}

// outageSite has one route per fail_mode, /local, /open and /closed, each
// with its own handler, all on one Redis, through one client (and so one
// circuit breaker), as one Caddy instance with one Redis has. Requests
// with X-Key are limited at 10r/s, burst 20; requests with X-Probe only
// by a zone that keeps their key in Redis for a minute, which shows
// whether Redis decided them. /control has no rate_limit: how long its
// requests take is what the machine's load adds to any request.
func outageSite(addr string, timeout time.Duration, extra string) string {
	var b strings.Builder
	for _, mode := range faultModes {
		fmt.Fprintf(&b, `	handle /%[1]s {
		rate_limit {
			zone outage_%[1]s {
				key {http.request.header.X-Key}
				rate 10r/s
				burst 20
			}
			zone outage_probe_%[1]s {
				key {http.request.header.X-Probe}
				rate 1r/m
				burst 5
			}
			store redis {
				address %[2]s
				key_prefix outage:
				timeout %[3]s
				fail_mode %[1]s
				%[4]s
			}
		}
		respond "ok"
	}
`, mode, addr, timeout, extra)
	}
	b.WriteString("\thandle /control {\n\t\trespond \"ok\"\n\t}\n")
	return b.String()
}

// An outage is a way for Redis to fail.
type outage struct {
	name  string
	run   func(t *testing.T, r *redisServer) // starts the fault, holds it, ends it
	store string                             // more store subdirectives
}

// Redis killed, frozen, out of memory, asleep, asking for a password, or
// demoted to a read-only replica, under load, with each fail_mode: no
// request waits much longer than the timeout, Redis decides again soon
// after it recovers although impatient clients cancel requests (and so
// probes), and Caddy logs a few lines, with no keys and no headers.
func TestFaultRedisOutages(t *testing.T) {
	const timeout = 100 * time.Millisecond
	var (
		hold          = sized(time.Second, 5*time.Second)
		sleep         = sized("1", "2") // DEBUG SLEEP, seconds
		pace          = sized(5*time.Millisecond, 2*time.Millisecond)
		latencyBound  = timeout + sized(150*time.Millisecond, 20*time.Millisecond)
		recoveryBound = sized(1500*time.Millisecond, time.Second)
	)
	const maxLinesPerSecond = 5
	requireRedis(t)
	c := startFaultCaddy(t, `respond "idle"`, true)
	// (Reports are written when the test ends, the last made first.)
	logReport := newFaultReport(t, "Redis faults: Caddy's log",
		"fault", "log lines", "most in one second", "lines with a key or header")
	report := newFaultReport(t, "Redis faults under load, per fail_mode",
		"fault", "fail_mode", "requests", "statuses", "max latency", "Redis decides again after", "requests given up after 50 ms", "sent again")

	fillUp := func(t *testing.T, r *redisServer) {
		fillRedis(t, r)
		time.Sleep(hold)
		r.CLI("CONFIG", "SET", "maxmemory", "0")
	}
	faults := []outage{
		{"SIGKILL, restarted", func(t *testing.T, r *redisServer) {
			r.Kill()
			time.Sleep(hold)
			r.Start()
		}, ""},
		{"SIGSTOP", func(t *testing.T, r *redisServer) {
			r.Pause()
			time.Sleep(hold)
			r.Resume()
		}, ""},
		{"out of memory", fillUp, ""},
		{"DEBUG SLEEP " + sleep, func(t *testing.T, r *redisServer) {
			r.CLI("DEBUG", "SLEEP", sleep)
		}, ""},
		{"wrong password", func(t *testing.T, r *redisServer) {
			r.CLI("CONFIG", "SET", "requirepass", "pw-fault")
			r.CLI("-a", "pw-fault", "--no-auth-warning", "CLIENT", "KILL", "TYPE", "normal")
			time.Sleep(hold)
			r.CLI("-a", "pw-fault", "--no-auth-warning", "CONFIG", "SET", "requirepass", "")
		}, ""},
		{"read-only replica", func(t *testing.T, r *redisServer) {
			master := startRedis(t)
			r.CLI("REPLICAOF", "127.0.0.1", strconv.Itoa(master.Port))
			time.Sleep(hold)
			r.CLI("REPLICAOF", "NO", "ONE")
		}, ""},
	}
	if longFaults() {
		// Without the over-limit cache every denial asks Redis, and a
		// full Redis still answers denials, which write nothing: Redis
		// half works.
		faults = append(faults, outage{"out of memory, disable_over_limit_cache", fillUp, "disable_over_limit_cache"})
	}
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			r := startRedis(t, "--enable-debug-command", "yes")
			c.load(outageSite(r.Addr(), timeout, f.store))
			check := newRedisClient(t, r.Addr())

			stop := make(chan struct{})
			var waits []func()
			patient, hasty := make([]*tally, len(faultModes)), make([]*tally, len(faultModes))
			resent := make([]atomic.Int64, len(faultModes))
			for m, mode := range faultModes {
				url := c.url + "/" + mode
				patient[m], hasty[m] = newTally(), newTally()
				client, hastyClient := newFaultClient(t, 10*time.Second), newFaultClient(t, 50*time.Millisecond)
				waits = append(waits,
					loop(2, pace, stop, func(w, i int) { // one hot key
						patient[m].note(sendOnceMore(client, &resent[m], url, "X-Key", "keysecret-hot", "X-Secret", "hunter2"))
					}),
					loop(2, pace, stop, func(w, i int) { // 100 keys, each under its limit
						patient[m].note(sendOnceMore(client, &resent[m], url, "X-Key", fmt.Sprintf("keysecret-%d-%d", w, i%50), "X-Secret", "hunter2"))
					}),
					loop(2, pace, stop, func(w, i int) { // clients that give up after 50ms
						hasty[m].note(send(hastyClient, url, "X-Key", fmt.Sprintf("keysecret-hasty-%d-%d", w, i%50), "X-Secret", "hunter2"))
					}),
				)
			}
			// Requests that no rate_limit handles, sent all along: the
			// slowest is what the machine's load added to a request
			// meanwhile (the tests run under -race beside others), which
			// the bounds below allow for besides the timeout.
			control := newTally()
			controlClient := newFaultClient(t, 10*time.Second)
			waits = append(waits, loop(2, pace, stop, func(w, i int) {
				control.note(sendOnceMore(controlClient, new(atomic.Int64), c.url+"/control"))
			}))
			time.Sleep(300 * time.Millisecond)
			mark := c.logs.mark()

			f.run(t, r)
			over := time.Now()
			back := make([]time.Duration, len(faultModes))
			var wg sync.WaitGroup
			for m, mode := range faultModes {
				client := newFaultClient(t, 10*time.Second)
				wg.Go(func() {
					back[m] = -1
					for n := 0; time.Since(over) < 10*time.Second; n++ {
						key := fmt.Sprintf("probe-%d", n)
						send(client, c.url+"/"+mode, "X-Probe", key)
						hash, field := bucketName(t, "outage:", "outage_probe_"+mode, "1r/m", 5, key)
						if check.HExists(context.Background(), hash, field).Val() {
							back[m] = time.Since(over)
							return
						}
						time.Sleep(20 * time.Millisecond)
					}
				})
			}
			wg.Wait()
			time.Sleep(200 * time.Millisecond)
			close(stop)
			for _, wait := range waits {
				wait()
			}
			lines := c.logs.since(mark)

			for m, mode := range faultModes {
				p := patient[m]
				report.add(t, f.name, mode, p.total(), p.codesString(), ms(p.slowest), ms(back[m]), hasty[m].errs, resent[m].Load())
				if p.errs > 0 {
					t.Errorf("%s: %d requests got no response: %v", mode, p.errs, p.firstErr)
				}
				if p.slowest > latencyBound+control.slowest {
					t.Errorf("%s: a request took %v, more than the timeout %v and some slack (%v) beyond the slowest request without rate_limit (%v)",
						mode, p.slowest, timeout, latencyBound, control.slowest)
				}
				switch {
				case back[m] < 0:
					t.Errorf("%s: Redis did not decide again within 10s of its recovery", mode)
				case back[m] > recoveryBound+control.slowest:
					t.Errorf("%s: Redis decided again %v after its recovery, want within %v beyond the slowest request without rate_limit (%v)",
						mode, back[m], recoveryBound, control.slowest)
				}
				want := map[string][]int{"local": {200, 429}, "open": {200, 429}, "closed": {200, 429, 503}}[mode]
				for code := range p.codes {
					if !slices.Contains(want, code) {
						t.Errorf("%s: %d × status %d, want only %v", mode, p.codes[code], code, want)
					}
				}
				if mode == "closed" && p.codes[503] == 0 {
					t.Errorf("closed: no 503 while Redis was failing: the fault did not reach the store")
				}
				if p.noRetryAfter > 0 {
					t.Errorf("%s: %d × 503 without Retry-After: 1", mode, p.noRetryAfter)
				}
			}

			leaked := leaks(lines, "hunter2", "keysecret")
			logReport.add(t, f.name, len(lines), perSecond(lines), len(leaked))
			if n := perSecond(lines); n > maxLinesPerSecond {
				t.Errorf("%d log lines within one second, want at most %d", n, maxLinesPerSecond)
			}
			for _, l := range leaked {
				t.Errorf("a log line holds a key or a request header: %s", l)
			}
			if t.Failed() || testing.Verbose() {
				for _, l := range lines {
					t.Logf("log: %.300s", l.text)
				}
			}
		})
	}
}

// fillRedis makes Redis refuse writes for lack of memory: a small
// maxmemory without eviction, filled. Filling stops at the first refused
// write, which leaves Redis just under its limit (the refused write's
// own buffer tipped it over); the limit then goes 1 MB below what Redis
// holds, as when other writers keep filling it, so that every write is
// refused until the limit is lifted.
func fillRedis(t *testing.T, r *redisServer) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	ctx := context.Background()
	r.CLI("CONFIG", "SET", "maxmemory-policy", "noeviction")
	r.CLI("CONFIG", "SET", "maxmemory", strconv.FormatInt(usedMemory(r)+4<<20, 10))
	value := strings.Repeat("x", 64<<10)
	for i := 0; ; i++ {
		err := c.Set(ctx, fmt.Sprintf("fill:%d", i), value, 0).Err()
		if err != nil && strings.HasPrefix(err.Error(), "OOM") {
			break
		}
		if err != nil || i == 1000 {
			t.Fatalf("filling Redis: %d keys, %v", i, err)
		}
	}
	r.CLI("CONFIG", "SET", "maxmemory", strconv.FormatInt(usedMemory(r)-1<<20, 10))
}

func usedMemory(r *redisServer) int64 {
	for line := range strings.SplitSeq(r.CLI("INFO", "memory"), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	r.T.Fatal("no used_memory in INFO memory")
	return 0
}

// Redis freezes as the over-limit cache's entry for a flooded key runs
// out, and nothing else fails yet: the request that asks Redis about the
// key and those that wait for its answer are each decided within the
// timeout, although the circuit breaker is still closed.
func TestFaultFrozenAsCachedDenialRunsOut(t *testing.T) {
	const timeout = 100 * time.Millisecond
	const waiting = 4 // requests for the key while Redis is frozen
	// Every request is held to the timeout, the time it waited for
	// another's call included; the short version leaves room for a
	// loaded CI machine.
	bound := timeout + sized(150*time.Millisecond, 20*time.Millisecond)
	requireRedis(t)
	r := startRedis(t)
	h := newTestHandler(t, redisConfig(r.Addr(), "frozen_hot", "10r/s", 1, fmt.Sprintf(`,"timeout":%d`, timeout)))
	report := newFaultReport(t, "Redis frozen as a flooded key's cached denial runs out",
		"timeout", "requests at once", "statuses", "slowest")
	// The key's one token taken, until a denial, which the over-limit
	// cache keeps: a token comes back every 100ms, which on a loaded
	// machine may pass between two requests.
	waitFor(t, 5*time.Second, "a denial of the flooded key", func() bool {
		code, _ := serve(h, "192.0.2.9")
		return code == http.StatusTooManyRequests
	})
	time.Sleep(150 * time.Millisecond) // the denial's entry runs out: a token is back
	// Requests to a handler of the local store, served all along: the
	// slowest is what the machine's load added to a request meanwhile
	// (the tests run under -race beside others), which the bound allows
	// for besides the timeout.
	local := newTestHandler(t, `{"zones":[{"name":"frozen_control","rate":"1000000r/s"}]}`)
	control := newTally()
	stop := make(chan struct{})
	waitControl := loop(1, time.Millisecond, stop, func(int, int) {
		start := time.Now()
		code, _ := serve(local, "192.0.2.10")
		control.note(reply{status: code, took: time.Since(start)})
	})
	r.Pause()
	defer r.Resume()
	all := newTally()
	var wg sync.WaitGroup
	for range waiting {
		wg.Go(func() {
			start := time.Now()
			code, _ := serve(h, "192.0.2.9")
			all.note(reply{status: code, took: time.Since(start)})
		})
	}
	wg.Wait()
	close(stop)
	waitControl()
	report.add(t, timeout, waiting, all.codesString(), ms(all.slowest))
	if all.slowest > bound+control.slowest {
		t.Errorf("a request took %v with timeout %v, want at most %v beyond the slowest request to the local store (%v)", all.slowest, timeout, bound, control.slowest)
	}
}

// Config reloads under a flood, with Redis healthy and with Redis frozen:
// every request gets an HTTP response, nothing panics, no goroutine or
// file descriptor is left behind, and a key that emptied its bucket stays
// limited across the reloads, which keep its zone.
func TestFaultReloadsUnderFlood(t *testing.T) {
	reloads := sized(20, 200)
	const slack = 10 // goroutines and file descriptors
	requireRedis(t)
	r := startRedis(t)
	// The config loaded nth, for a Redis healthy or frozen: healthy, a
	// call may take long on a loaded machine, and Redis is to decide
	// every request; frozen, each call times out, and fail_mode local
	// decides.
	site := func(n int, frozen bool) string {
		timeout := map[bool]string{false: "5s", true: "100ms"}[frozen]
		return fmt.Sprintf(`	rate_limit {
		zone reload_flood {
			key {http.request.header.X-Key}
			rate 1r/m
			burst 5
		}
		store redis {
			address %s
			key_prefix reload:
			timeout %s
			fail_mode local
		}
	}
	respond "config %d"`, r.Addr(), timeout, n)
	}
	// In this process, so that the race detector watches the reloads.
	c := startFaultCaddy(t, site(0, false), false)
	report := newFaultReport(t, "Reloads under a flood",
		"Redis", "reloads", "requests", "statuses", "sent again", "no response", "hot key allowed", "due",
		"goroutines before → after", "fds before → after", "log lines with panic")
	loaded := 0
	for _, frozen := range []bool{false, true} {
		name := map[bool]string{false: "healthy", true: "frozen"}[frozen]
		t.Run(name, func(t *testing.T) {
			loaded++
			c.load(site(loaded, frozen))
			client := newFaultClient(t, 10*time.Second)
			send(client, c.url, "X-Key", "warm")
			client.CloseIdleConnections()
			time.Sleep(200 * time.Millisecond)
			goroutines, fds := runtime.NumGoroutine(), c.fds()
			mark := c.logs.mark()
			if frozen {
				r.Pause()
			}

			// Caddy swaps servers at a reload, with or without this
			// handler: a connection may be refused, or closed as a
			// request is sent on it.
			var resent atomic.Int64
			sendRetry := func(key string) reply {
				return sendOnceMore(client, &resent, c.url, "X-Key", key)
			}
			all, hot := newTally(), newTally()
			stop := make(chan struct{})
			start := time.Now()
			waitFlood := loop(6, time.Millisecond, stop, func(w, i int) {
				all.note(sendRetry(fmt.Sprintf("flood-%d-%d", w, i%100)))
			})
			waitHot := loop(2, time.Millisecond, stop, func(w, i int) {
				rep := sendRetry("hot-" + name)
				all.note(rep)
				hot.note(rep)
			})
			for range reloads {
				loaded++
				c.load(site(loaded, frozen))
				time.Sleep(sized(50*time.Millisecond, 20*time.Millisecond))
			}
			close(stop)
			waitFlood()
			waitHot()
			elapsed := time.Since(start)
			if frozen {
				r.Resume()
			}
			client.CloseIdleConnections()
			goroutinesAfter, fdsAfter := 0, 0
			deadline := time.Now().Add(10 * time.Second)
			for {
				goroutinesAfter, fdsAfter = runtime.NumGoroutine(), c.fds()
				if goroutinesAfter <= goroutines+slack && fdsAfter <= fds+slack || time.Now().After(deadline) {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			var panics []string
			for _, l := range c.logs.since(mark) {
				if strings.Contains(strings.ToLower(l.text), "panic") {
					panics = append(panics, l.text)
				}
			}

			// A fresh bucket of 5, whose tokens come back at 1 a minute:
			// in Redis, or, with Redis frozen, in the local buckets that
			// fail_mode local keeps across reloads.
			due := 5 + int(elapsed/time.Minute)
			allowed := hot.codes[http.StatusOK]
			report.add(t, name, reloads, all.total(), all.codesString(), resent.Load(), all.errs, allowed, due,
				fmt.Sprintf("%d → %d", goroutines, goroutinesAfter), fmt.Sprintf("%d → %d", fds, fdsAfter), len(panics))
			if all.errs > 0 {
				t.Errorf("%d requests got no HTTP response: %v", all.errs, all.firstErr)
			}
			for code, n := range all.codes {
				if code != http.StatusOK && code != http.StatusTooManyRequests {
					t.Errorf("%d × status %d", n, code)
				}
			}
			if allowed != due {
				t.Errorf("hot key: %d requests allowed across %d reloads, want the %d its bucket holds", allowed, reloads, due)
			}
			if goroutinesAfter > goroutines+slack {
				t.Errorf("%d goroutines after the reloads, %d before", goroutinesAfter, goroutines)
			}
			if fdsAfter > fds+slack {
				t.Errorf("%d file descriptors open after the reloads, %d before", fdsAfter, fds)
			}
			for _, l := range panics {
				t.Errorf("log: %s", l)
			}
		})
	}
}

// hostileKeys are keys that might end a cluster hash tag early, start
// another, look like the escapes the store writes, name a long key as
// the store hashes it, or break a protocol.
var hostileKeys = []string{
	"}evil", "{", "}", "{}", ":", "%", "%7D", "a}", "a%7D", "%25", "%%7D",
	"\r", "\n", "\x00", "a\r\nb", "\x00}{", strings.Repeat("k", 1<<20), strings.Repeat("k", 1<<20-1) + "}",
	hashOf(strings.Repeat("k", 1<<20)), "#" + hashOf(strings.Repeat("k", 1<<20)),
}

// A key of hostile bytes is limited exactly like a plain one, on one
// Redis and on a cluster: its request's two zones are decided in one
// call, in one slot, and distinct keys keep distinct buckets however
// alike their escapes look.
func TestFaultHostileKeys(t *testing.T) {
	requireRedis(t)
	const zones = `[
		{"name":"hostile_a","key":"{http.request.header.X-Key}","rate":"1r/m","burst":2},
		{"name":"hostile_b","key":"{http.request.header.X-Key}","rate":"1r/m","burst":3}]`
	// Every request asks Redis, so that each is one script call.
	const store = `"backend":"redis","timeout":"5s","fail_mode":"closed","disable_over_limit_cache":true`
	report := newFaultReport(t, "Hostile keys", "Redis", "keys", "limited like a plain key", "script calls per request", "zones' keys in one slot")
	single := startRedis(t)
	nodes := startCluster(t)
	for _, tc := range []struct {
		name  string
		nodes []*redisServer
	}{
		{"standalone", []*redisServer{single}},
		{"cluster of 3", nodes},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var addrs []string
			for _, n := range tc.nodes {
				addrs = append(addrs, fmt.Sprintf("%q", n.Addr()))
				// Loaded on every node, the script takes one EVALSHA
				// per decision, never a NOSCRIPT and an EVAL.
				if err := redis.NewScript(lua.Decide).Load(context.Background(), newRedisClient(t, n.Addr())).Err(); err != nil {
					t.Fatal(err)
				}
			}
			h := newTestHandler(t, fmt.Sprintf(`{"zones":%s,"store":{%s,"addresses":[%s]}}`, zones, store, strings.Join(addrs, ",")))
			cluster := len(tc.nodes) > 1
			rc := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{tc.nodes[0].Addr()}, IsClusterMode: cluster})
			defer rc.Close()
			calls := func() int {
				n := 0
				for _, node := range tc.nodes {
					n += node.Calls()
				}
				return n
			}
			// Three requests: both zones allow twice, then hostile_a
			// denies and hostile_b keeps the token it would have given.
			run := func(key string) string {
				var got []string
				for range 3 {
					code, hdr := serve(h, "192.0.2.1", "X-Key", key)
					got = append(got, fmt.Sprint(code, " ", hdr.Get("Ratelimit"), " ", hdr.Get("Retry-After")))
				}
				return strings.Join(got, "; ")
			}
			want := run("plain")
			if !strings.Contains(want, `429 "hostile_a";r=0;t=60, "hostile_b";r=1;t=60 60`) {
				t.Fatalf("plain key: %s", want)
			}
			same, slots, total := 0, 0, 0
			for _, key := range hostileKeys {
				label := fmt.Sprintf("%.20q", key)
				before := calls()
				if got := run(key); got != want {
					t.Errorf("key %s: %s; a plain key got %s", label, got, want)
				} else {
					same++
				}
				n := calls() - before
				if total += n; n != 3 {
					t.Errorf("key %s: %d script calls for 3 requests", label, n)
				}
				var redisKeys []string
				for _, z := range h.Zones {
					hash, field := bucketOf(h, z.index, key)
					redisKeys = append(redisKeys, hash)
					if ok, err := rc.HExists(context.Background(), hash, field).Result(); err != nil || !ok {
						t.Errorf("key %s: bucket %.40q not in Redis: %v, %v", label, hash+field, ok, err)
					}
				}
				if cluster {
					a, errA := rc.ClusterKeySlot(context.Background(), redisKeys[0]).Result()
					b, errB := rc.ClusterKeySlot(context.Background(), redisKeys[1]).Result()
					if errA != nil || errB != nil || a != b {
						t.Errorf("key %s: the zones' keys are in slots %d and %d (%v, %v)", label, a, b, errA, errB)
					} else {
						slots++
					}
				}
			}
			inSlot := "n/a"
			if cluster {
				inSlot = fmt.Sprintf("%d of %d", slots, len(hostileKeys))
			}
			report.add(t, tc.name, len(hostileKeys), fmt.Sprintf("%d of %d", same, len(hostileKeys)),
				fmt.Sprintf("%.2f", float64(total)/float64(3*len(hostileKeys))), inSlot)
		})
	}
}

// One key flooded at `10r/s burst 20` through many connections costs
// Redis about one call per allowed request: the over-limit cache denies
// the rest, and one request at a time asks for a bucket that may have
// refilled.
func TestFaultOneKeyFlood(t *testing.T) {
	requireRedis(t)
	r := startRedis(t)
	c := startFaultCaddy(t, fmt.Sprintf(`	rate_limit {
		zone flood_one {
			key {http.request.header.X-Key}
			rate 10r/s
			burst 20
		}
		store redis {
			address %s
			timeout 5s
			key_prefix flood:
		}
	}
	respond "ok"`, r.Addr()), true)
	report := newFaultReport(t, "One key flooded at 10r/s burst 20",
		"connections", "seconds", "requests", "allowed", "due", "Redis calls", "calls/s", "calls in the first second", "most calls in a later second", "log lines")
	seconds := sized(3, 10)
	// The short version sends at most 100 requests a second per
	// connection, so that a fast machine floods no harder than a slow one.
	pace := sized(10*time.Millisecond, 0)
	for _, conns := range sized([]int{64}, []int{16, 256}) {
		t.Run(fmt.Sprint(conns, " connections"), func(t *testing.T) {
			client := newFaultClient(t, 10*time.Second)
			key := fmt.Sprint("hot-", conns)
			all := newTally()
			stop := make(chan struct{})
			mark := c.logs.mark()
			before := r.Calls()
			start := time.Now()
			wait := loop(conns, pace, stop, func(w, i int) { all.note(send(client, c.url, "X-Key", key)) })
			var perSecond []int
			last := before
			for s := range seconds {
				time.Sleep(time.Until(start.Add(time.Duration(s+1) * time.Second)))
				n := r.Calls()
				perSecond = append(perSecond, n-last)
				last = n
			}
			close(stop)
			wait()
			elapsed := time.Since(start)
			calls := r.Calls() - before
			allowed := all.codes[http.StatusOK]
			due := 20 + int(10*elapsed.Seconds())
			steady := slices.Max(perSecond[1:])
			lines := c.logs.since(mark)
			report.add(t, conns, seconds, all.total(), allowed, due, calls,
				fmt.Sprintf("%.1f", float64(calls)/elapsed.Seconds()), perSecond[0], steady, len(lines))
			// Redis is healthy: nothing to say.
			for _, l := range lines {
				t.Errorf("log: %.300s", l.text)
			}
			if all.errs > 0 || len(all.codes) > 2 {
				t.Errorf("statuses %s, want only 200 and 429", all.codesString())
			}
			if allowed > due+1 || allowed < due-5 {
				t.Errorf("%d allowed in %v, want about %d", allowed, elapsed, due)
			}
			// At most two calls per allowed request (a token's call may
			// come a little early: the cache counts from when the last
			// call was sent, Redis from when it ran), so at most 20 a
			// second once the first second is over. The short version
			// leaves room for a loaded CI machine.
			if longFaults() && steady > 20 {
				t.Errorf("%d Redis calls within one second after the first, want at most 20", steady)
			}
			if most := sized(3*allowed, 2*allowed+10); calls > most {
				t.Errorf("%d Redis calls for %d allowed requests, want at most %d", calls, allowed, most)
			}
		})
	}
}

// A flood of one-off keys, many times max_keys, against two zones
// (burst 1 at 1r/m, burst 10 at 10r/h), while one client keeps sending
// with the same key to each: memory stays flat, and the hot key gets what
// its bucket allows, not the fresh bucket an eviction would give it.
func TestFaultRotatingKeys(t *testing.T) {
	var (
		maxKeys = sized(1000, 100_000)
		flood   = sized(20_000, 2_000_000) // one-off keys, half to each zone
		senders = sized(4, 16)
	)
	zones := []struct {
		name, rate string
		perSec     float64
		burst      int
	}{
		{"evict_one", "1r/m", 1.0 / 60, 1},
		{"evict_ten", "10r/h", 10.0 / 3600, 10},
	}
	var site strings.Builder
	for _, z := range zones {
		fmt.Fprintf(&site, `	handle /%[1]s {
		rate_limit {
			zone %[1]s {
				key {http.request.header.X-Key}
				rate %[2]s
				burst %[3]d
			}
			store local {
				max_keys %[4]d
			}
		}
		respond "ok"
	}
`, z.name, z.rate, z.burst, maxKeys)
	}
	c := startFaultCaddy(t, site.String(), true)
	report := newFaultReport(t, "Rotating keys against max_keys",
		"zone", "max_keys", "one-off keys", "seconds", "tracked keys", "evictions", "hot key allowed", "due", "RSS before / full / end / peak")

	client := newFaultClient(t, 10*time.Second)
	rssStart := c.rssKB()
	var sent atomic.Int64
	stop := make(chan struct{})
	all := newTally()
	start := time.Now()
	waitFlood := loop(senders, 0, stop, func(w, i int) {
		n := sent.Add(1)
		if n > int64(flood) {
			return
		}
		all.note(send(client, c.url+"/"+zones[n%2].name, "X-Key", fmt.Sprint("one-off-", n)))
	})
	hot := make([]*tally, len(zones))
	var waitHot []func()
	for i, z := range zones {
		hot[i] = newTally()
		waitHot = append(waitHot, loop(1, 10*time.Millisecond, stop, func(int, int) {
			hot[i].note(send(client, c.url+"/"+z.name, "X-Key", "hot"))
		}))
	}
	// RSS once the tables are full, then at the end and at its peak.
	var rssFull, rssPeak int64
	for sent.Load() < int64(flood) {
		time.Sleep(100 * time.Millisecond)
		rss := c.rssKB()
		rssPeak = max(rssPeak, rss)
		if rssFull == 0 && sent.Load() >= int64(flood/10) && sent.Load() >= int64(4*maxKeys) {
			rssFull = rss
		}
	}
	close(stop)
	waitFlood()
	for _, wait := range waitHot {
		wait()
	}
	elapsed := time.Since(start)
	rssEnd := c.rssKB()
	if all.errs > 0 || len(all.codes) > 2 {
		t.Errorf("one-off keys: statuses %s", all.codesString())
	}
	for i, z := range zones {
		var info struct {
			TrackedKeys int    `json:"tracked_keys"`
			Evictions   uint64 `json:"evictions"`
		}
		resp, err := c.client.Get("http://" + c.admin + "/rate_limit/" + z.name)
		if err != nil {
			t.Fatal(err)
		}
		err = json.NewDecoder(resp.Body).Decode(&info)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		due := float64(z.burst) + z.perSec*elapsed.Seconds()
		allowed := hot[i].codes[http.StatusOK]
		report.add(t, z.name, maxKeys, flood, fmt.Sprintf("%.0f", elapsed.Seconds()), info.TrackedKeys, info.Evictions,
			allowed, fmt.Sprintf("%.1f", due), fmt.Sprintf("%d / %d / %d / %d MB", rssStart>>10, rssFull>>10, rssEnd>>10, rssPeak>>10))
		if info.Evictions == 0 {
			t.Errorf("%s: no evictions: the flood did not fill the zone", z.name)
		}
		if info.TrackedKeys > maxKeys {
			t.Errorf("%s: %d keys tracked, max_keys %d", z.name, info.TrackedKeys, maxKeys)
		}
		if float64(allowed) > 1.1*due || float64(allowed) < max(float64(z.burst), math.Floor(0.9*due)) {
			t.Errorf("%s: the hot key was allowed %d requests in %v, want within 10%% of %.1f", z.name, allowed, elapsed, due)
		}
	}
	// In this process, the clients' garbage shares the heap: only a
	// Caddy of its own shows Caddy's memory.
	if longFaults() && float64(rssEnd) > 1.25*float64(rssFull) {
		t.Errorf("RSS grew from %d MB with full tables to %d MB", rssFull>>10, rssEnd>>10)
	}
}
