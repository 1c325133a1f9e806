// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// llmUpstream is an OpenAI-compatible upstream for the tests: the query
// says how many tokens a response used and how it says so. /json answers
// a chat completion; /header puts the usage in a header, /trailer in a
// trailer, /both in a trailer and the header's value in the header; /sse streams 40 chunks, then the usage chunk unless
// usage=none, and cuts the connection off after 10 chunks with cut=1.
// With bom=1, /sse starts with a byte order mark and its usage chunk.
// With hold=1, /json and
// /sse flush their usage and hold the rest of the
// response (nothing, or [DONE]) until the client has gone.
// first, when set, receives once the first chunk of a stream has gone
// out; the stream goes on when go is closed. Every response says what
// the upstream received of the request's body: X-Body-Sha256, the hex
// SHA-256 of its bytes, and X-Body-Length.
type llmUpstream struct {
	*httptest.Server
	first  chan struct{}
	resume chan struct{}
	held   atomic.Int64 // streams that sent their first chunk
}

func startLLMUpstream(t *testing.T) *llmUpstream {
	u := &llmUpstream{first: make(chan struct{}, 16), resume: make(chan struct{})}
	close(u.resume)
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

func (u *llmUpstream) serve(w http.ResponseWriter, r *http.Request) {
	digest := sha256.New()
	n, _ := io.Copy(digest, r.Body)
	w.Header().Set("X-Body-Sha256", hex.EncodeToString(digest.Sum(nil)))
	w.Header().Set("X-Body-Length", strconv.FormatInt(n, 10))
	tokens := r.URL.Query().Get("tokens")
	switch r.URL.Path {
	case "/json":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":1,"total_tokens":%s}}`, tokens)
		holdUntilGone(w, r)
	case "/header":
		w.Header().Set("X-Usage-Tokens", tokens)
		fmt.Fprint(w, "ok")
	case "/trailer":
		w.Header().Set("Trailer", "X-Usage-Tokens")
		fmt.Fprint(w, "ok")
		w.Header().Set("X-Usage-Tokens", tokens)
	case "/both":
		w.Header().Set("Trailer", "X-Usage-Tokens")
		w.Header().Set("X-Usage-Tokens", r.URL.Query().Get("header"))
		fmt.Fprint(w, "ok")
		w.Header().Set("X-Usage-Tokens", tokens)
	case "/sse":
		u.stream(w, r, tokens)
	}
}

func (u *llmUpstream) stream(w http.ResponseWriter, r *http.Request, tokens string) {
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	usage := fmt.Sprintf("data: {\"choices\":[],\"usage\":{\"total_tokens\":%s}}\n\n", tokens)
	if r.URL.Query().Get("bom") == "1" {
		fmt.Fprint(w, "\xEF\xBB\xBF"+usage)
		usage = ""
	}
	for i := range 40 {
		fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}],\"usage\":null}\n\n", i)
		_ = rc.Flush()
		if i == 0 {
			u.held.Add(1)
			select {
			case u.first <- struct{}{}:
			default:
			}
			<-u.resume
		}
		if i == 10 && r.URL.Query().Get("cut") == "1" {
			conn, _, _ := rc.Hijack()
			conn.Close()
			return
		}
	}
	if r.URL.Query().Get("usage") != "none" {
		fmt.Fprint(w, usage)
	}
	holdUntilGone(w, r)
	fmt.Fprint(w, "data: [DONE]\n\n")
}

// holdUntilGone, with hold=1, flushes what w has and waits until the
// client of r has gone (for at most 10 s).
func holdUntilGone(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("hold") != "1" {
		return
	}
	_ = http.NewResponseController(w).Flush()
	select {
	case <-r.Context().Done():
	case <-time.After(10 * time.Second):
	}
}

// usageSites is a site that limits an OpenAI-compatible upstream by the
// tokens each client's requests used, on store.
func usageSites(upstream, storeCfg string) string {
	return usageSitesAt("100/m", upstream, storeCfg)
}

// usageSitesAt is usageSites with the zone llm's rate.
func usageSitesAt(rate, upstream, storeCfg string) string {
	return fmt.Sprintf(`http://localhost {
	rate_limit {
		zone llm {
			key {http.request.header.Authorization}
			match not path /header /trailer
			rate %s
			burst 100
			usage json usage.total_tokens
		}
		zone llm-header {
			key {http.request.header.Authorization}
			match path /header /trailer
			rate 100/m
			burst 100
			usage header X-Usage-Tokens
		}
		%s
	}
	reverse_proxy %s {
		flush_interval -1
	}
}
`, rate, storeCfg, strings.TrimPrefix(upstream, "http://"))
}

// llmGet sends a request of key to path and returns its status, its
// headers and its body.
func llmGet(t *testing.T, key, path string) (int, http.Header, string) {
	t.Helper()
	return llmGetAt(t, siteURL, path, "Authorization", key)
}

// llmGetAt is llmGet of the site at base, with the request header
// name/value pairs.
func llmGetAt(t *testing.T, base, path string, header ...string) (int, http.Header, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, base+path, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err.Error()
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, resp.Header, "read: " + err.Error()
	}
	return resp.StatusCode, resp.Header, string(body)
}

// remainingOf is what the zone's RateLimit item says is left.
func remainingOf(t *testing.T, h http.Header, zone string) int {
	t.Helper()
	for _, item := range strings.Split(h.Get("RateLimit"), ",") {
		if name, params, ok := strings.Cut(strings.TrimSpace(item), ";"); ok && name == `"`+zone+`"` {
			for _, p := range strings.Split(params, ";") {
				if v, ok := strings.CutPrefix(p, "r="); ok {
					n, _ := strconv.Atoi(v)
					return n
				}
			}
		}
	}
	t.Fatalf("no RateLimit item for zone %s in %q", zone, h.Get("RateLimit"))
	return 0
}

