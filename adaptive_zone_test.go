// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/adaptive"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestAdaptiveCaddyfileErrors(t *testing.T) {
	const prio = "priority {http.request.header.X-Priority}"
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"with a lease", `rate_limit {
	zone a {
		concurrency adaptive
		lease 10s
	}
}`, "zone a: lease needs a fixed concurrency", 5},
		{"with a fixed concurrency", `rate_limit {
	zone a {
		concurrency adaptive
		concurrency 4
	}
}`, "zone a: concurrency already specified", 4},
		{"unknown subdirective", `rate_limit {
	zone a {
		concurrency adaptive {
			bogus 1
		}
	}
}`, "unrecognized concurrency adaptive subdirective 'bogus'", 4},
		{"min 0", `rate_limit {
	zone a {
		concurrency adaptive {
			min 0
		}
	}
}`, "invalid concurrency adaptive min 0: must be 1 to 1000000", 4},
		{"max below min", `rate_limit {
	zone a {
		concurrency adaptive {
			min 10
			max 5
		}
	}
}`, "invalid concurrency adaptive max 5: must be at least min 10", 6},
		{"an argument after adaptive", `rate_limit {
	zone a {
		concurrency adaptive 5
	}
}`, "wrong argument count", 3},
		{"min without a number", `rate_limit {
	zone a {
		concurrency adaptive {
			min
		}
	}
}`, "wrong argument count", 4},
		{"burst without a rate", `rate_limit {
	zone a {
		concurrency adaptive
		burst 5
	}
}`, "zone a: burst needs a rate", 5},
		{"a reserve of 0%", adaptiveBlock(prio, "reserve critical 0%"), "invalid reserve critical 0%: must be above 0% and below 100%", 5},
		{"a reserve of 100%", adaptiveBlock(prio, "reserve critical 100%"), "invalid reserve critical 100%: must be above 0% and below 100%", 5},
		{"reserves summing to 100%", adaptiveBlock(prio, "reserve critical 40%", "reserve interactive 60%"),
			"reserves sum to 100%: they must leave the lowest class part of the limit", 6},
		{"a class reserved twice", adaptiveBlock(prio, "reserve critical 10%", "reserve interactive 10%", "reserve critical 10%"), "class critical reserved twice", 7},
		{"a reserve without priority", adaptiveBlock("reserve critical 20%"), "reserve needs priority", 5},
		{"priority without a reserve", adaptiveBlock(prio), "priority needs a reserve", 5},
		{"priority without placeholders", adaptiveBlock("priority critical", "reserve critical 20%"), "invalid priority 'critical': must hold placeholders", 6},
		{"priority twice", adaptiveBlock(prio, "priority {http.request.header.X-Class}"), "priority already specified", 5},
		{"a reserve without %", adaptiveBlock(prio, "reserve critical 20"), "invalid reserve '20': a percentage, such as 20%", 5},
		{"a reserve of the lowest class", adaptiveBlock(prio, "reserve other 20%"), "invalid reserve class 'other': it names the lowest class", 5},
		{"a reserve without its share", adaptiveBlock(prio, "reserve critical"), "wrong argument count", 5},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

// adaptiveBlock is a Caddyfile whose zone a has a `concurrency adaptive`
// block of lines, the first on line 4.
func adaptiveBlock(lines ...string) string {
	return "rate_limit {\n\tzone a {\n\t\tconcurrency adaptive {\n\t\t\t" + strings.Join(lines, "\n\t\t\t") + "\n\t\t}\n\t}\n}"
}

