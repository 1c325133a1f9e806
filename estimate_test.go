// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// maxBody is the longest body an estimate reads whole: 1 MiB, as
// docs/usage.md says.
const maxBody = 1 << 20

// chatBody is an OpenAI chat completion request of exactly size bytes
// (at least 80), stating max_tokens maxTokens ("" for none).
func chatBody(size int, maxTokens string) []byte {
	head := `{"model":"m",`
	if maxTokens != "" {
		head += `"max_tokens":` + maxTokens + `,`
	}
	head += `"messages":[{"role":"user","content":"`
	const tail = `"}]}`
	return []byte(head + strings.Repeat("x", size-len(head)-len(tail)) + tail)
}

// gzipped is b compressed with gzip.
func gzipped(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, _ = zw.Write(b)
	_ = zw.Close()
	return buf.Bytes()
}

// onlyReader hides every method of a reader but Read, so that an HTTP
// client sends what it reads chunked, without a Content-Length.
type onlyReader struct{ io.Reader }

// postRequest is a POST of body from client IP ip, as Caddy's server
// would hand it to a handler: with a Content-Length, or, chunked,
// without one; with header name/value pairs.
func postRequest(ip string, body io.Reader, length int64, header ...string) (*http.Request, *httptest.ResponseRecorder) {
	req, rr := newRequest(ip, header...)
	req.Method, req.Body, req.ContentLength = http.MethodPost, io.NopCloser(body), length
	if length == 0 {
		req.Body = http.NoBody
	}
	return req, rr
}