// Through a real Caddy and reverse_proxy, on the local store and on
// Redis: the docs' example (60 tokens, then 50, leave the bucket 10 in
// debt, and the next request waits for 11 tokens: Retry-After 7), a
// usage in a header and in a trailer, a stream's usage chunk, a stream
// without one and a stream cut off, which keep their reservation.
func TestUsageThroughCaddy(t *testing.T) {
	r := startRedis(t)
	up := startLLMUpstream(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n\t\t\taddress " + r.Addr() + "\n\t\t\tkey_prefix usage:\n\t\t\ttimeout 5s\n\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tester := startCaddy(t, "", usageSites(up.URL, tc.store))
			base := scrape(t, tester)
			code, h, body := llmGet(t, "k1", "/json?tokens=60")
			if code != 200 || !strings.Contains(body, `"total_tokens":60`) || remainingOf(t, h, "llm") != 99 {
				t.Fatalf("first: %d, %q, RateLimit %q", code, body, h.Get("RateLimit"))
			}
			// The headers tell the admission; the next response tells
			// the first's usage.
			if code, h, _ := llmGet(t, "k1", "/json?tokens=50"); code != 200 || remainingOf(t, h, "llm") != 39 {
				t.Fatalf("second: %d, RateLimit %q; want 39 left", code, h.Get("RateLimit"))
			}
			code, h, _ = llmGet(t, "k1", "/json?tokens=1")
			if retry := h.Get("Retry-After"); code != 429 || retry != "7" {
				t.Fatalf("in debt: %d, Retry-After %q; want 429 and 7 (11 tokens at 100/m)", code, retry)
			}
			if tc.name == "redis" {
				// Another instance sharing the Redis sees the debt.
				other := newTestHandler(t, `{"zones":[{"name":"llm","key":"{http.request.header.Authorization}","rate":"100/m","burst":100,
					"usage":{"json":"usage.total_tokens"},"match":[{"not":[{"path":["/header","/trailer"]}]}]}],
					"store":{"backend":"redis","addresses":["`+r.Addr()+`"],"key_prefix":"usage:","timeout":"5s"}}`)
				req, rr := newRequest("192.0.2.1", "Authorization", "k1")
				if err := other.ServeHTTP(rr, req, okHandler); statusOf(err) != 429 || rr.Header().Get("Retry-After") != "7" {
					t.Fatalf("the other instance: %v, Retry-After %q; want 429 and 7", err, rr.Header().Get("Retry-After"))
				}
			}
			adminKeyInfo(t, "llm", "k1", func(info map[string]any) {
				if tok := info["tokens"].(float64); tok > -9.9 || tok < -10 {
					t.Fatalf("admin: tokens %v, want about -10", tok)
				}
			})

			for _, tc := range []struct {
				path string
				left int // after the response was settled
			}{
				{"/header?tokens=30", 70},
				{"/trailer?tokens=20", 80},
				{"/sse?tokens=45", 55},
				{"/sse?tokens=45&usage=none", 99}, // the reservation stands
				{"/sse?tokens=45&cut=1", 99},
			} {
				key := "k-" + tc.path
				code, _, body := llmGet(t, key, tc.path)
				if code != 200 {
					t.Fatalf("%s: %d %q", tc.path, code, body)
				}
				zone, next := "llm", "/json?tokens=1"
				if !strings.HasPrefix(tc.path, "/sse") {
					zone, next = "llm-header", "/header?tokens=1"
				}
				if _, h, _ := llmGet(t, key, next); remainingOf(t, h, zone) != tc.left-1 {
					t.Fatalf("%s: then %d left in %s, want %d", tc.path, remainingOf(t, h, zone), zone, tc.left-1)
				}
			}
			// What each zone was charged, and the responses without usage:
			// the stream without its usage chunk and the one cut off.
			// The last settlement may still be on its way when the
			// client has read its response.
			var m map[string]float64
			for range 100 {
				if m = scrape(t, tester); m[`caddy_rate_limit_usage_total{limit="100/m burst 100",zone="llm"}`] == base[`caddy_rate_limit_usage_total{limit="100/m burst 100",zone="llm"}`]+158 {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			for _, want := range []struct {
				series string
				n      float64
			}{
				{`caddy_rate_limit_usage_total{limit="100/m burst 100",zone="llm"}`, 60 + 50 + 45 + 3},
				{`caddy_rate_limit_usage_total{limit="100/m burst 100",zone="llm-header"}`, 30 + 20 + 2},
				{`caddy_rate_limit_usage_missing_total{limit="100/m burst 100",zone="llm"}`, 2},
				{`caddy_rate_limit_usage_missing_total{limit="100/m burst 100",zone="llm-header"}`, 0},
			} {
				wantMetric(t, m, want.series, base[want.series]+want.n)
			}
		})
	}
}

// A client that has read the usage and leaves before the response ends,
// through Caddy and reverse_proxy, is charged that usage: a stream's
// usage chunk, before [DONE]; a JSON text that has ended, while the
// upstream holds the response open.
func TestUsageCutAfterUsage(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "", usageSites(up.URL, ""))
	for _, tc := range []struct{ path, last string }{
		{"/sse?tokens=60&hold=1", "\"total_tokens\":60}}\n\n"},
		{"/json?tokens=60&hold=1", "\"total_tokens\":60}}"},
	} {
		key := "cut-" + tc.path
		req, _ := http.NewRequest(http.MethodGet, siteURL+tc.path, nil)
		req.Header.Set("Authorization", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var read []byte
		for buf := make([]byte, 4096); !strings.HasSuffix(string(read), tc.last); {
			n, err := resp.Body.Read(buf)
			if read = append(read, buf[:n]...); err != nil {
				t.Fatalf("%s: %q, %v before the usage", tc.path, read, err)
			}
		}
		// The client leaves, the response not ended: Caddy settles once
		// it sees the client gone.
		resp.Body.Close()
		settledTo(t, "llm", key, 100-60)
	}
}