func TestAdaptiveValidate(t *testing.T) {
	for _, tc := range []struct{ zone, wantErr string }{
		{`"concurrency_adaptive":{}`, ""},
		{`"concurrency_adaptive":{"min":1,"max":1}`, ""},
		{`"rate":"10r/s","concurrency_adaptive":{"max":50}`, ""},
		{`"concurrency_adaptive":{},"concurrency":4`, "concurrency adaptive and a fixed concurrency exclude each other"},
		{`"concurrency_adaptive":{},"concurrency":4,"lease":10000000000`, "concurrency adaptive and a fixed concurrency exclude each other"},
		{`"concurrency_adaptive":{},"lease":10000000000`, "lease needs a fixed concurrency"},
		{`"concurrency_adaptive":{"min":20,"max":10}`, "invalid concurrency adaptive max 10: must be at least min 20"},
		{`"concurrency_adaptive":{"max":2000000}`, "invalid concurrency adaptive max 2000000: must be 1 to 1000000"},
		{`"concurrency_adaptive":{"min":-1}`, "invalid concurrency adaptive min -1"},
		{`"concurrency_adaptive":{},"cost":2`, "cost needs a rate"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":20},{"class":"interactive","percent":30.5}]}`, ""},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical"}]}`, "invalid reserve critical 0%: must be above 0% and below 100%"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":-5}]}`, "invalid reserve critical -5%"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":100}]}`, "invalid reserve critical 100%"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"a","percent":50},{"class":"b","percent":50}]}`, "reserves sum to 100%"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"a","percent":10},{"class":"a","percent":10}]}`, "class a reserved twice"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"percent":10}]}`, "reserve needs a class"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}","reserve":[{"class":"other","percent":10}]}`, "invalid reserve class 'other'"},
		{`"concurrency_adaptive":{"reserve":[{"class":"critical","percent":20}]}`, "reserve needs priority"},
		{`"concurrency_adaptive":{"priority":"{http.request.header.X-Priority}"}`, "priority needs a reserve"},
	} {
		t.Run(tc.zone, func(t *testing.T) {
			checkValidate(t, `{"zones":[{"name":"a","key":"static",`+tc.zone+`}]}`, tc.wantErr)
		})
	}
}

// gate is a next handler whose requests wait until it is opened, or
// their client leaves; it answers status.
type gate struct {
	arrived chan struct{}
	open    chan struct{}
	status  int
}

func newGate(status int) *gate {
	return &gate{arrived: make(chan struct{}, 64), open: make(chan struct{}), status: status}
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	g.arrived <- struct{}{}
	select {
	case <-g.open:
	case <-r.Context().Done():
	}
	w.WriteHeader(g.status)
	return nil
}

// hold sends n requests through h into g, with the header name/value
// pairs, and waits until they are all there; the returned function opens
// the gate and waits for them.
func hold(t *testing.T, h *Handler, g *gate, n int, header ...string) (release func()) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, rr := newRequest("192.0.2.1", header...)
			if err := h.ServeHTTP(rr, req, g); err != nil {
				t.Errorf("held request: %v", err)
			}
		})
	}
	waitArrivals(t, g.arrived, n)
	return func() {
		close(g.open)
		wg.Wait()
	}
}

// A request beyond the adaptive limit is shed with 503 and Retry-After:
// 1, as an error for handle_errors, and spends no tokens in the other
// zones of the handler.
func TestAdaptiveShed(t *testing.T) {
	h := newTestHandler(t, `{"zones":[
		{"name":"shed_adaptive","key":"static","concurrency_adaptive":{"min":2,"max":2}},
		{"name":"shed_rate","key":"static","rate":"1r/m","burst":4}]}`)
	release := hold(t, h, newGate(http.StatusOK), 2)
	for range 3 {
		req, rr := newRequest("192.0.2.1")
		err := h.ServeHTTP(rr, req, okHandler)
		if statusOf(err) != http.StatusServiceUnavailable || rr.Header().Get("Retry-After") != "1" {
			t.Fatalf("beyond the limit: error %v, Retry-After %q; want a 503 error and 1", err, rr.Header().Get("Retry-After"))
		}
		repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if name, _ := repl.Get("http.rate_limit.exceeded.name"); name != "shed_adaptive" {
			t.Errorf("exceeded.name %v, want shed_adaptive", name)
		}
	}
	release()
	// The two held requests took 2 of the 4 tokens; the shed ones none.
	for i, want := range []int{200, 200, 429} {
		if got, _ := serve(h, "192.0.2.1"); got != want {
			t.Errorf("request %d after: %d, want %d", i, got, want)
		}
	}
	st := h.Zones[0].state
	if st.shed.Load() != 3 || st.allowed.Load() != 4 {
		t.Errorf("shed %d, allowed %d; want 3 and 4", st.shed.Load(), st.allowed.Load())
	}
	if rate := h.Zones[1].state; rate.allowed.Load() != 4 || rate.denied.Load() != 1 {
		t.Errorf("rate zone: allowed %d, denied %d; want 4 and 1", rate.allowed.Load(), rate.denied.Load())
	}
	if tot := h.Zones[0].adaptive.table.Totals(); tot.InFlight != 0 || tot.Keys != 1 {
		t.Errorf("%d in flight in %d keys after, want 0 in 1", tot.InFlight, tot.Keys)
	}
}

// With priority, a request is admitted while the requests in flight,
// whatever their class, are below its class's part of the limit: with a
// limit of 4 and `reserve critical 25%`, the lowest class (no class, or
// one that no reserve names) has 3 places, critical all 4. Sheds are
// counted by class, and a key's view shows each class's requests in
// flight.
func TestAdaptivePriority(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"prio_adaptive","key":"static","concurrency_adaptive":{"min":4,"max":4,
		"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":25}]}}]}`)
	releaseOther := hold(t, h, newGate(http.StatusOK), 3)
	for _, header := range [][]string{nil, {"X-Priority", "bulk"}, {"X-Priority", "Critical"}} {
		if got, _ := serve(h, "192.0.2.1", header...); got != http.StatusServiceUnavailable {
			t.Errorf("the lowest class (%v) beyond its 3 places: %d, want 503", header, got)
		}
	}
	releaseCritical := hold(t, h, newGate(http.StatusOK), 1, "X-Priority", "critical")
	if got, _ := serve(h, "192.0.2.1", "X-Priority", "critical"); got != http.StatusServiceUnavailable {
		t.Errorf("critical beyond the whole limit: %d, want 503", got)
	}
	got, err := adminGet(t, http.MethodGet, "/rate_limit/prio_adaptive/static")
	if err != nil {
		t.Fatal(err)
	}
	a, _ := got["concurrency_adaptive"].(map[string]any)
	if classes := fmt.Sprint(a["classes"]); a["in_flight"] != 4.0 || classes != "[map[class:critical in_flight:1] map[class:other in_flight:3]]" {
		t.Errorf("key: %v, want 4 in flight, 1 of critical and 3 of other", a)
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/prio_adaptive")
	zone, _ := got["concurrency_adaptive"].(map[string]any)
	want := "[map[class:critical dry_run_shed:0 reserve_percent:25 shed:1] map[class:other dry_run_shed:0 reserve_percent:0 shed:3]]"
	if classes := fmt.Sprint(zone["classes"]); classes != want || zone["priority"] != "{http.request.header.X-Priority}" {
		t.Errorf("zone: %v, want the priority and the classes %s", zone, want)
	}
	releaseOther()
	releaseCritical()
	if st := h.Zones[0].state; st.shed.Load() != 4 {
		t.Errorf("shed %d, want 4", st.shed.Load())
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/prio_adaptive/static")
	if a, _ := got["concurrency_adaptive"].(map[string]any); fmt.Sprint(a["classes"]) != "[map[class:critical in_flight:0] map[class:other in_flight:0]]" {
		t.Errorf("key after: %v, want none in flight", a)
	}
}

// In dry run, a request beyond its class's part goes on, counted by
// class.
func TestAdaptivePriorityDryRun(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"prio_dry_adaptive","key":"static","dry_run":true,"concurrency_adaptive":{"min":2,"max":2,
		"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":50}]}}]}`)
	release := hold(t, h, newGate(http.StatusOK), 1)
	for _, header := range [][]string{nil, {"X-Priority", "critical"}} {
		if got, _ := serve(h, "192.0.2.1", header...); got != http.StatusOK {
			t.Errorf("%v in dry run: %d, want 200", header, got)
		}
	}
	release()
	got, _ := adminGet(t, http.MethodGet, "/rate_limit/prio_dry_adaptive")
	zone, _ := got["concurrency_adaptive"].(map[string]any)
	if classes := fmt.Sprint(zone["classes"]); classes != "[map[class:critical dry_run_shed:0 reserve_percent:50 shed:0] map[class:other dry_run_shed:1 reserve_percent:0 shed:0]]" {
		t.Errorf("classes %s, want one of other that would have been shed", classes)
	}
}

// A zone without priority shows no classes, and a request's header
// changes nothing.
func TestAdaptiveWithoutPriority(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"noprio_adaptive","key":"static","concurrency_adaptive":{"min":2,"max":2}}]}`)
	release := hold(t, h, newGate(http.StatusOK), 2, "X-Priority", "critical")
	if got, _ := serve(h, "192.0.2.1", "X-Priority", "critical"); got != http.StatusServiceUnavailable {
		t.Errorf("beyond the limit: %d, want 503", got)
	}
	got, _ := adminGet(t, http.MethodGet, "/rate_limit/noprio_adaptive/static")
	zone, _ := adminGet(t, http.MethodGet, "/rate_limit/noprio_adaptive")
	if a, _ := got["concurrency_adaptive"].(map[string]any); a["classes"] != nil || fmt.Sprint(zone["concurrency_adaptive"]) != "map[in_flight:2 keys:1 limit:2 max:2 min:2]" {
		t.Errorf("key %v, zone %v: want no classes", a, zone["concurrency_adaptive"])
	}
	release()
}

