// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The math of a delay: a bucket of 10r/s, burst 2, delay 300ms lets a
// request wait for up to three tokens it lacks, and no more.
func TestBucketDelay(t *testing.T) {
	l := gcra.NewLimit(10, 2)
	l.Delay = 300 * time.Millisecond
	cost := l.CostTime(1)
	var f time.Duration
	for i, want := range []time.Duration{0, 0, 100, 200, 300} {
		var ok bool
		if f, ok = l.Take(f, 0, cost); !ok {
			t.Fatalf("take %d refused", i)
		}
		if got := l.Delayed(l.Debt(f, 0)); got != want*time.Millisecond {
			t.Fatalf("take %d waits %v, want %v", i, got, want*time.Millisecond)
		}
	}
	if nf, ok := l.Take(f, 0, cost); ok || nf != f {
		t.Fatalf("take beyond the delay: ok %v, instant %v (was %v)", ok, nf, f)
	}
	if got := l.Wait(l.Debt(f, 0), cost); got != 100*time.Millisecond {
		t.Fatalf("wait %v, want 100ms: then the request waits the whole delay", got)
	}
	// Owing more than a whole bucket is a reservation, not a ban.
	if l.Banned(l.Debt(f, 0)) || l.BanLeft(l.Debt(f, 0)) != 0 {
		t.Fatal("a delayed bucket reads as banned")
	}
	// A clock that went back leaves the bucket owing at most a whole
	// bucket and the delay.
	if got := l.Debt(f+time.Hour, 0); got != l.BurstTime+l.Delay {
		t.Fatalf("debt %v, want %v", got, l.BurstTime+l.Delay)
	}
}

func TestDelayValidate(t *testing.T) {
	for _, tc := range []struct{ name, json, wantErr string }{
		{"delay", `{"zones":[{"name":"a","rate":"1r/s","delay":"2s"}]}`, ""},
		{"with window", `{"zones":[{"name":"a","window":"1m","max_events":10,"delay":"2s"}],"max_delayed":5}`, ""},
		{"with count", `{"zones":[{"name":"a","rate":"1r/s","delay":"2s","count":{"status_code":[401]}}]}`, ""},
		{"in dry run", `{"zones":[{"name":"a","rate":"1r/s","delay":"2s","dry_run":true}]}`, ""},
		{"without a rate", `{"zones":[{"name":"a","concurrency":2,"delay":"2s"}]}`, "zone a: delay needs a rate"},
		{"with a quota alone", `{"zones":[{"name":"a","quota":100,"quota_period":"day","delay":"2s"}]}`, "zone a: delay needs a rate"},
		{"negative", `{"zones":[{"name":"a","rate":"1r/s","delay":"-1s"}]}`, "zone a: invalid delay -1s: must be positive and at most 1h"},
		{"too long", `{"zones":[{"name":"a","rate":"1r/s","delay":"2h"}]}`, "zone a: invalid delay 2h0m0s"},
		{"with ban", `{"zones":[{"name":"a","rate":"1r/s","delay":"2s","ban":"1m"}]}`, "zone a: ban and delay exclude each other"},
		{"max_delayed negative", `{"zones":[{"name":"a","rate":"1r/s","delay":"2s"}],"max_delayed":-1}`, "invalid max_delayed -1: must be at least 1"},
		{"max_delayed without delay", `{"zones":[{"name":"a","rate":"1r/s"}],"max_delayed":10}`, "max_delayed needs a zone with delay"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkValidate(t, tc.json, tc.wantErr)
		})
	}
}

func TestDelayCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"not a duration", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tdelay soon\n\t}\n}", "invalid delay 'soon': expected a duration such as 2s", 4},
		{"zero", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tdelay 0s\n\t}\n}", "invalid delay 0s: must be positive", 4},
		{"no argument", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tdelay\n\t}\n}", "wrong argument count", 4},
		{"with ban", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tban 1m\n\t\tdelay 2s\n\t}\n}", "zone a: ban and delay exclude each other", 6},
		{"max_delayed 0", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tdelay 2s\n\t}\n\tmax_delayed 0\n}", "invalid max_delayed 0: must be at least 1", 6},
		{"max_delayed twice", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tdelay 2s\n\t}\n\tmax_delayed 5\n\tmax_delayed 6\n}", "max_delayed already specified", 7},
		{"max_delayed without delay", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t}\n\tmax_delayed 5\n}", "max_delayed needs a zone with delay", 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
			if suffix := fmt.Sprintf(", at Testfile:%d", tc.line); !strings.HasSuffix(err.Error(), suffix) {
				t.Errorf("error %q does not end in %q", err, suffix)
			}
		})
	}
}

// A zone in dry run never makes a request wait: it goes on at once.
func TestDelayDryRun(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"delay-dry","rate":"1r/s","burst":1,"delay":"5s","dry_run":true}]}`)
	if h.anyDelay {
		t.Fatal("a handler whose only zone with delay is in dry run counts as delaying")
	}
	for i := range 3 {
		start := time.Now()
		if code, _ := serve(h, "192.0.2.9"); code != http.StatusOK {
			t.Fatalf("request %d: status %d", i, code)
		}
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Fatalf("request %d took %v: a dry-run zone made it wait", i, d)
		}
	}
}

// A zone whose rate comes with each request (a plan) delays as one with
// a fixed rate: its requests wait for their tokens rather than go on at
// once.
func TestDelayPlan(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"delay-plan","key":"{http.request.remote.host}","rate":"{http.request.header.X-Rate}","burst":1,"delay":"5s"}]}`)
	if !h.anyDelay {
		t.Fatal("a handler whose zone with delay has a plan's rate counts as not delaying")
	}
	start := time.Now()
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.9", "X-Rate", "10r/s"); code != http.StatusOK {
			t.Fatalf("request %d: status %d", i, code)
		}
	}
	// The second and third requests wait 100 ms each for their tokens.
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Fatalf("three requests at 10r/s with burst 1 took %v: they did not wait for their tokens", d)
	}
}

// delayUpstream records when each request reached it, by path prefix.
type delayUpstream struct {
	mu       sync.Mutex
	arrivals map[string][]time.Time
}

func newDelayUpstream(t *testing.T) (*delayUpstream, string) {
	u := &delayUpstream{arrivals: make(map[string][]time.Time)}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		u.mu.Lock()
		p := strings.Split(r.URL.Path, "/")[1]
		u.arrivals[p] = append(u.arrivals[p], now)
		u.mu.Unlock()
		io.WriteString(w, "up")
	}))
	t.Cleanup(srv.Close)
	return u, strings.TrimPrefix(srv.URL, "http://")
}

func (u *delayUpstream) at(path string) []time.Time {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.arrivals[path])
}

// delaySite has three rate_limit handlers with delay: /spacing (10r/s,
// burst 1, delay 10s), /leave (1r/s, burst 1, delay 5s) and /max (the
// same as /leave, with max_delayed 3), their zone names ending in -name.
func delaySite(name, storeCfg, upstream string) string {
	return fmt.Sprintf(`http://localhost {
	handle /spacing* {
		rate_limit {
			zone spacing-%[1]s {
				key {http.request.header.X-Key}
				rate 10r/s
				burst 1
				delay 10s
			}
			%[2]s
		}
		reverse_proxy %[3]s
	}
	handle /leave* {
		rate_limit {
			zone leave-%[1]s {
				key {http.request.header.X-Key}
				rate 1r/s
				burst 1
				delay 5s
			}
			%[2]s
		}
		reverse_proxy %[3]s
	}
	handle /max* {
		rate_limit {
			zone max-%[1]s {
				key {http.request.header.X-Key}
				rate 1r/s
				burst 1
				delay 10s
			}
			max_delayed 3
			%[2]s
		}
		reverse_proxy %[3]s
	}
}
`, name, storeCfg, upstream)
}