// settledTo waits until the bucket of key in zone, at the test Caddy,
// holds want tokens, give or take one refilled, for at most 5 s: the
// client may have its response before Caddy has settled it.
func settledTo(t *testing.T, zone, key string, want float64) {
	t.Helper()
	tokens := func() float64 { v, _ := adminKeyAt(t, adminAddr, zone, key)["tokens"].(float64); return v }
	eventually(5*time.Second, func() bool { return tokens() < want+1 })
	if got := tokens(); got < want || got >= want+1 {
		t.Fatalf("%s: %v tokens left in %s, want %v", key, got, zone, want)
	}
}

// Usages of odd numbers and bodies, through Caddy and reverse_proxy: a
// number too big is the largest usage, which takes the bucket to its
// max_debt (the burst, 100); a long fraction rounds up; a body that turns
// out not to be JSON, and a header that is not a number, have no usage;
// a stream that starts with a byte order mark has its usage read.
func TestUsageEdgeCasesThroughCaddy(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "", usageSites(up.URL, ""))
	for _, tc := range []struct {
		path, zone string
		left       float64
	}{
		{"/json?tokens=1e400", "llm", -100},
		{"/json?tokens=99999999999999999999999", "llm", -100},
		{"/json?tokens=1.0000000000000000000000000001", "llm", 98},
		{"/json?tokens=0x10", "llm", 99},
		{"/json?tokens=30},x", "llm", 99},
		{"/header?tokens=Inf", "llm-header", 99},
		{"/sse?tokens=45&bom=1", "llm", 55},
	} {
		key := "n-" + tc.path
		if code, _, body := llmGet(t, key, tc.path); code != 200 {
			t.Fatalf("%s: %d %q", tc.path, code, body)
		}
		settledTo(t, tc.zone, key, tc.left)
	}
}

// usage header through Caddy and reverse_proxy: a header the site hides
// from clients with the header directive is read all the same, and a
// trailer wins over the header, whether the header is hidden or not.
func TestUsageHeaderHiddenAndTrailer(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "", fmt.Sprintf(`http://localhost {
	@hide query hide=1
	header @hide -X-Usage-Tokens
	rate_limit {
		zone llm-header {
			key {http.request.header.Authorization}
			rate 100/m
			burst 100
			usage header X-Usage-Tokens
		}
	}
	reverse_proxy %s {
		flush_interval -1
	}
}
`, strings.TrimPrefix(up.URL, "http://")))
	for _, tc := range []struct {
		path   string
		header string // what the client sees
		used   float64
	}{
		{"/header?tokens=30&hide=1", "", 30},
		{"/both?header=5&tokens=40", "5", 40},
		{"/both?header=5&tokens=40&hide=1", "", 40},
	} {
		key := "h-" + tc.path
		code, h, body := llmGet(t, key, tc.path)
		if code != 200 || h.Get("X-Usage-Tokens") != tc.header {
			t.Fatalf("%s: %d %q, X-Usage-Tokens %q; want 200 and %q", tc.path, code, body, h.Get("X-Usage-Tokens"), tc.header)
		}
		settledTo(t, "llm-header", key, 100-tc.used)
	}
}

// adminKeyInfo reads a key of a zone from the admin API, and passes what it
// says of the first zone of that name to check.
func adminKeyInfo(t *testing.T, zone, key string, check func(map[string]any)) {
	t.Helper()
	check(adminKeyAt(t, adminAddr, zone, key))
}

// adminKeyAt is what the admin API at admin says of a key of the first
// zone of that name.
func adminKeyAt(t *testing.T, admin, zone, key string) map[string]any {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/rate_limit/" + zone + "/" + url.PathEscape(key))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var infos []map[string]any
	body, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(body, &infos); err != nil || len(infos) == 0 {
		var one map[string]any
		if err := json.Unmarshal(body, &one); err != nil {
			t.Fatalf("admin GET %s/%s: %d %s", zone, key, resp.StatusCode, body)
		}
		infos = []map[string]any{one}
	}
	return infos[0]
}

// usage goes with neither ban nor delay, and says where to read the
// usage: refused at adapt, with the line.
func TestUsageCaddyfileErrors(t *testing.T) {
	zone := func(lines string) string {
		return "rate_limit {\n\tzone llm {\n\t\tkey {http.request.header.Authorization}\n\t\trate 100/m\n" + lines + "\t}\n}"
	}
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"with ban", zone("\t\tusage json usage.total_tokens\n\t\tban 1m\n"), "usage cannot go with ban", 7},
		{"with delay", zone("\t\tusage json usage.total_tokens\n\t\tdelay 1s\n"), "usage cannot go with delay", 7},
		{"no place", zone("\t\tusage json\n"), "usage needs where to read it: usage json <path> or usage header <field>", 5},
		{"unknown place", zone("\t\tusage body total\n"), "invalid usage 'body': expected json <path> or header <field>", 5},
		{"empty key", zone("\t\tusage json usage..total\n"), "invalid usage json path 'usage..total'", 5},
		{"bad header", zone("\t\tusage header X:Y\n"), "invalid usage header 'X:Y'", 5},
		{"max_debt alone", zone("\t\tmax_debt 10\n"), "max_debt needs usage", 6},
		{"max_debt negative", zone("\t\tusage header X-Tokens\n\t\tmax_debt -1\n"), "invalid max_debt -1", 7},
		{"max_debt not a number", zone("\t\tusage header X-Tokens\n\t\tmax_debt lots\n"), "invalid max_debt 'lots': expected a whole number", 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.HasSuffix(err.Error(), fmt.Sprintf(", at Testfile:%d", tc.line)) {
				t.Fatalf("error %v, want %q at Testfile:%d", err, tc.wantErr, tc.line)
			}
		})
	}
	for _, tc := range []struct{ json, wantErr string }{
		{`{"zones":[{"name":"a","rate":"1r/s","usage":{"json":"a","header":"B"}}]}`, "usage needs one of json <path> or header <field>"},
		{`{"zones":[{"name":"a","rate":"1r/s","usage":{}}]}`, "usage needs one of json <path> or header <field>"},
		{`{"zones":[{"name":"a","concurrency":2,"usage":{"json":"a"}}]}`, "usage needs a rate or a quota"},
		{`{"zones":[{"name":"a","quota":10,"quota_period":"day","usage":{"json":"a"},"max_debt":5}]}`, "max_debt needs a rate"},
		{`{"zones":[{"name":"a","rate":"1r/h","burst":10,"usage":{"json":"a"},"max_debt":900000}]}`, "the burst and the debt must refill within 100 years"},
	} {
		checkValidate(t, tc.json, tc.wantErr)
	}
}