// sha256Hex is the hex SHA-256 of b.
func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// countingReader counts the bytes read from it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// What a request reserves, through the handler: the largest positive
// number at the paths its JSON body states, or the cost, plus a token for every
// 4 bytes of the body, from its Content-Length or, chunked, from a JSON
// body read whole; each body reaches the next handler as it came, having
// been read before it no further than 1 MiB and a byte, or not at all.
func TestEstimateReserves(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"estimate-reserves","key":"{http.request.header.Authorization}",
		"rate":"1r/s","burst":2000000,"cost":500,
		"estimate":{"json":["max_tokens","max_completion_tokens","options.num_predict"],"prompt":4}}]}`)
	kib := chatBody(1024, "200")
	big := chatBody(5<<20, "200")
	// prompt is a token for every 4 bytes of b, rounded up.
	prompt := func(b string) int64 { return int64(len(b)+3) / 4 }
	gz := gzipped(kib)
	for _, tc := range []struct {
		name    string
		body    []byte
		chunked bool
		ct      string
		enc     string
		want    int64 // tokens reserved
		readMax int64 // bytes read before the next handler, at most
		missing bool
	}{
		{name: "no body", body: nil, want: 500, missing: true},
		{name: "1 KiB", body: kib, want: 200 + 256, readMax: 1024},
		{name: "1 KiB chunked", body: kib, chunked: true, want: 200 + 256, readMax: 1024},
		{name: "the second path", body: []byte(`{"max_completion_tokens":30}`), want: 30 + prompt(`{"max_completion_tokens":30}`), readMax: 1024},
		{name: "the largest path wins", body: []byte(`{"options":{"num_predict":9},"max_completion_tokens":30}`),
			want: 30 + prompt(`{"options":{"num_predict":9},"max_completion_tokens":30}`), readMax: 1024},
		{name: "the largest path wins, whatever the order", body: []byte(`{"max_tokens":1,"max_completion_tokens":200}`),
			want: 200 + prompt(`{"max_tokens":1,"max_completion_tokens":200}`), readMax: 1024},
		{name: "a negative number states no bound", body: []byte(`{"options":{"num_predict":-1},"max_tokens":5}`),
			want: 5 + prompt(`{"options":{"num_predict":-1},"max_tokens":5}`), readMax: 1024},
		{name: "0 states no bound", body: []byte(`{"max_tokens":0,"max_completion_tokens":7}`),
			want: 7 + prompt(`{"max_tokens":0,"max_completion_tokens":7}`), readMax: 1024},
		{name: "0 only", body: []byte(`{"max_tokens":0}`), want: 500 + prompt(`{"max_tokens":0}`), readMax: 1024, missing: true},
		{name: "-1 only", body: []byte(`{"options":{"num_predict":-1}}`), want: 500 + prompt(`{"options":{"num_predict":-1}}`), readMax: 1024, missing: true},
		{name: "a string only", body: []byte(`{"max_tokens":"200"}`), want: 500 + prompt(`{"max_tokens":"200"}`), readMax: 1024, missing: true},
		{name: "a nested path", body: []byte(`{"options":{"num_predict":9}}`), want: 9 + prompt(`{"options":{"num_predict":9}}`), readMax: 1024},
		{name: "a fraction rounds up", body: []byte(`{"max_tokens":9.5}`), want: 10 + prompt(`{"max_tokens":9.5}`), readMax: 1024},
		{name: "null, then the next path", body: []byte(`{"max_tokens":null,"max_completion_tokens":3}`),
			want: 3 + prompt(`{"max_tokens":null,"max_completion_tokens":3}`), readMax: 1024},
		{name: "null only", body: []byte(`{"max_tokens":null}`), want: 500 + prompt(`{"max_tokens":null}`), readMax: 1024, missing: true},
		{name: "none of the paths", body: []byte(`{"n":1}`), want: 500 + prompt(`{"n":1}`), readMax: 1024, missing: true},
		{name: "not valid JSON", body: []byte(`{"max_tokens":3,}`), want: 500 + prompt(`{"max_tokens":3,}`), readMax: 1024, missing: true},
		{name: "not JSON", body: kib, ct: "text/plain", want: 500 + 256, missing: true},
		{name: "not JSON, chunked", body: kib, ct: "text/plain", chunked: true, want: 500, missing: true},
		{name: "gzip", body: gz, enc: "gzip", want: 500 + prompt(string(gz)), missing: true},
		{name: "gzip, chunked", body: gz, enc: "gzip", chunked: true, want: 500, missing: true},
		{name: "5 MiB", body: big, want: 500 + 5<<20/4, missing: true},
		{name: "5 MiB chunked", body: big, chunked: true, want: 500, readMax: maxBody + 1, missing: true},
		{name: "over 1 MiB by a byte, chunked", body: chatBody(maxBody+1, "200"), chunked: true, want: 500, readMax: maxBody + 1, missing: true},
		{name: "1 MiB, chunked", body: chatBody(maxBody, "200"), chunked: true, want: 200 + maxBody/4, readMax: maxBody},
		{name: "a huge number", body: []byte(`{"max_tokens":1e300}`), want: 2000000, readMax: 1024},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := &countingReader{r: bytes.NewReader(tc.body)}
			length := int64(len(tc.body))
			if tc.chunked {
				length = -1
			}
			header := []string{"Authorization", tc.name, "Content-Type", "application/json"}
			if tc.ct != "" {
				header[3] = tc.ct
			}
			if tc.enc != "" {
				header = append(header, "Content-Encoding", tc.enc)
			}
			req, rr := postRequest("192.0.2.1", src, length, header...)
			missing := h.Zones[0].state.estimateMissing.Load()
			var readBefore int64
			var got []byte
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				readBefore = src.n
				var err error
				got, err = io.ReadAll(r.Body)
				return err
			})
			if err := h.ServeHTTP(rr, req, next); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, tc.body) {
				t.Fatalf("the next handler read %d bytes, not the %d sent", len(got), len(tc.body))
			}
			if readBefore > tc.readMax {
				t.Fatalf("%d bytes read before the next handler, want at most %d", readBefore, tc.readMax)
			}
			if left := int64(remainingOf(t, rr.Header(), "estimate-reserves")); 2000000-left != tc.want {
				t.Fatalf("reserved %d tokens, want %d", 2000000-left, tc.want)
			}
			if d := h.Zones[0].state.estimateMissing.Load() - missing; d != map[bool]uint64{true: 1}[tc.missing] {
				t.Fatalf("counted %d missing estimates, want %v", d, tc.missing)
			}
		})
	}
}

// A client whose body fails half way: the request reserves the cost, and
// the next handler reads what came, then the same error.
func TestEstimateBodyFails(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"estimate-fails","rate":"1r/h","burst":1000,"cost":50,"estimate":{"json":["max_tokens"],"prompt":4}}]}`)
	broken := errors.New("connection reset")
	body := io.MultiReader(strings.NewReader(`{"max_tokens":10,"messages":[`), iotestErr{broken})
	req, rr := postRequest("192.0.2.1", body, 400, "Content-Type", "application/json")
	var got []byte
	var readErr error
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		got, readErr = io.ReadAll(r.Body)
		return nil
	})
	if err := h.ServeHTTP(rr, req, next); err != nil {
		t.Fatal(err)
	}
	if string(got) != `{"max_tokens":10,"messages":[` || !errors.Is(readErr, broken) {
		t.Fatalf("the next handler read %q and %v", got, readErr)
	}
	if left := remainingOf(t, rr.Header(), "estimate-fails"); left != 1000-50-100 {
		t.Fatalf("%d left, want %d: the cost, and the prompt part of the Content-Length", left, 1000-50-100)
	}
}