// delayReply is what a client got.
type delayReply struct {
	code int
	hdr  http.Header
	took time.Duration
	err  error
}

func delayGet(ctx context.Context, path string) delayReply {
	return delayGetKey(ctx, path, "k")
}

func delayGetKey(ctx context.Context, path, key string) delayReply {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, siteURL+path, nil)
	req.Header.Set("X-Key", key)
	start := time.Now()
	resp, err := delayClient.Do(req)
	if err != nil {
		return delayReply{err: err, took: time.Since(start)}
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return delayReply{code: resp.StatusCode, hdr: resp.Header, took: time.Since(start)}
}

// delayClient opens as many connections as the test has requests.
var delayClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}

// zoneRefOf finds the running zone of that name.
func zoneRefOf(t *testing.T, name string) zoneRef {
	t.Helper()
	ref, ok := lookupZone(name)
	if !ok {
		t.Fatalf("zone %s is not running", name)
	}
	return ref
}

// debtOf is how long the bucket of key k in ref's zone owes now.
func debtOf(t *testing.T, ref zoneRef) time.Duration {
	t.Helper()
	d := &store.Demands{Buckets: []store.BucketDemand{bucketReq(ref.z, ref.z.keyFor("k"))}}
	if err := ref.h.store.Peek(context.Background(), time.Now(), d); err != nil {
		t.Fatal(err)
	}
	return d.Buckets[0].Debt
}

// TestDelay runs the delay scenarios through Caddy on each store.
func TestDelay(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for seconds")
	}
	r := startRedis(t)
	nodes := startCluster(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		// A timeout for a loaded test machine, not the default 100ms: a
		// call that times out is decided by fail_mode's local buckets,
		// which know nothing of the reservations Redis made.
		{"redis", fmt.Sprintf("store redis {\n\t\t\t\taddress %s\n\t\t\t\ttimeout 5s\n\t\t\t}", r.Addr())},
		{"cluster", fmt.Sprintf("store redis {\n\t\t\t\taddress %s %s %s\n\t\t\t\ttimeout 5s\n\t\t\t}", nodes[0].Addr(), nodes[1].Addr(), nodes[2].Addr())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up, upstream := newDelayUpstream(t)
			tester := startCaddy(t, "", delaySite(tc.name, tc.store, upstream))
			t.Run("spacing", func(t *testing.T) { testDelaySpacing(t, up, "spacing-"+tc.name) })
			t.Run("client leaves", func(t *testing.T) { testDelayClientLeaves(t, up, "leave-"+tc.name) })
			t.Run("max_delayed", func(t *testing.T) { testDelayMaxDelayed(t, "max-"+tc.name) })
			m := scrape(t, tester)
			spacing := "spacing-" + tc.name
			served := m[`caddy_rate_limit_delayed_total{result="served",zone="`+spacing+`"}`]
			if served < 99 {
				t.Errorf("delayed_total served = %v, want at least 99", served)
			}
			if got := m[`caddy_rate_limit_delay_seconds_count{zone="`+spacing+`"}`]; got != served {
				t.Errorf("delay_seconds_count = %v, want %v (each delayed request once)", got, served)
			}
			wantMetric(t, m, `caddy_rate_limit_delayed_total{result="abandoned",zone="leave-`+tc.name+`"}`, 1)
			wantMetric(t, m, `caddy_rate_limit_delayed_total{result="refused",zone="max-`+tc.name+`"}`, 1)
			wantMetric(t, m, `caddy_rate_limit_delayed_total{result="abandoned",zone="max-`+tc.name+`"}`, 3)
		})
	}
}

