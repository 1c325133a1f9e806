// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"runtime"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// A dry-run zone never blocks, still counts what it would have denied,
// and tells the upstream through its placeholder; an enforced zone next
// to it still blocks, and is charged for the requests that go on.
func TestDryRun(t *testing.T) {
	for _, shadowFirst := range []bool{true, false} {
		zones := []string{
			fmt.Sprintf(`{"name":"dry-shadow-%v","rate":"1r/m","burst":2,"dry_run":true}`, shadowFirst),
			fmt.Sprintf(`{"name":"dry-enforced-%v","rate":"1r/h","burst":5}`, shadowFirst),
		}
		if !shadowFirst {
			zones[0], zones[1] = zones[1], zones[0]
		}
		h := newTestHandler(t, `{"zones":[`+strings.Join(zones, ",")+`]}`)
		shadow, enforced := h.Zones[0], h.Zones[1]
		if !shadowFirst {
			shadow, enforced = enforced, shadow
		}
		var wouldDeny []string
		for i := range 6 {
			req, rr := newRequest("192.0.2.30")
			err := h.ServeHTTP(rr, req, okHandler)
			repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			v, _ := repl.Get("http.rate_limit." + shadow.Name + ".would_deny")
			wouldDeny = append(wouldDeny, fmt.Sprint(v))
			if i < 5 && (err != nil || rr.Code != http.StatusOK) {
				t.Fatalf("request %d: %v, %d: a dry-run zone blocked", i, err, rr.Code)
			}
			if i == 5 {
				if statusOf(err) != http.StatusTooManyRequests {
					t.Fatalf("request 6: %v: the enforced zone did not block", err)
				}
				// The enforced zone speaks for the 429: it waits an hour.
				if got, _ := repl.Get("http.rate_limit.exceeded.name"); got != enforced.Name || rr.Header().Get("Retry-After") != "3600" {
					t.Fatalf("exceeded %v with Retry-After %s, want %s and 3600", got, rr.Header().Get("Retry-After"), enforced.Name)
				}
			}
		}
		if got := strings.Join(wouldDeny, " "); got != "false false true true true true" {
			t.Fatalf("would_deny placeholders: %s", got)
		}
		s, e := shadow.state, enforced.state
		counts := fmt.Sprint(s.allowed.Load(), s.dryRunDenied.Load(), s.denied.Load(), e.allowed.Load(), e.denied.Load())
		if counts != "2 4 0 5 1" {
			t.Fatalf("shadow allowed/dry-run denied/denied, enforced allowed/denied = %s, want 2 4 0 5 1", counts)
		}
	}

	// The handler-wide dry_run: nothing is ever blocked.
	h := newTestHandler(t, `{"dry_run":true,"zones":[{"name":"dry-all","rate":"1r/m","burst":1}]}`)
	for i := range 3 {
		if code, _ := serve(h, "192.0.2.31"); code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	if n := h.Zones[0].state.dryRunDenied.Load(); n != 2 {
		t.Fatalf("dry-run denials %d, want 2", n)
	}
}

// The sketch finds the keys denied most under a skewed load, and its
// memory does not grow with the number of distinct keys.
func TestTopKeys(t *testing.T) {
	top := newTopKeys(topKeysSize)
	r := rand.New(rand.NewPCG(1, 2))
	heavy := []string{"heavy-1", "heavy-2", "heavy-3"}
	var before, after runtime.MemStats
	for round := range 2 {
		runtime.GC()
		runtime.ReadMemStats(&before)
		for i := range 200_000 {
			switch {
			case i%10 < 3: // 30% of denials from three keys
				top.add(bucketKey{s: heavy[i%10]})
			default: // the rest from 100k others, rarely the same twice
				top.add(bucketKey{s: fmt.Sprintf("light-%d-%d", round, r.IntN(100_000))})
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		if round == 1 && after.HeapAlloc > before.HeapAlloc+64<<10 {
			t.Fatalf("the sketch grew by %d bytes on 200k more denials", after.HeapAlloc-before.HeapAlloc)
		}
	}
	list := top.list()
	if len(list) != topKeysSize {
		t.Fatalf("tracking %d keys, want %d", len(list), topKeysSize)
	}
	for i, want := range heavy {
		got := list[i]
		if !strings.HasPrefix(got.key.s, "heavy-") || got.count-got.err < 2*20_000-1000 {
			t.Fatalf("rank %d: %s with %d (±%d), want %s near 40000", i, got.key.s, got.count, got.err, want)
		}
	}

	// Long keys are kept short, and stay distinct.
	long := strings.Repeat("x", 1<<20)
	top = newTopKeys(4)
	top.add(bucketKey{s: long + "a"})
	top.add(bucketKey{s: long + "b"})
	top.add(bucketKey{s: long + "a"})
	list = top.list()
	if len(list) != 2 || list[0].count != 2 || len(list[0].key.s) > topKeyMax+8 {
		t.Fatalf("long keys: %d entries, first %d long with %d", len(list), len(list[0].key.s), list[0].count)
	}
}

// The rate_limit_exceeded event reaches its subscribers, with the fields
// github.com/mholt/caddy-ratelimit sends.
func TestExceededEvent(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"events","rate":"1r/m","burst":1}]}`)
	app := new(caddyevents.App)
	if err := app.Provision(h.ctx); err != nil {
		t.Fatal(err)
	}
	sub := &eventRecorder{}
	if err := app.On(exceededEvent, sub); err != nil {
		t.Fatal(err)
	}
	h.events = app
	serve(h, "192.0.2.40")
	serve(h, "192.0.2.40")
	got := sub.events
	if len(got) != 1 {
		t.Fatalf("%d events for one denial", len(got))
	}
	d := got[0].Data
	if d["zone"] != "events" || d["remote_ip"] != "192.0.2.40" || fmt.Sprint(d["wait"]) == "0s" {
		t.Fatalf("event data %v", d)
	}
}

// eventRecorder is an events handler that keeps what it gets.
type eventRecorder struct{ events []caddy.Event }

func (r *eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	r.events = append(r.events, e)
	return nil
}

// The admin API's view of a bucket, and its reset, through the store.
func TestAdminBucket(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"admin-unit","rate":"1r/m","burst":3}]}`)
	for range 3 {
		serve(h, "2001:db8:1::5")
	}
	z := h.Zones[0]
	q := request{zone: z, key: z.keyFor("2001:db8:1::77")} // the same /64
	if err := h.store.peek(context.Background(), nowForTest(), &q); err != nil {
		t.Fatal(err)
	}
	if tokens := z.limit.tokens(q.debt); tokens > 0.1 {
		t.Fatalf("tokens %v, want about 0", tokens)
	}
	if q.key.ip != netip.MustParsePrefix("2001:db8:1::/64") {
		t.Fatalf("bucket %v", q.key)
	}
	if err := h.reset(context.Background(), &q); err != nil {
		t.Fatal(err)
	}
	if code, hdr := serve(h, "2001:db8:1::5"); code != http.StatusOK || hdr.Get("X-Ratelimit-Remaining") != "2" {
		t.Fatalf("after reset: %d, remaining %s", code, hdr.Get("X-Ratelimit-Remaining"))
	}
}