// A stream reaches the client as the upstream sends it: the client reads
// the first chunk while the upstream still holds the rest back.
func TestUsageStreamsUnbuffered(t *testing.T) {
	up := startLLMUpstream(t)
	up.resume = make(chan struct{})
	startCaddy(t, "", usageSites(up.URL, ""))
	req, _ := http.NewRequest(http.MethodGet, siteURL+"/sse?tokens=7", nil)
	req.Header.Set("Authorization", "stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, `"t0"`) {
		t.Fatalf("first chunk: %q, %v", line, err)
	}
	close(up.resume) // the client had the first chunk before the rest was sent
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	if _, h, _ := llmGet(t, "stream", "/json?tokens=1"); remainingOf(t, h, "llm") != 100-7-1 {
		t.Fatalf("after the stream: RateLimit %q, want %d left", h.Get("RateLimit"), 100-7-1)
	}
}

// The reservation holds parallel requests to the burst: 200 requests of
// one fresh key at once, with burst 100 and an upstream that answers none
// until all have been decided, admit exactly 100; with Redis, through two
// instances sharing it, what one charged the other sees.
func TestUsageReservation(t *testing.T) {
	r := startRedis(t)
	up := startLLMUpstream(t)
	up.resume = make(chan struct{})
	storeCfg := "store redis {\n\t\t\taddress " + r.Addr() + "\n\t\t\tkey_prefix resv:\n\t\t\ttimeout 5s\n\t\t}"
	// 100/h: no token comes back while the requests are decided.
	startCaddy(t, "", usageSitesAt("100/h", up.URL, storeCfg))
	other := newTestHandler(t, `{"zones":[{"name":"llm","key":"{http.request.header.Authorization}","rate":"100/h","burst":100,
		"usage":{"json":"usage.total_tokens"}}],"store":{"backend":"redis","addresses":["`+r.Addr()+`"],"key_prefix":"resv:","timeout":"5s"}}`)

	c := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 200, MaxIdleConnsPerHost: 200}}
	defer c.CloseIdleConnections()
	codes := make(chan int, 200)
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, siteURL+"/sse?tokens=1", nil)
			req.Header.Set("Authorization", "parallel")
			resp, err := c.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	// Every request is decided before any is answered: the admitted
	// ones wait in the upstream, the others have their 429.
	deadline := time.Now().Add(10 * time.Second)
	for len(codes)+int(up.held.Load()) < 200 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(up.resume)
	wg.Wait()
	close(codes)
	n := map[int]int{}
	for code := range codes {
		n[code]++
	}
	if n[200] != 100 || n[429] != 100 {
		t.Fatalf("200 parallel requests: %v, want 100 × 200 and 100 × 429", n)
	}
	// Each used 1 token, its reservation: the other instance finds the
	// bucket empty.
	req, rr := newRequest("192.0.2.1", "Authorization", "parallel")
	if err := other.ServeHTTP(rr, req, okHandler); statusOf(err) != 429 {
		t.Fatalf("the other instance: %v, want 429", err)
	}
}

// usage with count: a response that count does not charge is not settled
// either, it gives its cost back; in dry run, responses are settled as
// when enforced, and nothing is refused.
func TestUsageWithCountAndDryRun(t *testing.T) {
	h := newTestHandler(t, `{"zones":[
		{"name":"usage-count","key":"{http.request.header.X-Key}","rate":"1r/h","burst":100,"usage":{"header":"X-Used"},"count":{"status_code":[200]}},
		{"name":"usage-dry","key":"{http.request.header.X-Key}","rate":"1r/h","burst":10,"usage":{"header":"X-Used"},"dry_run":true}]}`)
	respond := func(status int, used string) caddyhttp.HandlerFunc {
		return func(w http.ResponseWriter, _ *http.Request) error {
			w.Header().Set("X-Used", used)
			w.WriteHeader(status)
			return nil
		}
	}
	left := func(zone string) int {
		t.Helper()
		d := &store.Demands{Buckets: []store.BucketDemand{}}
		for _, z := range h.Zones {
			if z.Name == zone {
				d.Buckets = append(d.Buckets, bucketReq(z, store.Key{Text: "k"}))
			}
		}
		if err := h.store.Peek(context.Background(), time.Now(), d); err != nil {
			t.Fatal(err)
		}
		return int(d.Buckets[0].Remaining())
	}
	for i, step := range []struct {
		status        int
		used          string
		count, dryRun int // tokens left after the response
	}{
		{500, "50", 100, 0}, // count does not charge a 500; the dry-run zone is charged 50, to its most debt, and then refuses nothing
		{200, "30", 70, 0},
		{200, "x", 69, 0}, // no usage: the cost stands
	} {
		req, rr := newRequest("192.0.2.2", "X-Key", "k")
		if err := h.ServeHTTP(rr, req, respond(step.status, step.used)); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if got := left("usage-count"); got != step.count {
			t.Fatalf("step %d: usage-count has %d left, want %d", i, got, step.count)
		}
		if got := left("usage-dry"); got != step.dryRun {
			t.Fatalf("step %d: usage-dry has %d left, want %d", i, got, step.dryRun)
		}
	}
}