// A request refused by another zone gives its place back: the limit of
// 1 lets the next one through.
func TestAdaptiveOtherZoneRefuses(t *testing.T) {
	h := newTestHandler(t, `{"zones":[
		{"name":"refuse_adaptive","key":"static","concurrency_adaptive":{"min":1,"max":1}},
		{"name":"refuse_rate","rate":"1r/m","burst":1}]}`)
	for i, tc := range []struct {
		ip   string
		want int
	}{{"192.0.2.1", 200}, {"192.0.2.1", 429}, {"192.0.2.2", 200}} {
		if got, _ := serve(h, tc.ip); got != tc.want {
			t.Errorf("request %d: %d, want %d", i, got, tc.want)
		}
	}
}

// In dry run, a request beyond the limit goes on, counted and marked.
func TestAdaptiveDryRun(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"dry_adaptive","key":"static","concurrency_adaptive":{"min":1,"max":1},"dry_run":true}]}`)
	release := hold(t, h, newGate(http.StatusOK), 1)
	req, rr := newRequest("192.0.2.1")
	if err := h.ServeHTTP(rr, req, okHandler); err != nil || rr.Code != 200 {
		t.Fatalf("beyond the limit in dry run: %v, %d; want it served", err, rr.Code)
	}
	repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if v, _ := repl.Get("http.rate_limit.dry_adaptive.would_deny"); v != true {
		t.Errorf("would_deny %v, want true", v)
	}
	release()
	req, rr = newRequest("192.0.2.1")
	if err := h.ServeHTTP(rr, req, okHandler); err != nil {
		t.Fatal(err)
	}
	repl = req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if v, _ := repl.Get("http.rate_limit.dry_adaptive.would_deny"); v != false {
		t.Errorf("would_deny %v within the limit, want false", v)
	}
	st := h.Zones[0].state
	if st.dryRunShed.Load() != 1 || st.shed.Load() != 0 {
		t.Errorf("dry_run_shed %d, shed %d; want 1 and 0", st.dryRunShed.Load(), st.shed.Load())
	}
}

// What a response tells the controller.
func TestAdaptiveResponseKinds(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"kinds_adaptive","key":"static","concurrency_adaptive":{}}]}`)
	for _, tc := range []struct {
		name string
		next caddyhttp.HandlerFunc
		gone bool
		want adaptive.Sample
	}{
		{"200", func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(200); return nil }, false, adaptive.SampleOK},
		{"a body alone", func(w http.ResponseWriter, _ *http.Request) error { _, err := io.WriteString(w, "ok"); return err }, false, adaptive.SampleOK},
		{"404", func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(404); return nil }, false, adaptive.SampleOK},
		{"an error of 404", func(http.ResponseWriter, *http.Request) error { return caddyhttp.Error(404, nil) }, false, adaptive.SampleOK},
		{"502", func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(502); return nil }, false, adaptive.SampleError},
		{"an error of 503", func(http.ResponseWriter, *http.Request) error { return caddyhttp.Error(503, nil) }, false, adaptive.SampleError},
		{"an error without a status", func(http.ResponseWriter, *http.Request) error { return io.ErrUnexpectedEOF }, false, adaptive.SampleError},
		{"101", func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(101); return nil }, false, adaptive.SampleNone},
		{"the client left", func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(502); return nil }, true, adaptive.SampleGone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, rr := newRequest("192.0.2.1")
			if tc.gone {
				ctx, cancel := context.WithCancel(req.Context())
				cancel()
				req = req.WithContext(ctx)
			}
			sc := h.scratch.Get().(*scratch)
			defer h.finish(req, sc)
			if out, err := h.decide(rr, req, sc); out != outcomeAllow || err != nil || !sc.adaptive.held {
				t.Fatalf("decide: %v %v, held %v", out, err, sc.adaptive.held)
			}
			_ = h.serveAdaptive(rr, req, tc.next, sc)
			if sc.adaptive.kind != tc.want {
				t.Errorf("kind %d, want %d", sc.adaptive.kind, tc.want)
			}
		})
	}
}