// 100 concurrent requests at 10r/s, burst 1, delay 10s all go on, one
// every 100ms; a request that would wait longer than 10s is refused.
func testDelaySpacing(t *testing.T, up *delayUpstream, zone string) {
	const n, spacing = 100, 100 * time.Millisecond
	st := zoneRefOf(t, zone).z.state
	// A first request of another key connects to the store (and loads
	// Redis's script), so that the first of the 100 is not late.
	if rep := delayGetKey(context.Background(), "/spacing", "warm"); rep.code != http.StatusOK {
		t.Fatalf("warm-up request: %d %v", rep.code, rep.err)
	}
	base := st.allowed.Load()
	allowed := func() int { return int(st.allowed.Load() - base) }
	replies := make([]delayReply, n)
	var wg sync.WaitGroup
	// The first's slot, s0, is when it is decided, after sent; the k-th
	// request's slot is s0 + k·100ms, or later if the machine held its
	// decision past that.
	sent := time.Now()
	for i := range n {
		wg.Go(func() { replies[i] = delayGet(context.Background(), "/spacing") })
	}
	waitFor(t, 10*time.Second, "the 100 requests decided", func() bool { return allowed()+int(st.denied.Load()) >= n })
	decided := time.Now()
	if d := st.denied.Load(); d != 0 {
		t.Fatalf("%d of the 100 requests refused", d)
	}
	// The bucket holds the 100 requests' tokens: it is full again 100
	// slots after the first's, which was decided between sent and
	// decided.
	p0 := time.Now()
	owed := debtOf(t, zoneRefOf(t, zone))
	p1 := time.Now()
	if full, lo, hi := p0.Add(owed), sent.Add(n*spacing), decided.Add(n*spacing); p1.Add(owed).Before(lo) || full.After(hi) {
		t.Errorf("the bucket is full again %v after the requests were sent, want %v to %v: the 100 requests' tokens", full.Sub(sent), lo.Sub(sent), hi.Sub(sent))
	}

	// The bucket holds 101 requests' worth (burst 1, 10s of delay), and
	// one more every 100ms: of ten more requests at once, those beyond
	// are refused as they would wait more than 10s, at once and charged
	// nothing.
	const more = 10
	extras := make([]delayReply, more)
	var ewg sync.WaitGroup
	for i := range more {
		ewg.Go(func() { extras[i] = delayGet(context.Background(), "/spacing") })
	}
	deadline := time.Now().Add(5 * time.Second)
	for allowed()+int(st.denied.Load()) < n+more {
		if time.Now().After(deadline) {
			t.Fatal("the ten more requests not decided")
		}
		time.Sleep(time.Millisecond)
	}
	decidedAt := time.Now()
	let := allowed() - n
	if let == more {
		t.Fatal("none of the ten more requests refused")
	}
	wg.Wait()
	for i, rep := range replies {
		if rep.err != nil || rep.code != http.StatusOK {
			t.Fatalf("request %d: %d %v", i, rep.code, rep.err)
		}
		if rl := rep.hdr.Get("Ratelimit"); !strings.Contains(rl, `"`+zone+`";r=0;`) {
			t.Errorf("request %d: RateLimit %q, want r=0", i, rl)
		}
	}
	ewg.Wait()
	refused := 0
	for i, rep := range extras {
		switch {
		case rep.code == http.StatusTooManyRequests:
			refused++
			if rep.took > time.Second || rep.hdr.Get("Retry-After") != "1" {
				t.Errorf("refusal %d took %v with Retry-After %q; want at once, and 1", i, rep.took, rep.hdr.Get("Retry-After"))
			}
		case rep.code != http.StatusOK:
			t.Fatalf("extra request %d: %d %v", i, rep.code, rep.err)
		}
	}
	if refused != more-let {
		t.Fatalf("%d of the ten more refused, %d counted", refused, more-let)
	}

	at := up.at("spacing")[1:] // after the warm-up request
	if len(at) != n+let {
		t.Fatalf("the upstream saw %d requests, want %d", len(at), n+let)
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	// By τ after s0, the bucket has taken 101 + τ/100ms requests: the
	// more requests allowed found room that time had made.
	if most := 1 + int(decidedAt.Sub(sent)/spacing); let > most {
		t.Errorf("%d more requests allowed %v after the first was sent, want at most %d", let, decidedAt.Sub(sent), most)
	}
	// Never early: by any instant, no more requests reach the upstream
	// than slots have begun since the first's, which is after sent (a
	// millisecond for Redis's clock, which counts in microseconds).
	for k, a := range at {
		if slot := sent.Add(time.Duration(k) * spacing); a.Before(slot.Add(-time.Millisecond)) {
			t.Errorf("%d requests reached the upstream by %v after they were sent, want at most %d: one went on ahead of its token", k+1, a.Sub(sent), k)
		}
	}
	// How late each comes is the runtime's: its timer fires, and the
	// proxy passes it on, when the machine's CPUs let them, which on a
	// machine that other tests load (they run under -race beside others)
	// is up to hundreds of milliseconds after its slot, for a tenth of
	// the requests or more. It is reported, against the slots as the
	// median of the arrivals places them; what the handler decided is
	// asserted above.
	offs := make([]time.Duration, 0, len(at)-1)
	for k, a := range at[1:] {
		offs = append(offs, a.Sub(at[0])-time.Duration(k+1)*spacing)
	}
	slices.Sort(offs)
	t0 := at[0].Add(offs[len(offs)/2])
	worst, late := time.Duration(0), 0
	for k, a := range at[1:] {
		off := a.Sub(t0) - time.Duration(k+1)*spacing
		worst = max(worst, off)
		if off > spacing/20 {
			late++
		}
	}
	t.Logf("%d requests waited for their slots 100ms apart, %d of them more than 5ms after the median's, the latest by %v; the first, which did not wait, came %v after the median's first slot",
		len(at)-1, late, worst, at[0].Sub(t0))
}

// A client that leaves while its request waits gets its tokens back: the
// request never reaches the upstream, and the next one waits only for
// the tokens that the first request took. The first took its token at an
// instant between its sending and its answer (T1), and the bucket is
// full again a second after, or two with the waiting request's token:
// what the test asks of the bucket and of the next request follows from
// those instants, which a loaded machine may hold apart.
func testDelayClientLeaves(t *testing.T, up *delayUpstream, zone string) {
	ref := zoneRefOf(t, zone)
	st := ref.z.state
	const token = time.Second // 1r/s, burst 1
	firstSent := time.Now()
	if rep := delayGet(context.Background(), "/leave"); rep.code != http.StatusOK {
		t.Fatalf("first request: %d %v", rep.code, rep.err)
	}
	firstAnswered := time.Now()
	owes := func(what string, tokens int) {
		t.Helper()
		checkOwes(t, ref, what, firstSent, firstAnswered, time.Duration(tokens)*token)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan delayReply, 1)
	go func() { done <- delayGet(ctx, "/leave") }()
	waitFor(t, 5*time.Second, "the second request decided", func() bool { return st.allowed.Load() == 2 })
	owes("the waiting request", 2)
	cancel()
	if rep := <-done; rep.err == nil {
		t.Fatalf("the client that left got %d", rep.code)
	}
	waitFor(t, 5*time.Second, "the tokens given back", func() bool { return st.delayAbandoned.Load() == 1 })
	owes("after the client left", 1)

	// The third request goes on when the first's token is back, never
	// before; it was told to wait no longer than from its sending until
	// then (the delays' sum, delay_seconds).
	delaySum := func() float64 {
		t.Helper()
		series := `caddy_rate_limit_delay_seconds_sum{zone="` + zone + `"}`
		v, ok := scrapeAt(t, http.DefaultClient, adminAddr)[series]
		if !ok {
			t.Fatalf("no %s in the metrics", series)
		}
		return v
	}
	before := delaySum()
	sent := time.Now()
	rep := delayGet(context.Background(), "/leave")
	answered := time.Now()
	if rep.code != http.StatusOK {
		t.Fatalf("third request: %d %v", rep.code, rep.err)
	}
	if back := firstSent.Add(token); answered.Before(back) {
		t.Fatalf("third request answered %v before the first's token was back", back.Sub(answered))
	}
	if waited, most := time.Duration((delaySum()-before)*float64(time.Second)), firstAnswered.Add(token).Sub(sent); waited > most+time.Millisecond {
		t.Fatalf("third request waited %v, want at most the %v until the first's token was back: the one whose client left still holds tokens", waited, most)
	}
	if n := len(up.at("leave")); n != 2 {
		t.Fatalf("the upstream saw %d requests, want 2: the one whose client left never went on", n)
	}
	if w := ref.h.waiting.Load(); w != 0 {
		t.Fatalf("%d requests still counted as waiting", w)
	}
}

// checkOwes checks what the bucket of key k in ref's zone owes, against
// when it is full again: full after a request decided between sent and
// answered, seen between the peek's start and end.
func checkOwes(t *testing.T, ref zoneRef, what string, sent, answered time.Time, full time.Duration) {
	t.Helper()
	p0 := time.Now()
	d := debtOf(t, ref)
	p1 := time.Now()
	if lo, hi := max(sent.Add(full).Sub(p1), 0), max(answered.Add(full).Sub(p0), 0); d < lo || d > hi {
		t.Fatalf("%s: the bucket owes %v, want %v to %v: full again %v after the first request", what, d, lo, hi, full)
	}
}

// max_delayed 3: with three requests waiting, a fourth that would wait is
// refused as if the zone had no delay, and charged nothing.
func testDelayMaxDelayed(t *testing.T, zone string) {
	ref := zoneRefOf(t, zone)
	st := ref.z.state
	// What the test asks of the bucket and of the refused request follows
	// from when the first took its token, between its sending and its
	// answer (see testDelayClientLeaves).
	firstSent := time.Now()
	if rep := delayGet(context.Background(), "/max"); rep.code != http.StatusOK {
		t.Fatalf("first request: %d %v", rep.code, rep.err)
	}
	firstAnswered := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() { delayGet(ctx, "/max") })
	}
	waitFor(t, 5*time.Second, "three requests waiting", func() bool { return st.allowed.Load() == 4 })
	if w := ref.h.waiting.Load(); w != 3 {
		t.Fatalf("%d requests waiting, want 3", w)
	}
	// Its token is there 4s after the first request's: refused at once,
	// it is answered before then.
	sent := time.Now()
	rep := delayGet(context.Background(), "/max")
	answered := time.Now()
	if rep.code != http.StatusTooManyRequests || !answered.Before(firstSent.Add(4*time.Second)) {
		t.Fatalf("fourth waiting request: %d after %v, want 429 at once", rep.code, rep.took)
	}
	// Retry-After as without a delay: the time until its token is there,
	// in whole seconds (4, unless the machine took long to get here).
	lo := int(math.Ceil(firstSent.Add(4 * time.Second).Sub(answered).Seconds()))
	hi := int(math.Ceil(firstAnswered.Add(4 * time.Second).Sub(sent).Seconds()))
	if got, err := strconv.Atoi(rep.hdr.Get("Retry-After")); err != nil || got < lo || got > hi {
		t.Errorf("Retry-After %q, want %d to %d", rep.hdr.Get("Retry-After"), lo, hi)
	}
	if st.delayRefused.Load() != 1 {
		t.Errorf("delay refusals %d, want 1", st.delayRefused.Load())
	}
	// The refused request took nothing: four tokens after the first's.
	checkOwes(t, ref, "after the refusal", firstSent, firstAnswered, 4*time.Second)
	cancel()
	wg.Wait()
	waitFor(t, 5*time.Second, "the three given back", func() bool { return st.delayAbandoned.Load() == 3 })
	if w := ref.h.waiting.Load(); w != 0 {
		t.Fatalf("%d requests still counted as waiting", w)
	}
	checkOwes(t, ref, "after the three left", firstSent, firstAnswered, time.Second)
}