// usageBodies are an OpenAI chat completion of 4 KB, and a stream of 40
// chunks with its usage chunk: the responses of BenchmarkUsage.
func usageBodies() (jsonBody []byte, events [][]byte) {
	content := strings.Repeat("All work and no play makes Jack a dull boy. ", 90)
	jsonBody = fmt.Appendf(nil, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",`+
		`"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],`+
		`"usage":{"prompt_tokens":12,"completion_tokens":900,"total_tokens":912}}`, content)
	for i := range 40 {
		events = append(events, fmt.Appendf(nil, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"token %d "}}],"usage":null}`+"\n\n", i))
	}
	events = append(events, []byte(`data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}}`+"\n\n"), []byte("data: [DONE]\n\n"))
	return jsonBody, events
}

// BenchmarkUsage is the allowed path of a zone with usage, the response
// read and its usage settled, beside the same zone without usage:
// `benchstat -col /usage`.
func BenchmarkUsage(b *testing.B) {
	jsonBody, events := usageBodies()
	for _, body := range []struct {
		name, ct string
		pieces   [][]byte
	}{
		{"json-4KB", "application/json", [][]byte{jsonBody}},
		{"stream-42-events", "text/event-stream", events},
	} {
		for _, usage := range []string{"none", "json"} {
			b.Run("body="+body.name+"/usage="+usage, func(b *testing.B) {
				zone := `{"name":"bench-usage-` + usage + `","rate":"1000000000r/s","burst":1000000000`
				if usage == "json" {
					zone += `,"usage":{"json":"usage.total_tokens"}`
				}
				h := newTestHandler(b, `{"zones":[`+zone+`}]}`)
				next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
					w.Header().Set("Content-Type", body.ct)
					w.WriteHeader(http.StatusOK)
					for _, p := range body.pieces {
						if _, err := w.Write(p); err != nil {
							return err
						}
					}
					return nil
				})
				req, _ := newRequest("192.0.2.1")
				w := &headerSink{h: make(http.Header)}
				b.ReportAllocs()
				for b.Loop() {
					clear(w.h)
					_ = h.ServeHTTP(w, req, next)
				}
			})
		}
	}
}

// A handler that copies its body with io.Copy (the writer's ReadFrom)
// has its usage read all the same.
func TestUsageReadFrom(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"usage-readfrom","rate":"1r/h","burst":100,"usage":{"json":"usage.total_tokens"}}]}`)
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		_, err := io.Copy(w, strings.NewReader(`{"usage":{"total_tokens":25}}`))
		return err
	})
	req, rr := newRequest("192.0.2.3")
	if err := h.ServeHTTP(rr, req, next); err != nil || rr.Body.String() != `{"usage":{"total_tokens":25}}` {
		t.Fatalf("%v, %q", err, rr.Body.String())
	}
	if _, hdr := serve(h, "192.0.2.3"); !strings.Contains(hdr.Get("RateLimit"), ";r=74;") {
		t.Fatalf("RateLimit %q, want 74 left: 25 tokens used, then 1", hdr.Get("RateLimit"))
	}
}

// With encode in the site, rate_limit ordered after it reads the usage
// before encode compresses the response for the client.
func TestUsageWithEncode(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "\torder rate_limit after encode\n", fmt.Sprintf(`http://localhost {
	encode {
		gzip
		minimum_length 1
	}
	rate_limit {
		zone llm-gzip {
			key {http.request.header.Authorization}
			rate 100/h
			burst 100
			usage json usage.total_tokens
		}
	}
	reverse_proxy %s {
		header_up -Accept-Encoding
	}
}
`, strings.TrimPrefix(up.URL, "http://")))
	get := func() http.Header {
		req, _ := http.NewRequest(http.MethodGet, siteURL+"/json?tokens=40", nil)
		req.Header.Set("Authorization", "gz")
		req.Header.Set("Accept-Encoding", "gzip")
		resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.Header.Get("Content-Encoding") != "gzip" {
			t.Fatalf("Content-Encoding %q, want gzip", resp.Header.Get("Content-Encoding"))
		}
		return resp.Header
	}
	get()
	if h := get(); remainingOf(t, h, "llm-gzip") != 100-40-1 {
		t.Fatalf("RateLimit %q, want %d left", h.Get("RateLimit"), 100-40-1)
	}
}

// usageKey follows one key's bucket in a zone of rate 100/m and burst
// 100 through real Caddy instances: what each response's RateLimit field
// says is left, and the Retry-After of a refusal, against the tokens the
// key's earlier responses used, give or take the tokens refilled since
// its first request was decided.
type usageKey struct {
	t            *testing.T
	key, zone    string
	born, bornBy time.Time // the key's first request was sent, answered
	spent        float64   // the tokens its settled requests were charged
}

const usageTokenTime = 600 * time.Millisecond // 100/m

// refill bounds the tokens the bucket got back from its first request's
// decision to that of a request sent at sent and answered at answered.
func (k *usageKey) refill(sent, answered time.Time) (lo, hi float64) {
	return max(0, sent.Sub(k.bornBy).Seconds()/usageTokenTime.Seconds()), answered.Sub(k.born).Seconds() / usageTokenTime.Seconds()
}