// A large change of the limit is logged at INFO, at most one line per
// zone every adaptiveLogEvery.
func TestAdaptiveLogsLargeChanges(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"log_adaptive","key":"static","concurrency_adaptive":{"min":4,"max":100}}]}`)
	core, logs := observer.New(zapcore.InfoLevel)
	h.logger = zap.New(core)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		time.Sleep(time.Millisecond)
		return nil
	})
	// Four clients at once use the whole limit, without a queue: it
	// rises, from 4 to 6, then on.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for start := time.Now(); time.Since(start) < 8*adaptive.Interval; {
				req, rr := newRequest("192.0.2.1")
				if err := h.ServeHTTP(rr, req, next); err != nil && statusOf(err) != http.StatusServiceUnavailable {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if limit := h.Zones[0].adaptive.keyInfo(store.Key{Text: "static"}).Limit; limit < 9 {
		t.Fatalf("limit %d after rising twice, want at least 9", limit)
	}
	entries := logs.FilterMessage("adaptive concurrency limit changed").All()
	if len(entries) != 1 {
		t.Fatalf("%d lines, want 1: %v", len(entries), entries)
	}
	if f := entries[0].ContextMap(); f["zone"] != "log_adaptive" || f["previous"] != int64(4) || f["limit"] != int64(6) || f["key"] != nil {
		t.Errorf("fields %v, want zone log_adaptive, limit 6, previous 4, no key", f)
	}
}

// adminGet asks the admin API for path and decodes the JSON.
func adminGet(t *testing.T, method, path string) (map[string]any, error) {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).serve(rec, httptest.NewRequest(method, path, nil)); err != nil {
		return nil, err
	}
	var v map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
		t.Fatal(err)
	}
	return v, nil
}

// The admin API shows a zone's adaptive limit and each key's; a DELETE
// starts a key's learning again.
func TestAdaptiveAdmin(t *testing.T) {
	h := newTestHandler(t, `{"zones":[
		{"name":"admin_adaptive","key":"{http.request.header.X-Key}","concurrency_adaptive":{"min":3,"max":50}},
		{"name":"admin_adaptive_both","key":"{http.request.header.X-Key}","rate":"1r/m","burst":1000,"concurrency_adaptive":{}}]}`)
	// Requests of key a, without a queue, for a few of the controller's
	// intervals.
	for start := time.Now(); time.Since(start) < 4*adaptive.Interval; time.Sleep(2 * time.Millisecond) {
		req, rr := newRequest("192.0.2.1", "X-Key", "a")
		if err := h.ServeHTTP(rr, req, okHandler); err != nil {
			t.Fatal(err)
		}
	}
	sc := h.scratch.Get().(*scratch)
	req, rr := newRequest("192.0.2.1", "X-Key", "a")
	if out, err := h.decide(rr, req, sc); out != outcomeAllow || err != nil {
		t.Fatalf("%v %v", out, err)
	}
	got, err := adminGet(t, http.MethodGet, "/rate_limit/admin_adaptive/a")
	if err != nil {
		t.Fatal(err)
	}
	a, _ := got["concurrency_adaptive"].(map[string]any)
	if limit, _ := a["limit"].(float64); a["in_flight"] != 1.0 || limit < 3 || limit > 50 || a["no_load_latency"] == 0.0 {
		t.Errorf("key a: %v, want 1 in flight, a limit within 3-50 and a no-load latency", got)
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/admin_adaptive/b")
	if a, _ := got["concurrency_adaptive"].(map[string]any); a["limit"] != 3.0 || a["in_flight"] != 0.0 {
		t.Errorf("key b, never seen: %v, want the limit min (3), none in flight", got)
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/admin_adaptive_both/a")
	if a, _ := got["concurrency_adaptive"].(map[string]any); a["in_flight"] != 1.0 || got["tokens"] == nil {
		t.Errorf("key a of the zone with a rate too: %v, want 1 in flight and tokens", got)
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/admin_adaptive")
	zone, _ := got["concurrency_adaptive"].(map[string]any)
	requests, _ := got["requests"].(map[string]any)
	if zone["min"] != 3.0 || zone["max"] != 50.0 || zone["keys"] != 1.0 || zone["in_flight"] != 1.0 || requests["shed"] != 0.0 {
		t.Errorf("zone: %v, want min 3, max 50, 1 key, 1 in flight, none shed", got)
	}
	h.finish(req, sc)
	if _, err := adminGet(t, http.MethodDelete, "/rate_limit/admin_adaptive/a"); err != nil {
		t.Fatal(err)
	}
	got, _ = adminGet(t, http.MethodGet, "/rate_limit/admin_adaptive/a")
	if a, _ := got["concurrency_adaptive"].(map[string]any); a["limit"] != 3.0 || a["no_load_latency"] != 0.0 {
		t.Errorf("after DELETE: %v, want the limit min (3), nothing learnt", got)
	}
	if _, err := adminGet(t, http.MethodDelete, "/rate_limit/admin_adaptive/c"); err == nil {
		t.Error("DELETE of a key never seen: want 404")
	}
}

// Through a real Caddy: the 503 goes through handle_errors; metrics show
// the limit, the requests in flight and the latencies; a reload keeps
// what was learnt; and with the Redis store, Redis is never asked.
func TestAdaptiveThroughCaddy(t *testing.T) {
	r := startRedis(t)
	up, arrived, release := blockingUpstream(t)
	site := fmt.Sprintf(`http://localhost {
	rate_limit {
		zone caddy_adaptive {
			key static
			concurrency adaptive {
				min 2
				max %%d
			}
		}
		store redis {
			address %s
			timeout 5s
		}
	}
	reverse_proxy %s
	handle_errors {
		respond "shed by {http.rate_limit.exceeded.name}, retry in {http.rate_limit.exceeded.retry_after}s" {http.error.status_code}
	}
}
`, r.Addr(), strings.TrimPrefix(up.URL, "http://"))
	tester := startCaddy(t, opsGlobal, fmt.Sprintf(site, 2))
	// The zone's counters are kept across configs: count from here.
	shed := `caddy_rate_limit_requests_total{result="shed",zone="caddy_adaptive"}`
	latencies := `caddy_rate_limit_adaptive_latency_seconds_count{zone="caddy_adaptive"}`
	base := scrape(t, tester)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { get(t, tester, "/block", 200, "up") })
	}
	waitArrivals(t, arrived, 2)
	h := get(t, tester, "/", 503, "shed by caddy_adaptive, retry in 1s")
	if h.Get("Retry-After") != "1" {
		t.Errorf("Retry-After %q, want 1", h.Get("Retry-After"))
	}
	m := scrape(t, tester)
	wantMetric(t, m, `caddy_rate_limit_adaptive_in_flight{zone="caddy_adaptive"}`, 2)
	wantMetric(t, m, `caddy_rate_limit_adaptive_limit{zone="caddy_adaptive"}`, 2)
	wantMetric(t, m, shed, base[shed]+1)
	close(release)
	wg.Wait()
	// Requests for a few of the controller's intervals.
	n := 0
	for start := time.Now(); time.Since(start) < 4*adaptive.Interval; time.Sleep(5 * time.Millisecond) {
		get(t, tester, "/", 200, "up")
		n++
	}
	m = scrape(t, tester)
	wantMetric(t, m, latencies, base[latencies]+float64(2+n))
	wantMetric(t, m, `caddy_rate_limit_adaptive_in_flight{zone="caddy_adaptive"}`, 0)
	if m[`caddy_rate_limit_adaptive_no_load_latency_seconds{zone="caddy_adaptive"}`] <= 0 {
		t.Errorf("no-load latency not measured: %v", m)
	}
	// A reload with the same zone keeps its key and what it learnt.
	reload(t, tester, opsGlobal, fmt.Sprintf(site, 2))
	if m := scrape(t, tester); m[`caddy_rate_limit_adaptive_no_load_latency_seconds{zone="caddy_adaptive"}`] <= 0 {
		t.Errorf("no-load latency forgotten by a reload: %v", m)
	}
	c := newRedisClient(t, r.Addr())
	if n, err := c.DBSize(context.Background()).Result(); err != nil || n != 0 {
		t.Errorf("Redis holds %d keys (%v), want none", n, err)
	}
	if stats, _ := c.Info(context.Background(), "commandstats").Result(); strings.Contains(stats, "cmdstat_evalsha") || strings.Contains(stats, "cmdstat_eval:") {
		t.Errorf("the adaptive zone asked Redis: %s", stats)
	}
}

// Through a real Caddy, with priority: the lowest class is shed at its
// part of the limit while critical requests still get in, up to the
// whole limit; the sheds are exported by class, and a key's view shows
// each class's requests in flight.
func TestAdaptivePriorityThroughCaddy(t *testing.T) {
	up, arrived, release := blockingUpstream(t)
	tester := startCaddy(t, opsGlobal, fmt.Sprintf(`http://localhost {
	rate_limit {
		zone caddy_prio {
			key static
			concurrency adaptive {
				min 4
				max 4
				priority {header.X-Priority}
				reserve critical 25%%
			}
		}
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() { get(t, tester, "/block", 200, "up") })
	}
	waitArrivals(t, arrived, 3)
	get(t, tester, "/", 503, "")
	wg.Go(func() { get(t, tester, "/block", 200, "up", "X-Priority", "critical") })
	waitArrivals(t, arrived, 1)
	get(t, tester, "/", 503, "", "X-Priority", "critical")
	a, _ := adminKeyAt(t, adminAddr, "caddy_prio", "static")["concurrency_adaptive"].(map[string]any)
	if fmt.Sprint(a["classes"]) != "[map[class:critical in_flight:1] map[class:other in_flight:3]]" {
		t.Errorf("key: %v, want 1 of critical and 3 of other in flight", a)
	}
	m := scrape(t, tester)
	for class, want := range map[string]float64{"critical": 1, "other": 1} {
		wantMetric(t, m, `caddy_rate_limit_adaptive_shed_total{class="`+class+`",result="shed",zone="caddy_prio"}`, want)
		wantMetric(t, m, `caddy_rate_limit_adaptive_shed_total{class="`+class+`",result="dry_run_shed",zone="caddy_prio"}`, 0)
	}
	close(release)
	wg.Wait()
}

