// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// postJSON sends body to the test site's path with the header name/value
// pairs (Content-Type application/json unless they say otherwise),
// chunked when chunked is set, and returns the status and the response's
// header.
func postJSON(t *testing.T, path string, body []byte, chunked bool, header ...string) (int, http.Header) {
	t.Helper()
	var r io.Reader = bytes.NewReader(body)
	if chunked {
		r = onlyReader{r}
	}
	req, _ := http.NewRequest(http.MethodPost, siteURL+path, r)
	if chunked {
		req.ContentLength = -1
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header
}

// jsonSite is a site whose zone <prefix>-models limits each X-Key and
// model of /v1/ at 1r/m burst 3, and whose zone <prefix>-tools limits
// each tool called through /mcp (JSON-RPC tools/call) at 1r/m burst 2;
// a header directive after rate_limit sends the model back as X-Model,
// and the method as X-Method, and the upstream says what it received.
func jsonSite(prefix, upstream string) string {
	return fmt.Sprintf(`http://localhost {
	route {
		rate_limit {
			zone %[1]s-models {
				key {http.request.header.X-Key}/{http.rate_limit.json.model}
				match path /v1/*
				rate 1r/m
				burst 3
			}
			zone %[1]s-tools {
				key {http.rate_limit.json.params.name}
				match {
					path /mcp
					vars {http.rate_limit.json.method} tools/call
				}
				rate 1r/m
				burst 2
			}
		}
		header X-Model {http.rate_limit.json.model}
		header X-Method {http.rate_limit.json.method}
		reverse_proxy %[2]s
	}
}
`, prefix, strings.TrimPrefix(upstream, "http://"))
}

// Through a real Caddy: a zone keyed by the model in the body gives each
// model its own bucket (alpha gets 3, then 429; beta is not touched); an
// MCP zone keyed by the tool's name, matching tools/call by the method in
// the body, gives each tool its own (search gets 2, then 429; fetch
// passes; tools/list is not limited); a header directive after
// rate_limit sees the values.
func TestJSONPlaceholderZones(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "", jsonSite("json-zones", up.URL))
	chat := func(model string) []byte {
		return []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`)
	}
	for i, want := range []int{200, 200, 200, 429} {
		code, h := postJSON(t, "/v1/chat/completions", chat("alpha"), i%2 == 1, "X-Key", "k1")
		if code != want {
			t.Fatalf("alpha, request %d: %d, want %d", i+1, code, want)
		}
		if code == 200 && (h.Get("X-Model") != "alpha" || remainingOf(t, h, "json-zones-models") != 2-i) {
			t.Fatalf("alpha, request %d: X-Model %q, RateLimit %q", i+1, h.Get("X-Model"), h.Get("RateLimit"))
		}
	}
	if code, h := postJSON(t, "/v1/chat/completions", chat("beta"), false, "X-Key", "k1"); code != 200 || h.Get("X-Model") != "beta" || remainingOf(t, h, "json-zones-models") != 2 {
		t.Fatalf("beta after alpha's 429: %d, X-Model %q, RateLimit %q", code, h.Get("X-Model"), h.Get("RateLimit"))
	}
	if code, _ := postJSON(t, "/v1/chat/completions", chat("alpha"), false, "X-Key", "k2"); code != 200 {
		t.Fatalf("alpha of another key: %d", code)
	}

	call := func(tool string) []byte {
		return []byte(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"` + tool + `","arguments":{"q":"x"}}}`)
	}
	for i, want := range []int{200, 200, 429} {
		if code, h := postJSON(t, "/mcp", call("search"), false); code != want || code == 200 && h.Get("X-Method") != "tools/call" {
			t.Fatalf("search, call %d: %d, X-Method %q; want %d", i+1, code, h.Get("X-Method"), want)
		}
	}
	if code, h := postJSON(t, "/mcp", call("fetch"), false); code != 200 || remainingOf(t, h, "json-zones-tools") != 1 {
		t.Fatalf("fetch after search's 429: %d, RateLimit %q", code, h.Get("RateLimit"))
	}
	for i := range 4 {
		code, h := postJSON(t, "/mcp", []byte(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`), false)
		if code != 200 || h.Get("X-Method") != "tools/list" || h.Get("RateLimit") != "" {
			t.Fatalf("tools/list %d: %d, X-Method %q, RateLimit %q; want 200 and no zone", i+1, code, h.Get("X-Method"), h.Get("RateLimit"))
		}
	}
}

// Through a real Caddy and reverse_proxy: bodies of 0 B, 1 KiB and 5 MiB,
// JSON and not, gzip-encoded or not, with a Content-Length and chunked,
// each reach the upstream byte for byte (the SHA-256 it computes). A body
// the placeholder cannot read (empty, gzip, over 1 MiB, not JSON, a JSON
// array, a model that is not a string, number or boolean) gives "-", to
// the zone and to the header directive after it: such requests share one
// bucket of the per-model zone rather than escaping it.
func TestJSONPlaceholderBodies(t *testing.T) {
	up := startLLMUpstream(t)
	startCaddy(t, "", jsonSite("json-bodies", up.URL))
	kib, mib5 := chatBody(1<<10, "200"), chatBody(5<<20, "200") // model "m"
	text := bytes.Repeat([]byte("plain text "), 100)[:1<<10]
	for i, tc := range []struct {
		name    string
		body    []byte
		chunked bool
		ct, enc string
		model   string
	}{
		{name: "0 B", body: []byte{}, ct: "application/json", model: "-"},
		{name: "1 KiB JSON", body: kib, ct: "application/json", model: "m"},
		{name: "1 KiB JSON chunked", body: kib, chunked: true, ct: "application/json", model: "m"},
		{name: "1 KiB JSON+", body: kib, ct: "application/vnd.api+json; charset=utf-8", model: "m"},
		{name: "5 MiB JSON", body: mib5, ct: "application/json", model: "-"},
		{name: "5 MiB JSON chunked", body: mib5, chunked: true, ct: "application/json", model: "-"},
		{name: "1 KiB text", body: text, ct: "text/plain", model: "-"},
		{name: "1 KiB text chunked", body: text, chunked: true, ct: "text/plain", model: "-"},
		{name: "JSON as text", body: kib, ct: "text/plain", model: "-"},
		{name: "5 MiB text", body: bytes.Repeat(text, 5<<10), ct: "text/plain", model: "-"},
		{name: "gzip JSON", body: gzipped(kib), ct: "application/json", enc: "gzip", model: "-"},
		{name: "gzip JSON chunked", body: gzipped(kib), chunked: true, ct: "application/json", enc: "gzip", model: "-"},
		{name: "gzip 5 MiB JSON", body: gzipped(mib5), ct: "application/json", enc: "gzip", model: "-"},
		{name: "a JSON array", body: []byte(`[{"model":"m"}]`), ct: "application/json", model: "-"},
		{name: "not JSON", body: []byte(`{"model":"m",`), ct: "application/json", model: "-"},
		{name: "a model object", body: []byte(`{"model":{"id":"m"}}`), ct: "application/json", model: "-"},
		{name: "an empty model", body: []byte(`{"model":""}`), ct: "application/json", model: "-"},
		{name: "no model", body: []byte(`{"messages":[]}`), ct: "application/json", model: "-"},
		{name: "an escaped model", body: []byte(`{"model":"caf\u00e9 \"x\""}`), ct: "application/json", model: `café "x"`},
		{name: "a number", body: []byte(`{"model":4.0e1}`), ct: "application/json", model: "4.0e1"},
	} {
		// Each request its own key: every body passes, and its bucket
		// is its model's.
		header := []string{"X-Key", "bodies-" + strconv.Itoa(i), "Content-Type", tc.ct}
		if tc.enc != "" {
			header = append(header, "Content-Encoding", tc.enc)
		}
		code, h := postJSON(t, "/v1/chat/completions", tc.body, tc.chunked, header...)
		if code != 200 {
			t.Fatalf("%s: %d", tc.name, code)
		}
		if got, n := h.Get("X-Body-Sha256"), h.Get("X-Body-Length"); got != sha256Hex(tc.body) || n != strconv.Itoa(len(tc.body)) {
			t.Fatalf("%s: the upstream received %s bytes of SHA-256 %s, not the %d sent", tc.name, n, got, len(tc.body))
		}
		if got := h.Get("X-Model"); got != tc.model {
			t.Fatalf("%s: X-Model %q, want %q", tc.name, got, tc.model)
		}
	}

	// One key's unreadable bodies share the bucket of "-": three pass,
	// the fourth is refused, whatever model each body holds.
	for i, tc := range []struct {
		body []byte
		ct   string
		enc  string
	}{
		{gzipped([]byte(`{"model":"a"}`)), "application/json", "gzip"},
		{chatBody(2<<20, ""), "application/json", ""},
		{[]byte(`{"model":"c"}`), "text/plain", ""},
		{gzipped([]byte(`{"model":"d"}`)), "application/json", "gzip"},
	} {
		header := []string{"X-Key", "escape", "Content-Type", tc.ct}
		if tc.enc != "" {
			header = append(header, "Content-Encoding", tc.enc)
		}
		if code, _ := postJSON(t, "/v1/chat/completions", tc.body, i == 1, header...); code != []int{200, 200, 200, 429}[i] {
			t.Fatalf("unreadable body %d: %d", i+1, code)
		}
	}
	if code, _ := postJSON(t, "/v1/chat/completions", []byte(`{"model":"d"}`), false, "X-Key", "escape"); code != 200 {
		t.Fatalf("a readable body after: %d", code)
	}
}

// A handler whose config names no json placeholder (and has no estimate)
// reads nothing of the body; one that names one reads it once, before
// its decision, for an estimate too, and the next handler reads all of
// it, and the values.
func TestJSONPlaceholderReadsOnlyWhenNamed(t *testing.T) {
	body := chatBody(4<<10, "")
	for _, tc := range []struct {
		name, zone string
		read       bool
	}{
		{"none", `{"name":"json-read-none","key":"{http.request.header.X-Key}","rate":"10r/s"}`, false},
		{"key", `{"name":"json-read-key","key":"{http.rate_limit.json.model}","rate":"10r/s"}`, true},
		{"match", `{"name":"json-read-match","rate":"10r/s","match":[{"vars":{"{http.rate_limit.json.model}":["m"]}}]}`, true},
		{"cost", `{"name":"json-read-cost","rate":"10r/s","burst":10,"cost":"{http.rate_limit.json.n}"}`, true},
		// Read once for both: the estimate reserves n, 2.
		{"estimate", `{"name":"json-read-estimate","key":"{http.rate_limit.json.model}","rate":"10r/s","burst":1000,"estimate":{"json":["n"]}}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newTestHandler(t, `{"zones":[`+tc.zone+`]}`)
			c := &countingReader{r: bytes.NewReader(append(body[:len(body)-1:len(body)-1], `,"n":2}`...))}
			req, rr := postRequest("192.0.2.1", c, -1, "Content-Type", "application/json", "X-Key", "k")
			var before int64
			var got []byte
			var model string
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				before = c.n
				repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				model, _ = repl.GetString("http.rate_limit.json.model")
				var err error
				got, err = io.ReadAll(r.Body)
				return err
			})
			if err := h.ServeHTTP(rr, req, next); err != nil {
				t.Fatal(err)
			}
			want := len(body) + len(`,"n":2`)
			if tc.read != (before == int64(want)) || !tc.read && before != 0 {
				t.Fatalf("%d bytes read before the next handler, of %d", before, want)
			}
			if len(got) != want {
				t.Fatalf("the next handler read %d bytes, of %d", len(got), want)
			}
			if wantModel := map[bool]string{true: "m"}[tc.read && tc.name != "cost"]; model != wantModel {
				t.Fatalf("model %q, want %q", model, wantModel)
			}
			if left := remainingOf(t, rr.Header(), h.Zones[0].Name); tc.name == "estimate" && left != 998 {
				t.Fatalf("%d tokens left, want 998", left)
			}
		})
	}
}