// allowed sends a request of the key to path through c: it must be
// allowed with 100 - spent - 1 tokens left (its reservation taken). Its
// response used used tokens (1, the reservation, for one without usage):
// allowed waits until c's store has settled them.
func (k *usageKey) allowed(c *faultCaddy, path string, used float64) {
	k.t.Helper()
	sent := time.Now()
	code, h, body := llmGetAt(k.t, c.url, path, "Authorization", k.key)
	answered := time.Now()
	if k.born.IsZero() {
		k.born, k.bornBy = sent, answered
	}
	if code != http.StatusOK {
		k.t.Fatalf("%s through %s: %d %q, RateLimit %q", path, c.url, code, body, h.Get("RateLimit"))
	}
	lo, hi := k.refill(sent, answered)
	left := 100 - k.spent - 1
	if got := float64(remainingOf(k.t, h, k.zone)); got < math.Floor(left+lo) || got > math.Floor(left+hi) {
		k.t.Fatalf("%s through %s: %v left, want %v (%v tokens used before, and this request's 1, refilled %.2f to %.2f)",
			path, c.url, got, math.Floor(left+lo), k.spent, lo, hi)
	}
	k.spent += used
	if used == 1 {
		return
	}
	// The client may have the whole response before the instance has
	// settled it: wait until its store has the usage, for at most 5 s
	// (the next request tells if it never does).
	eventually(5*time.Second, func() bool {
		tokens, _ := adminKeyAt(k.t, c.admin, k.zone, k.key)["tokens"].(float64)
		_, hi := k.refill(time.Now(), time.Now())
		return tokens < 100-k.spent+hi+0.5
	})
}