// workersUpstream is an upstream that works on at most workers requests
// at once, each for service, and queues the others, as bench/adaptive's
// does.
func workersUpstream(t *testing.T, workers int, service time.Duration) *httptest.Server {
	sem := make(chan struct{}, workers)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case sem <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		time.Sleep(service)
		<-sem
		io.WriteString(w, "up")
	}))
	t.Cleanup(up.Close)
	return up
}

// Through a real Caddy under a flood, the ordering that priority is for:
// 32 clients of the lowest class flood an upstream of 8 workers of 60ms
// (133 requests a second, which a loaded machine's clients still
// overload), beside 2 critical clients that each send a request 60ms after the last
// answer; with `reserve critical 25%`, the critical requests are shed far
// less than the flood's. The figures (the share shed, latency) depend on
// the machine and are measured by bench/adaptive; this asserts only the
// ordering, with a wide margin.
func TestAdaptivePriorityUnderFlood(t *testing.T) {
	up := workersUpstream(t, 8, 60*time.Millisecond)
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone flood_prio {
			key static
			concurrency adaptive {
				priority {header.X-Priority}
				reserve critical 25%%
			}
		}
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	t.Cleanup(client.CloseIdleConnections)
	start := time.Now()
	const warm, length = time.Second, 4 * time.Second
	// clients runs n closed-loop clients of class until length, each
	// pausing think after an answer (a millisecond after a refusal), and
	// counts the answers and the refusals after warm.
	clients := func(wg *sync.WaitGroup, n int, class string, think time.Duration, sent, shed *atomic.Int64) {
		for range n {
			wg.Go(func() {
				for time.Since(start) < length {
					req, _ := http.NewRequest(http.MethodGet, siteURL+"/", nil)
					req.Header.Set("X-Priority", class)
					at := time.Since(start)
					resp, err := client.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if at >= warm {
						sent.Add(1)
					}
					pause := think
					if resp.StatusCode == http.StatusServiceUnavailable {
						pause = time.Millisecond
						if at >= warm {
							shed.Add(1)
						}
					}
					time.Sleep(pause)
				}
			})
		}
	}
	var wg sync.WaitGroup
	var flood, floodShed, critical, criticalShed atomic.Int64
	clients(&wg, 32, "bulk", 0, &flood, &floodShed)
	clients(&wg, 2, "critical", 60*time.Millisecond, &critical, &criticalShed)
	wg.Wait()
	fs, cs := float64(floodShed.Load())/float64(flood.Load()), float64(criticalShed.Load())/float64(critical.Load())
	t.Logf("the flood: %d requests, %.1f%% shed; critical: %d requests, %.1f%% shed", flood.Load(), 100*fs, critical.Load(), 100*cs)
	// The flood must overload the upstream for the comparison to mean
	// anything. How much of it is shed depends on how fast a shed request
	// comes back, which a loaded machine slows (the clients retry a
	// millisecond after a refusal): a quarter shed is overload however
	// loaded the machine.
	if critical.Load() < 10 || fs < 0.25 {
		t.Fatalf("%d critical requests, the flood %.1f%% shed: want 10 at least, and the upstream overloaded (a quarter of the flood shed)", critical.Load(), 100*fs)
	}
	if cs > fs/4 {
		t.Errorf("critical requests %.1f%% shed, the flood %.1f%%: want critical shed at most a quarter as often", 100*cs, 100*fs)
	}
}