// A zone named json, or json.<anything>, would make its placeholders
// those of the request's JSON body: refused at adapt with the file and
// line, and in JSON at validate; so is a json placeholder whose path has
// an empty key.
func TestJSONPlaceholderCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"zone json", "rate_limit {\n\tzone json {\n\t\trate 1r/s\n\t}\n}", `invalid name "json": {http.rate_limit.json.<path>}`, 2},
		{"zone json.x", "rate_limit {\n\tzone other {\n\t\trate 1r/s\n\t}\n\tzone json.spilled {\n\t\trate 1r/s\n\t}\n}", `invalid name "json.spilled"`, 5},
		{"an empty key", "rate_limit {\n\tzone a {\n\t\tkey {http.rate_limit.json.a..b}\n\t\trate 1r/s\n\t}\n}", "invalid placeholder {http.rate_limit.json.a..b}", 5},
		{"no path", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tmatch vars {http.rate_limit.json.} x\n\t}\n}", "invalid placeholder {http.rate_limit.json.}", 5},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
	checkValidate(t, `{"zones":[{"name":"json","rate":"1r/s"}]}`, `invalid name "json"`)
	checkValidate(t, `{"rate_limits":{"json.x":{"window":"1m","max_events":2}}}`, `invalid name "json.x"`)
	checkValidate(t, `{"zones":[{"name":"jsonx","key":"{http.rate_limit.json.a.}","rate":"1r/s"}]}`, "invalid placeholder {http.rate_limit.json.a.}")
	checkValidate(t, `{"zones":[{"name":"jsonx","key":"{http.rate_limit.json.a.b}","rate":"1r/s"}]}`, "")
}

// BenchmarkJSONPlaceholder is the allowed path of a zone keyed by the
// model in a chat completion request's JSON body of 1 KiB, with a
// Content-Length (the body read, the model found and set, the body given
// to the next handler, which reads it all), beside the same zone keyed
// by a header, whose handler reads no body: `benchstat -col /key`.
func BenchmarkJSONPlaceholder(b *testing.B) {
	body := chatBody(1<<10, "200")
	for _, tc := range []struct{ name, key string }{
		{"key=header", "{http.request.header.X-Model}"},
		{"key=json", "{http.rate_limit.json.model}"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := newTestHandler(b, `{"zones":[{"name":"bench-json-`+tc.name[4:]+`","key":"`+tc.key+`","rate":"1000000000r/s","burst":1000000000}]}`)
			h.logger = zap.NewNop()
			benchPosts(b, h, body, "Content-Type", "application/json", "X-Model", "m")
		})
	}
}