// iotestErr is a reader that fails.
type iotestErr struct{ err error }

func (r iotestErr) Read([]byte) (int, error) { return 0, r.err }

// estimate's Caddyfile and JSON errors.
func TestEstimateCaddyfileErrors(t *testing.T) {
	// zone is a zone block with lines: lines start at line 4.
	zone := func(lines string) string { return "rate_limit {\n\tzone llm {\n\t\trate 100/m\n" + lines + "\t}\n}" }
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"nothing to read", zone("\t\testimate\n"), "estimate needs what to read", 4},
		{"unknown form", zone("\t\testimate body\n"), "invalid estimate 'body': expected json <path>... or prompt <bytes-per-token>", 4},
		{"no paths", zone("\t\testimate json\n"), "estimate json needs paths", 4},
		{"an empty key", zone("\t\testimate json max_tokens a..b\n"), "invalid estimate json path 'a..b'", 4},
		{"json twice", zone("\t\testimate json a\n\t\testimate json b\n"), "zone llm: estimate json already specified", 5},
		{"prompt twice", zone("\t\testimate prompt 4\n\t\testimate prompt 3\n"), "zone llm: estimate prompt already specified", 5},
		{"prompt not a number", zone("\t\testimate prompt four\n"), "invalid estimate prompt 'four': expected bytes per token, such as 4", 4},
		{"prompt 0", zone("\t\testimate prompt 0\n"), "invalid estimate prompt 0: must be a positive number", 4},
		{"prompt two numbers", zone("\t\testimate prompt 4 5\n"), "wrong argument count", 4},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
	if err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(zone("\t\testimate json a b\n\t\tcost 5\n\t\testimate prompt 3.5\n"))); err != nil {
		t.Fatalf("json and prompt apart: %v", err)
	}
	for _, tc := range []struct{ json, wantErr string }{
		{`{"zones":[{"name":"a","rate":"1r/s","estimate":{}}]}`, "estimate needs json paths or prompt"},
		{`{"zones":[{"name":"a","rate":"1r/s","estimate":{"prompt":-1}}]}`, "invalid estimate prompt -1"},
		{`{"zones":[{"name":"a","rate":"1r/s","estimate":{"json":[".a"]}}]}`, "invalid estimate json path '.a'"},
		{`{"zones":[{"name":"a","concurrency":2,"estimate":{"json":["a"]}}]}`, "estimate needs a rate or a quota"},
		{`{"zones":[{"name":"a","quota":10,"quota_period":"day","estimate":{"json":["a"]}}]}`, ""},
	} {
		checkValidate(t, tc.json, tc.wantErr)
	}
}