// eventually waits until cond holds, for at most d, and reports whether
// it did: for a condition that the checks after it tell the failure of.
func eventually(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// refused sends a request of the key through c: it must be refused, with
// the Retry-After of the tokens the bucket owes and the request's one.
func (k *usageKey) refused(c *faultCaddy, path string) {
	k.t.Helper()
	sent := time.Now()
	code, h, body := llmGetAt(k.t, c.url, path, "Authorization", k.key)
	lo, hi := k.refill(sent, time.Now())
	tokens := k.spent - 100 + 1 // owed, and the request's
	shortest, longest := math.Ceil((tokens-hi)*usageTokenTime.Seconds()), math.Ceil((tokens-lo)*usageTokenTime.Seconds())
	retry, _ := strconv.ParseFloat(h.Get("Retry-After"), 64)
	if code != http.StatusTooManyRequests || retry < shortest || retry > longest {
		k.t.Fatalf("%s through %s: %d %q, Retry-After %q; want 429 and %v to %v s, the time of %v tokens less %.2f to %.2f refilled",
			path, c.url, code, body, h.Get("Retry-After"), shortest, longest, tokens, lo, hi)
	}
}

// Two Caddy processes, built from ./cmd/caddy, sharing one Redis: each
// instance settles in the one bucket of a key, and the other sees it.
// 60 tokens through A, 30 through B and a stream of 45 through A leave
// the bucket owing 35 tokens, and B refuses with the Retry-After of 36;
// header and trailer usages add up alike; streams without usage and cut
// off keep their reservation on either instance. Before those, 200
// parallel requests for one fresh key with burst 100, split over both
// instances, against an upstream that answers none until all have been
// decided, admit exactly 100.
func TestUsageAcrossInstances(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	bin, _ := buildCaddy(t)
	r := startRedis(t)
	up := startLLMUpstream(t)
	up.resume = make(chan struct{}) // held until the parallel requests are decided
	site := fmt.Sprintf(`	rate_limit {
		zone llm {
			key {http.request.header.Authorization}
			match not path /header /trailer
			rate 100/m
			burst 100
			usage json usage.total_tokens
		}
		zone llm-header {
			key {http.request.header.Authorization}
			match path /header /trailer
			rate 100/m
			burst 100
			usage header X-Usage-Tokens
		}
		# 100/h: no token comes back while the parallel requests are decided.
		zone llm-parallel {
			key {http.request.header.Authorization}
			match header X-Parallel 1
			rate 100/h
			burst 100
			usage json usage.total_tokens
		}
		store redis {
			address %s
			key_prefix across:
			timeout 5s
		}
	}
	reverse_proxy %s {
		flush_interval -1
	}`, r.Addr(), strings.TrimPrefix(up.URL, "http://"))
	a, b := startCaddyProcess(t, bin, site), startCaddyProcess(t, bin, site)

	t.Run("parallel", func(t *testing.T) {
		tr := &http.Transport{MaxConnsPerHost: 200, MaxIdleConnsPerHost: 200}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		codes := make(chan int, 200)
		var wg sync.WaitGroup
		for i := range 200 {
			wg.Go(func() {
				rep := send(c, []*faultCaddy{a, b}[i%2].url+"/sse?tokens=1", "Authorization", "parallel", "X-Parallel", "1")
				if rep.err != nil {
					t.Error(rep.err)
					return
				}
				codes <- rep.status
			})
		}
		// Every request is decided before any is answered: the admitted
		// ones wait in the upstream, the others have their 429.
		deadline := time.Now().Add(20 * time.Second)
		for len(codes)+int(up.held.Load()) < 200 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		close(up.resume)
		wg.Wait()
		close(codes)
		n := map[int]int{}
		for code := range codes {
			n[code]++
		}
		if n[200] != 100 || n[429] != 100 {
			t.Fatalf("200 parallel requests over two instances: %v, want 100 × 200 and 100 × 429", n)
		}
		// Each used 1 token, its reservation: both find the bucket empty.
		for _, c := range []*faultCaddy{a, b} {
			if code, h, _ := llmGetAt(t, c.url, "/json?tokens=1", "Authorization", "parallel", "X-Parallel", "1"); code != 429 {
				t.Fatalf("%s after the parallel requests: %d, RateLimit %q; want 429", c.url, code, h.Get("RateLimit"))
			}
		}
	})

	t.Run("accounting", func(t *testing.T) {
		k := &usageKey{t: t, key: "k1", zone: "llm"}
		k.allowed(a, "/json?tokens=60", 60)
		k.allowed(b, "/json?tokens=30", 30)
		k.allowed(a, "/sse?tokens=45", 45)
		k.refused(b, "/json?tokens=1")
		k.refused(a, "/json?tokens=1")
		tok, _ := adminKeyAt(t, b.admin, "llm", "k1")["tokens"].(float64)
		if _, hi := k.refill(time.Now(), time.Now()); tok < -35 || tok > -35+hi {
			t.Fatalf("B's admin API: tokens %v, want -35 (refilled at most %.2f)", tok, hi)
		}

		h := &usageKey{t: t, key: "h1", zone: "llm-header"}
		h.allowed(b, "/header?tokens=30", 30)
		h.allowed(a, "/trailer?tokens=20", 20)
		h.allowed(b, "/header?tokens=1", 1)

		// Without usage, on either instance, the reservation stands.
		s := &usageKey{t: t, key: "s1", zone: "llm"}
		ma, mb := scrapeAt(t, a.client, a.admin), scrapeAt(t, b.client, b.admin)
		s.allowed(a, "/sse?tokens=45&usage=none", 1)
		s.allowed(b, "/sse?tokens=45&cut=1", 1)
		s.allowed(b, "/sse?tokens=45&usage=none", 1)
		s.allowed(a, "/sse?tokens=45&cut=1", 1)
		const missing = `caddy_rate_limit_usage_missing_total{limit="100/m burst 100",zone="llm"}`
		for _, c := range []struct {
			c    *faultCaddy
			base map[string]float64
		}{{a, ma}, {b, mb}} {
			eventually(5*time.Second, func() bool { return scrapeAt(t, c.c.client, c.c.admin)[missing] >= c.base[missing]+2 })
			wantMetric(t, scrapeAt(t, c.c.client, c.c.admin), missing, c.base[missing]+2)
		}
		s.allowed(b, "/json?tokens=1", 1)
		s.allowed(a, "/json?tokens=1", 1)
	})
}

// usage with a quota, through Caddy on the local store and on Redis: a
// response whose usage takes the quota past its limit leaves the bucket
// with room (40 of 100 tokens), and the quota alone refuses the key until
// its window ends, counting nothing more; another key is not refused.
func TestUsageQuotaRefusesAlone(t *testing.T) {
	r := startRedis(t)
	up := startLLMUpstream(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n\t\t\taddress " + r.Addr() + "\n\t\t\tkey_prefix usage-quota:\n\t\t\ttimeout 5s\n\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "llm-quota-" + tc.name
			startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone %s {
			key {http.request.header.Authorization}
			rate 100/m
			burst 100
			usage json usage.total_tokens
			quota 50 per day
		}
		%s
	}
	reverse_proxy %s
}
`, zone, tc.store, strings.TrimPrefix(up.URL, "http://")))
			info := func(key string) (tokens float64, used int64) {
				t.Helper()
				v := adminKeyAt(t, adminAddr, zone, key)
				q, _ := v["quota"].(map[string]any)
				tokens, _ = v["tokens"].(float64)
				n, _ := q["used"].(float64)
				return tokens, int64(n)
			}
			if code, h, body := llmGet(t, "q1", "/json?tokens=60"); code != 200 {
				t.Fatalf("first: %d %q, RateLimit %q", code, body, h.Get("RateLimit"))
			}
			// The client may have the whole response before Caddy has
			// settled it.
			eventually(5*time.Second, func() bool { _, used := info("q1"); return used == 60 })
			day := (&calendar.Windows{Period: calendar.Periods["day"], Loc: time.UTC}).Window(time.Now())
			for i := range 2 {
				code, h, _ := llmGet(t, "q1", "/json?tokens=1")
				ra, _ := strconv.ParseInt(h.Get("Retry-After"), 10, 64)
				if want := ceilSeconds(time.Until(day.End)); code != 429 || ra < want-2 || ra > want+1 {
					t.Fatalf("request %d after the quota ran out: %d, Retry-After %q; want 429 and about %d s, until the day ends",
						i, code, h.Get("Retry-After"), want)
				}
				// The bucket has room: it is the quota that refuses, and
				// the refusals take nothing from either.
				if tokens, used := info("q1"); tokens < 39.9 || tokens > 41 || used != 60 {
					t.Fatalf("request %d after the quota ran out: %v tokens, %d counted; want 40 and 60", i, tokens, used)
				}
			}
			if code, h, _ := llmGet(t, "q2", "/json?tokens=1"); code != 200 {
				t.Fatalf("another key: %d, RateLimit %q", code, h.Get("RateLimit"))
			}
		})
	}
}

// A response without usage is counted, every one, and logged at most once
// a minute per zone: one line for each zone, with the zone and the
// reason of its first response without usage, and never the key. A zone
// is one zone in every handler that has it (here a route of its own for
// /a/), and across a config reload.
func TestUsageMissingLoggedOnce(t *testing.T) {
	up := startLLMUpstream(t)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	global := fmt.Sprintf("\tlog {\n\t\toutput file %s\n\t\tformat json\n\t}\n", logFile)
	// site has usageSites' zones in two handlers, the second for the
	// paths under /a/.
	site := func(extra string) string {
		one := usageSites(up.URL, "")
		one = one[strings.Index(one, "{\n")+2 : strings.LastIndex(one, "}")]
		return "http://localhost {\n" + extra + "\thandle_path /a/* {\n" + one + "\t}\n\thandle {\n" + one + "\t}\n}\n"
	}
	tester := startCaddy(t, global, site(""))
	logs := watchLog(t, logFile)
	mark := logs.mark()
	base := scrape(t, tester)
	const key = "sk-live-0123456789abcdef"
	send := func(paths ...string) {
		t.Helper()
		for _, path := range paths {
			if code, _, body := llmGet(t, key, path); code != 200 {
				t.Fatalf("%s: %d %q", path, code, body)
			}
		}
	}
	send(
		"/sse?tokens=5&usage=none", // the field missing
		"/a/sse?tokens=5&cut=1",    // cut off
		"/json?tokens=null",        // not a number
		"/header?tokens=many",      // llm-header: not a number
		"/a/trailer",               // llm-header: the trailer empty
	)
	reload(t, tester, global, site("\theader X-Reloaded 1\n"))
	send("/a/sse?tokens=5&usage=none", "/header?tokens=-4")

	missing := func(zone string) string {
		return `caddy_rate_limit_usage_missing_total{limit="100/m burst 100",zone="` + zone + `"}`
	}
	eventually(5*time.Second, func() bool {
		m := scrape(t, tester)
		return m[missing("llm")] >= base[missing("llm")]+4 && m[missing("llm-header")] >= base[missing("llm-header")]+3
	})
	m := scrape(t, tester)
	wantMetric(t, m, missing("llm"), base[missing("llm")]+4)
	wantMetric(t, m, missing("llm-header"), base[missing("llm-header")]+3)

	lines := logs.since(mark)
	if leaked := leaks(lines, key, "0123456789abcdef"); len(leaked) > 0 {
		t.Errorf("the key is in the logs:\n%s", strings.Join(leaked, "\n"))
	}
	got := map[string][]string{}
	for _, l := range lines {
		var e map[string]any
		if json.Unmarshal([]byte(l.text), &e) != nil || e["msg"] != "rate limit: no usage in a response; the request keeps the cost it took" {
			continue
		}
		zone, _ := e["zone"].(string)
		reason, _ := e["reason"].(string)
		got[zone] = append(got[zone], reason)
	}
	want := map[string][]string{
		"llm":        {"the response has no such field"},
		"llm-header": {"the field is not a number of at least 0"},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("no-usage lines by zone: %q; want %q", got, want)
	}
}

// usage with plans, through Caddy on the local store and on Redis: the
// settlement charges the bucket of the request's own plan, at that plan's
// rate, and lets it owe that plan's burst. On pro (100/m, burst 100),
// 60 tokens leave 39 for the next request, and 60 then 50 owe 10, which
// the next request waits 7 s for; on max (1000/m, burst 1000), 60 tokens
// leave 939.
func TestUsageWithPlans(t *testing.T) {
	r := startRedis(t)
	up := startLLMUpstream(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n\t\t\taddress " + r.Addr() + "\n\t\t\tkey_prefix usage-plans:\n\t\t\ttimeout 5s\n\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "llm-plans-" + tc.name
			startCaddy(t, "", fmt.Sprintf(`http://localhost {
	map {http.request.header.X-Plan} {plan_rate} {plan_burst} {
		pro     100/m  100
		max     1000/m 1000
		default 10/m   10
	}
	rate_limit {
		zone %s {
			key {http.request.header.Authorization}
			rate {plan_rate}
			burst {plan_burst}
			usage json usage.total_tokens
		}
		%s
	}
	reverse_proxy %s
}
`, zone, tc.store, strings.TrimPrefix(up.URL, "http://")))
			// call sends a request of key on plan, and returns its status,
			// what its RateLimit field says is left and its Retry-After;
			// then it waits until the bucket, read without a plan, is full
			// again no sooner than after fullIn.
			call := func(key, plan, path string, fullIn time.Duration) (int, int, string) {
				t.Helper()
				code, h, body := llmGetAt(t, siteURL, path, "Authorization", key, "X-Plan", plan)
				if code != 200 && code != 429 {
					t.Fatalf("%s on %s: %d %q", path, plan, code, body)
				}
				eventually(5*time.Second, func() bool {
					v, _ := adminKeyAt(t, adminAddr, zone, key)["full_in"].(float64)
					return v >= fullIn.Seconds()
				})
				left := 0
				if code == 200 {
					left = remainingOf(t, h, zone)
				}
				return code, left, h.Get("Retry-After")
			}
			if code, left, _ := call("pro-key", "pro", "/json?tokens=60", 35*time.Second); code != 200 || left != 99 {
				t.Fatalf("pro, first: %d, %d left; want 200 and 99", code, left)
			}
			if code, left, _ := call("pro-key", "pro", "/json?tokens=50", 65*time.Second); code != 200 || left != 39 {
				t.Fatalf("pro, after 60 tokens: %d, %d left; want 200 and 39", code, left)
			}
			if code, _, retry := call("pro-key", "pro", "/json?tokens=1", 0); code != 429 || retry != "7" {
				t.Fatalf("pro, owing 10 tokens: %d, Retry-After %q; want 429 and 7 (11 tokens at 100/m)", code, retry)
			}
			if code, left, _ := call("max-key", "max", "/json?tokens=60", 3*time.Second); code != 200 || left != 999 {
				t.Fatalf("max, first: %d, %d left; want 200 and 999", code, left)
			}
			if code, left, _ := call("max-key", "max", "/json?tokens=1", 0); code != 200 || left != 939 {
				t.Fatalf("max, after 60 tokens: %d, %d left; want 200 and 939", code, left)
			}
		})
	}
}