// BenchmarkServeHTTPAdaptive is the allowed path of a zone with an
// adaptive limit, beside a fixed concurrency and a rate alone, without
// headers (an adaptive limit sends none), and with priority classes (a
// request of the lowest class, whose header names none, and one of the
// highest): `benchstat -col /zone`.
func BenchmarkServeHTTPAdaptive(b *testing.B) {
	const prio = `"priority":"{http.request.header.X-Priority}","reserve":[{"class":"critical","percent":20},{"class":"interactive","percent":30}]`
	for _, tc := range []struct{ name, zone, class string }{
		{"zone=rate", `{"name":"bench-ad-rate","rate":"1000000000r/s"}`, ""},
		{"zone=concurrency", `{"name":"bench-ad-fixed","concurrency":1000000}`, ""},
		{"zone=adaptive", `{"name":"bench-ad-adaptive","concurrency_adaptive":{"min":1000000,"max":1000000}}`, ""},
		{"zone=rate+adaptive", `{"name":"bench-ad-both","rate":"1000000000r/s","concurrency_adaptive":{"min":1000000,"max":1000000}}`, ""},
		{"zone=adaptive+priority/class=other", `{"name":"bench-ad-prio","concurrency_adaptive":{"min":1000000,"max":1000000,` + prio + `}}`, "bulk"},
		{"zone=adaptive+priority/class=critical", `{"name":"bench-ad-prio","concurrency_adaptive":{"min":1000000,"max":1000000,` + prio + `}}`, "critical"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"headers":"off","zones":[`+tc.zone+`]}`)
			h.logger = zap.NewNop()
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			})
			var header []string
			if tc.class != "" {
				header = []string{"X-Priority", tc.class}
			}
			req, _ := newRequest("192.0.2.1", header...)
			w := &headerSink{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				if err := h.ServeHTTP(w, req, next); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Through a real Caddy and reverse_proxy, as a user saw it: an upstream
// without a queue turns uniformly slower, from 10ms to 500ms a request,
// under 20 clients that wait 200ms between requests. Probes 50 latencies
// apart took the no-load latency about 30s to follow, while the limit
// fell to min+1. Here it follows within 12s in simulation
// (TestAdaptiveUpstreamSlowsUniformly); this machine's own delays get a
// few seconds more, still well short of those 30s, and the limit stays
// above twice min meanwhile.
func TestAdaptiveUpstreamSlowsThroughCaddy(t *testing.T) {
	var delay atomic.Int64
	delay.Store(int64(10 * time.Millisecond))
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(delay.Load()))
		io.WriteString(w, "up")
	}))
	t.Cleanup(up.Close)
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone slows {
			key static
			concurrency adaptive {
				min 4
				max 100
			}
		}
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	t.Cleanup(client.CloseIdleConnections)
	clients := func(n int, think time.Duration, stop <-chan struct{}) *sync.WaitGroup {
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if resp, err := client.Get(siteURL + "/"); err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
					time.Sleep(think)
				}
			})
		}
		return &wg
	}
	state := func() (limit, noLoad float64) {
		a, _ := adminKeyAt(t, adminAddr, "slows", "static")["concurrency_adaptive"].(map[string]any)
		limit, _ = a["limit"].(float64)
		noLoad, _ = a["no_load_latency"].(float64)
		return limit, noLoad
	}

	stop := make(chan struct{})
	fast := clients(16, 0, stop)
	time.Sleep(3 * time.Second)
	close(stop)
	fast.Wait()
	before, noLoad := state()
	if noLoad <= 0 || noLoad > 0.1 {
		t.Fatalf("no-load latency %vs at 10ms a request, want it measured", noLoad)
	}

	delay.Store(int64(500 * time.Millisecond))
	stop = make(chan struct{})
	defer close(stop)
	clients(20, 200*time.Millisecond, stop)
	changed, least := time.Now(), before
	for {
		limit, noLoad := state()
		least = min(least, limit)
		if noLoad >= 0.4 {
			break
		}
		if time.Since(changed) > 20*time.Second {
			t.Fatalf("no-load latency %vs 20s after the upstream went from 10ms to 500ms, want it to follow; limit %v, down to %v", noLoad, limit, least)
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("no-load latency followed in %v; limit %v before, down to %v meanwhile", time.Since(changed).Round(100*time.Millisecond), before, least)
	if least < 8 {
		t.Errorf("the limit fell to %v while the no-load latency followed, want at least 8 (twice min)", least)
	}
}