// estimate with the zone's other kinds and both stores: with usage, the
// settlement charges the usage less the estimate, or gives back the
// rest, and max_debt bounds it; a quota counts the estimate, then the
// usage; a plan's cost is the cost a request without an estimate takes;
// an estimate above the burst, or above a key's own burst, reserves that
// burst, and the request is allowed, not answered 500.
func TestEstimateWithOtherKinds(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", `,"store":{"backend":"redis","addresses":["` + r.Addr() + `"],"key_prefix":"estimate-kinds:","timeout":"5s"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, `{"zones":[
				{"name":"est-usage-`+tc.name+`","key":"{http.request.header.X-Zone}","match":[{"header":{"X-Zone":["usage"]}}],
				 "rate":"1r/h","burst":1000,"max_debt":100,"usage":{"header":"X-Used"},"estimate":{"json":["max_tokens"]}},
				{"name":"est-quota-`+tc.name+`","key":"{http.request.header.X-Zone}","match":[{"header":{"X-Zone":["quota"]}}],
				 "quota":1000,"quota_period":"day","usage":{"header":"X-Used"},"estimate":{"json":["max_tokens"]}},
				{"name":"est-plans-`+tc.name+`","key":"{http.request.header.X-Zone}","match":[{"header":{"X-Zone":["plans"]}}],
				 "rate":"{http.request.header.X-Rate}","burst":"{http.request.header.X-Burst}","cost":"{http.request.header.X-Cost}",
				 "estimate":{"json":["max_tokens"]}},
				{"name":"est-own-`+tc.name+`","key":"{http.request.header.X-Zone}","match":[{"header":{"X-Zone":["own"]}}],
				 "rate":"1r/h","burst":1000,"estimate":{"json":["max_tokens"]}}]`+tc.store+`}`)
			send := func(zone, body, used string, header ...string) (int, http.Header) {
				t.Helper()
				req, rr := postRequest("192.0.2.1", strings.NewReader(body), int64(len(body)),
					append([]string{"X-Zone", zone, "Content-Type", "application/json"}, header...)...)
				next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
					_, _ = io.Copy(io.Discard, r.Body)
					if used != "" {
						w.Header().Set("X-Used", used)
					}
					w.WriteHeader(http.StatusOK)
					return nil
				})
				if err := h.ServeHTTP(rr, req, next); err != nil {
					return statusOf(err), rr.Header()
				}
				return rr.Code, rr.Header()
			}
			zoneName := func(z string) string { return "est-" + z + "-" + tc.name }
			peek := func(z string) (tokens float64, used int64) {
				t.Helper()
				v := adminKeyOf(t, h, zoneName(z), z)
				return v.tokens, v.used
			}

			// usage: 300 reserved and 120 used leave 880; 900 reserved
			// and 1500 used owe the most debt, 100.
			if code, hdr := send("usage", `{"max_tokens":300}`, "120"); code != 200 || remainingOf(t, hdr, zoneName("usage")) != 700 {
				t.Fatalf("usage: %d, RateLimit %q; want 200 and 700 left", code, hdr.Get("RateLimit"))
			}
			if tok, _ := peek("usage"); tok < 879.9 || tok > 881 {
				t.Fatalf("usage: %v tokens after 120 used, want 880", tok)
			}
			send("usage", `{"max_tokens":800}`, "1500")
			if tok, _ := peek("usage"); tok < -100 || tok > -99 {
				t.Fatalf("usage: %v tokens after 1500 used, want -100: max_debt", tok)
			}

			// quota: 300 counted at admission, then the usage, 120.
			if code, hdr := send("quota", `{"max_tokens":300}`, "120"); code != 200 || remainingOf(t, hdr, zoneName("quota")) != 700 {
				t.Fatalf("quota: %d, RateLimit %q; want 200 and 700 left", code, hdr.Get("RateLimit"))
			}
			if _, used := peek("quota"); used != 120 {
				t.Fatalf("quota: %d counted after 120 used, want 120", used)
			}
			// An estimate above the quota's limit counts the limit.
			if code, hdr := send("quota", `{"max_tokens":5000}`, ""); code != 429 || hdr.Get("Retry-After") == "" {
				t.Fatalf("quota, 5000 stated with 880 left: %d; want 429", code)
			}

			// plans: the plan's cost when no estimate, the estimate else.
			plan := []string{"X-Rate", "100/h", "X-Burst", "1000", "X-Cost", "40"}
			if code, hdr := send("plans", `{}`, "", plan...); code != 200 || remainingOf(t, hdr, zoneName("plans")) != 960 {
				t.Fatalf("plans, no estimate: %d, RateLimit %q; want 960 left", code, hdr.Get("RateLimit"))
			}
			if code, hdr := send("plans", `{"max_tokens":60}`, "", plan...); code != 200 || remainingOf(t, hdr, zoneName("plans")) != 900 {
				t.Fatalf("plans, 60 stated: %d, RateLimit %q; want 900 left", code, hdr.Get("RateLimit"))
			}
			// Above the plan's burst: the whole bucket, once it is full.
			if code, hdr := send("plans", `{"max_tokens":5000}`, "", plan...); code != 429 || hdr.Get("Retry-After") != "3600" {
				t.Fatalf("plans, 5000 stated with 900 left: %d, Retry-After %q; want 429 and 3600 (the time of 100 tokens)", code, hdr.Get("Retry-After"))
			}

			// A key's own burst of 100: 300 stated reserves 100.
			own := h.Zones[3]
			if err := h.store.SetOverride(context.Background(), time.Now(), own.index, store.Key{Text: "own"},
				store.Override{TokenTime: time.Hour, Burst: 100, Rate: "1r/h"}); err != nil {
				t.Fatal(err)
			}
			if code, hdr := send("own", `{"max_tokens":300}`, ""); code != 200 || remainingOf(t, hdr, zoneName("own")) != 0 {
				t.Fatalf("own burst 100, 300 stated: %d, RateLimit %q; want 200 and 0 left", code, hdr.Get("RateLimit"))
			}
			if code, hdr := send("own", `{"max_tokens":300}`, ""); code != 429 || hdr.Get("Retry-After") != "360000" {
				t.Fatalf("own burst 100, empty: %d, Retry-After %q; want 429 and 360000 (100 tokens at 1r/h)", code, hdr.Get("Retry-After"))
			}
		})
	}
}

// keyState is what a store holds of a zone's key: its bucket's tokens,
// its quota's count.
type keyState struct {
	tokens float64
	used   int64
}

// adminKeyOf reads the key of h's zone from its store, without a
// request, as the admin API does.
func adminKeyOf(t *testing.T, h *Handler, zone, key string) keyState {
	t.Helper()
	for _, z := range h.Zones {
		if z.Name != zone {
			continue
		}
		d := &store.Demands{}
		for _, k := range kinds {
			if k.demand != nil {
				k.demand(z, store.Key{Text: key}, d)
			}
		}
		if !z.rateless {
			d.Buckets = append(d.Buckets, bucketReq(z, store.Key{Text: key}))
		}
		if err := h.store.Peek(context.Background(), time.Now(), d); err != nil {
			t.Fatal(err)
		}
		var s keyState
		if len(d.Buckets) > 0 {
			b := &d.Buckets[0]
			s.tokens = b.Limit.Tokens(b.Debt)
		}
		if len(d.Counters) > 0 {
			s.used = d.Counters[0].Used
		}
		return s
	}
	t.Fatalf("no zone %s", zone)
	return keyState{}
}

// estimateSite is a site whose zone <zone> reserves what requests state
// in max_tokens, and whose zone <zone>-cost, for the requests with
// X-Estimate: off, reserves a cost of 50 instead, sending them to
// upstream costUp; both burst 1000 at 1000/h, charging the usage, on
// store.
func estimateSite(zone, upstream, costUp, storeCfg string) string {
	return fmt.Sprintf(`http://localhost {
	rate_limit {
		zone %[1]s {
			key {http.request.header.Authorization}
			match not header X-Estimate off
			rate 1000/h
			burst 1000
			usage json usage.total_tokens
			estimate json max_tokens max_completion_tokens options.num_predict
			cost 500
		}
		zone %[1]s-cost {
			key {http.request.header.Authorization}
			match header X-Estimate off
			rate 1000/h
			burst 1000
			usage json usage.total_tokens
			cost 50
		}
		%[4]s
	}
	@cost header X-Estimate off
	reverse_proxy @cost %[3]s {
		flush_interval -1
	}
	reverse_proxy %[2]s {
		flush_interval -1
	}
}
`, zone, strings.TrimPrefix(upstream, "http://"), strings.TrimPrefix(costUp, "http://"), storeCfg)
}

// sendParallel sends n POSTs of body for key to each of urls in turn, at
// once, and returns how many got each status. up, started with resume
// open, holds every stream that was admitted until all were decided.
func sendParallel(t *testing.T, up *llmUpstream, urls []string, n int, key string, body []byte, header ...string) map[int]int {
	t.Helper()
	tr := &http.Transport{MaxConnsPerHost: n, MaxIdleConnsPerHost: n}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	codes := make(chan int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodPost, urls[i%len(urls)]+"/sse?tokens=100", bytes.NewReader(body))
			req.Header.Set("Authorization", key)
			req.Header.Set("Content-Type", "application/json")
			for i := 0; i+1 < len(header); i += 2 {
				req.Header.Set(header[i], header[i+1])
			}
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
	deadline := time.Now().Add(20 * time.Second)
	for len(codes)+int(up.held.Load()) < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(up.resume)
	wg.Wait()
	close(codes)
	got := map[int]int{}
	for code := range codes {
		got[code]++
	}
	return got
}

// The promise, through a real Caddy on the local store and on Redis: with
// burst 1000, 20 requests at once for a fresh key, each stating
// max_tokens 1 and max_completion_tokens 200 and using 100 (an OpenAI
// stream's usage chunk), admit
// exactly 5, whose reservations hold the bucket at 0 until their
// responses; once they are settled, the bucket holds the 500 they did not
// use. A JSON completion is then settled alike. The same 20 in a zone
// without estimate, at a cost of 50, are all admitted and leave its
// bucket 1,000 tokens in debt.
func TestEstimateParallel(t *testing.T) {
	r := startRedis(t)
	for _, tc := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n\t\t\taddress " + r.Addr() + "\n\t\t\tkey_prefix estimate:\n\t\t\ttimeout 5s\n\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up, costUp := startLLMUpstream(t), startLLMUpstream(t)
			// Held until the parallel requests are decided.
			up.resume, costUp.resume = make(chan struct{}), make(chan struct{})
			zone := "llm-estimate-" + tc.name
			startCaddy(t, "", estimateSite(zone, up.URL, costUp.URL, tc.store))
			// The body states two bounds; the upstream may honour either
			// (OpenAI-compatible servers take max_completion_tokens), so
			// the larger is reserved.
			body := []byte(`{"model":"m","max_tokens":1,"max_completion_tokens":200,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
			// Without estimate, a cost of 50: all 20 are admitted, and
			// their usage leaves the bucket 1,000 tokens in debt.
			if n := sendParallel(t, costUp, []string{siteURL}, 20, "parallel", body, "X-Estimate", "off"); n[200] != 20 {
				t.Fatalf("20 parallel requests at a cost of 50: %v, want 20 × 200", n)
			}
			owed := func() float64 {
				tok, _ := adminKeyAt(t, adminAddr, zone+"-cost", "parallel")["tokens"].(float64)
				return tok
			}
			eventually(5*time.Second, func() bool { return owed() <= -999 })
			if tok := owed(); tok < -1000 || tok > -999 {
				t.Fatalf("after the 20 at a cost of 50 were settled: %v tokens, want -1000", tok)
			}

			if n := sendParallel(t, up, []string{siteURL}, 20, "parallel", body); n[200] != 5 || n[429] != 15 {
				t.Fatalf("20 parallel requests stating 200 tokens: %v, want 5 × 200 and 15 × 429", n)
			}
			tokens := func() float64 {
				tok, _ := adminKeyAt(t, adminAddr, zone, "parallel")["tokens"].(float64)
				return tok
			}
			eventually(5*time.Second, func() bool { return tokens() >= 500 })
			// 1000/h refills a token in 3.6 s.
			if tok := tokens(); tok < 500 || tok > 505 {
				t.Fatalf("after the 5 were settled: %v tokens, want 500", tok)
			}
			req, _ := http.NewRequest(http.MethodPost, siteURL+"/json?tokens=30", bytes.NewReader(body))
			req.Header.Set("Authorization", "parallel")
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || remainingOf(t, resp.Header, zone) > 305 || remainingOf(t, resp.Header, zone) < 300 {
				t.Fatalf("a JSON completion after: %d, RateLimit %q; want 200 and 300 left", resp.StatusCode, resp.Header.Get("RateLimit"))
			}
			eventually(5*time.Second, func() bool { return tokens() >= 470 })
			if tok := tokens(); tok < 470 || tok > 476 {
				t.Fatalf("after the JSON completion, 30 used: %v tokens, want 470", tok)
			}
		})
	}
}

// Bodies through a real Caddy and reverse_proxy: 0 B, 1 KiB, 900 KiB and
// 5 MiB, JSON and not, with a Content-Length and chunked, gzip-encoded;
// each reaches the upstream byte for byte (the SHA-256 it computes), and
// reserves what docs/usage.md says: the number at max_tokens (200) of a
// JSON body read whole, else the cost (500), plus a token for 4 bytes of
// its Content-Length, or of a JSON body read whole.
func TestEstimateBodiesThroughCaddy(t *testing.T) {
	up := startLLMUpstream(t)
	tester := startCaddy(t, "", fmt.Sprintf(`http://localhost {
	rate_limit {
		zone llm-bodies {
			key {http.request.header.Authorization}
			rate 1000/h
			burst 2000000
			estimate json max_tokens
			estimate prompt 4
			cost 500
		}
	}
	reverse_proxy %s
}
`, strings.TrimPrefix(up.URL, "http://")))
	base := scrape(t, tester)
	kib, k900, mib5 := chatBody(1<<10, "200"), chatBody(900<<10, "200"), chatBody(5<<20, "200")
	text := bytes.Repeat([]byte("plain text "), 100)[:1<<10]
	gz := gzipped(k900)
	missing := 0
	for _, tc := range []struct {
		name    string
		body    []byte
		chunked bool
		ct, enc string
		want    int
		missing bool
	}{
		{name: "0 B", body: []byte{}, ct: "application/json", want: 500, missing: true},
		{name: "1 KiB JSON", body: kib, ct: "application/json", want: 200 + 256},
		{name: "1 KiB JSON chunked", body: kib, chunked: true, ct: "application/json", want: 200 + 256},
		{name: "900 KiB JSON", body: k900, ct: "application/json", want: 200 + 900<<10/4},
		{name: "900 KiB JSON chunked", body: k900, chunked: true, ct: "application/json", want: 200 + 900<<10/4},
		{name: "5 MiB JSON", body: mib5, ct: "application/json", want: 500 + 5<<20/4, missing: true},
		{name: "5 MiB JSON chunked", body: mib5, chunked: true, ct: "application/json", want: 500, missing: true},
		{name: "1 KiB text", body: text, ct: "text/plain", want: 500 + 256, missing: true},
		{name: "1 KiB text chunked", body: text, chunked: true, ct: "text/plain", want: 500, missing: true},
		{name: "5 MiB text", body: bytes.Repeat(text, 5<<10), ct: "text/plain", want: 500 + 5<<20/4, missing: true},
		{name: "gzip JSON", body: gz, ct: "application/json", enc: "gzip", want: 500 + (len(gz)+3)/4, missing: true},
		{name: "gzip JSON chunked", body: gz, chunked: true, ct: "application/json", enc: "gzip", want: 500, missing: true},
	} {
		var body io.Reader = bytes.NewReader(tc.body)
		if tc.chunked {
			body = onlyReader{body}
		}
		req, _ := http.NewRequest(http.MethodPost, siteURL+"/json?tokens=1", body)
		if tc.chunked {
			req.ContentLength = -1
		}
		req.Header.Set("Authorization", tc.name)
		req.Header.Set("Content-Type", tc.ct)
		if tc.enc != "" {
			req.Header.Set("Content-Encoding", tc.enc)
		}
		resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", tc.name, resp.StatusCode)
		}
		if got, n := resp.Header.Get("X-Body-Sha256"), resp.Header.Get("X-Body-Length"); got != sha256Hex(tc.body) || n != strconv.Itoa(len(tc.body)) {
			t.Fatalf("%s: the upstream received %s bytes of SHA-256 %s, not the %d sent", tc.name, n, got, len(tc.body))
		}
		if left := remainingOf(t, resp.Header, "llm-bodies"); 2000000-left != tc.want {
			t.Fatalf("%s: reserved %d tokens, want %d", tc.name, 2000000-left, tc.want)
		}
		if tc.missing {
			missing++
		}
	}
	const series = `caddy_rate_limit_estimate_missing_total{limit="1000/h burst 2000000",zone="llm-bodies"}`
	wantMetric(t, scrape(t, tester), series, base[series]+float64(missing))
}

// Two Caddy processes, built from ./cmd/caddy, sharing one Redis: 20
// requests at once for a fresh key, each stating max_tokens 200 and
// using 100, split over both, admit 5 between them, and once settled
// both see the 500 tokens they did not use; a zone with spill spills
// for both once their requests have emptied its shared bucket.
func TestEstimateAndSpillAcrossInstances(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	bin, _ := buildCaddy(t)
	r := startRedis(t)
	up, fallback := startLLMUpstream(t), startLLMUpstream(t)
	up.resume = make(chan struct{}) // held until the parallel requests are decided
	site := fmt.Sprintf(`	rate_limit {
		zone llm-across {
			key {http.request.header.Authorization}
			match header X-Test estimate
			rate 1000/h
			burst 1000
			usage json usage.total_tokens
			estimate json max_tokens max_completion_tokens options.num_predict
			cost 500
		}
		zone primary-across {
			key {http.request.header.Authorization}
			match header X-Test spill
			rate 3/h
			spill
		}
		store redis {
			address %s
			key_prefix across:
			timeout 5s
		}
	}
	@spilled vars {http.rate_limit.spilled} primary-across
	reverse_proxy @spilled %s {
		header_down X-Upstream fallback
	}
	reverse_proxy %s {
		header_down X-Upstream primary
		flush_interval -1
	}`, r.Addr(), strings.TrimPrefix(fallback.URL, "http://"), strings.TrimPrefix(up.URL, "http://"))
	a, b := startCaddyProcess(t, bin, site), startCaddyProcess(t, bin, site)

	body := []byte(`{"model":"m","max_tokens":200,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if n := sendParallel(t, up, []string{a.url, b.url}, 20, "parallel", body, "X-Test", "estimate"); n[200] != 5 || n[429] != 15 {
		t.Fatalf("20 parallel requests stating 200 tokens over two instances: %v, want 5 × 200 and 15 × 429", n)
	}
	for _, c := range []*faultCaddy{a, b} {
		tokens := func() float64 {
			tok, _ := adminKeyAt(t, c.admin, "llm-across", "parallel")["tokens"].(float64)
			return tok
		}
		eventually(5*time.Second, func() bool { return tokens() >= 500 })
		if tok := tokens(); tok < 500 || tok > 505 {
			t.Fatalf("%s after the 5 were settled: %v tokens, want 500", c.url, tok)
		}
	}

	for i, w := range []string{"primary", "primary", "primary", "fallback", "fallback"} {
		c := []*faultCaddy{a, b}[i%2]
		code, h, body := llmGetAt(t, c.url, "/json?tokens=5", "Authorization", "sk-spill", "X-Test", "spill")
		if code != 200 || h.Get("X-Upstream") != w || remainingOf(t, h, "primary-across") != max(2-i, 0) {
			t.Fatalf("request %d through %s: %d %q from %q, RateLimit %q; want 200 from %s and %d left",
				i, c.url, code, body, h.Get("X-Upstream"), h.Get("RateLimit"), w, max(2-i, 0))
		}
	}
}

// rewindBody is a request body that a benchmark rewinds to its start for
// each request, without allocating.
type rewindBody struct{ bytes.Reader }

func (*rewindBody) Close() error { return nil }

// BenchmarkEstimate is the allowed path of a zone with estimate json
// max_tokens and estimate prompt 4, for a chat completion request of 1
// KiB and of 64 KiB with a Content-Length (the body read, its number
// found, and given to the next handler, which reads it all), beside the
// same zone without estimate: `benchstat -col /estimate`.
func BenchmarkEstimate(b *testing.B) {
	for _, size := range []int{1 << 10, 64 << 10} {
		body := chatBody(size, "200")
		for _, est := range []string{"none", "json+prompt"} {
			b.Run(fmt.Sprintf("body=%dKiB/estimate=%s", size>>10, est), func(b *testing.B) {
				zone := `{"name":"bench-estimate-` + est + `","rate":"1000000000r/s","burst":1000000000`
				if est != "none" {
					zone += `,"estimate":{"json":["max_tokens"],"prompt":4}`
				}
				h := newTestHandler(b, `{"zones":[`+zone+`}]}`)
				benchPosts(b, h, body, "Content-Type", "application/json")
			})
		}
	}
}

// benchPosts runs POSTs of body, with a Content-Length and the header
// name/value pairs, through h, to a next handler that reads the body
// all: the body rewound for each, without allocating.
func benchPosts(b *testing.B, h *Handler, body []byte, header ...string) {
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		_, err := io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusOK)
		return err
	})
	rb := new(rewindBody)
	req, _ := postRequest("192.0.2.1", rb, int64(len(body)), header...)
	w := &headerSink{h: make(http.Header)}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		clear(w.h)
		rb.Reset(body)
		req.Body = rb
		if err := h.ServeHTTP(w, req, next); err != nil {
			b.Fatal(err)
		}
	}
}
