// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// docs/gateway.md's config runs here as the page writes it, read from
// the page, so that the two cannot drift: only its site address and its
// upstreams' addresses are rewritten, to the test Caddy's port and to
// fake upstreams, an OpenAI-compatible primary and fallback and an MCP
// server. Each subtest checks a promise of the page.

// The addresses the page's config proxies to.
const (
	gatewayPrimary  = "127.0.0.1:9000"
	gatewayFallback = "127.0.0.1:9001"
	gatewayMCP      = "127.0.0.1:9002"
)

// gatewayCaddyfile is the config of docs/gateway.md, its one Caddyfile,
// proxying to the upstreams at primary, fallback and mcp and served on
// the test site.
func gatewayCaddyfile(t *testing.T, primary, fallback, mcp string) string {
	t.Helper()
	_, fences := readMarkdown(t, "docs/gateway.md")
	var configs []fence
	for _, f := range fences {
		if f.lang == "caddy" && !f.tagged("syntax") {
			configs = append(configs, f)
		}
	}
	if len(configs) != 1 {
		t.Fatalf("docs/gateway.md has %d Caddyfiles, want its one config (another needs its test here)", len(configs))
	}
	site := configs[0].body
	for _, r := range []struct{ from, to string }{
		{":8080 {\n", "http://localhost {\n"},
		{gatewayPrimary, primary},
		{gatewayFallback, fallback},
		{gatewayMCP, mcp},
	} {
		if !strings.Contains(site, r.from) {
			t.Fatalf("%s: no %q to rewrite for the test", configs[0], r.from)
		}
		site = strings.ReplaceAll(site, r.from, r.to)
	}
	return site
}

// fakeProvider is an OpenAI-compatible upstream: it answers a chat
// completion as JSON, or as a stream when the request says "stream":
// true, with the usage (total_tokens) that the query's usage gives, or
// none with usage=none. Its responses name it in X-Upstream.
type fakeProvider struct {
	*httptest.Server
	name     string
	requests atomic.Int64
	auth     atomic.Value // the Authorization of the last request
}

func startFakeProvider(t *testing.T, name string) *fakeProvider {
	p := &fakeProvider{name: name}
	p.Server = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.Close)
	return p
}

func (p *fakeProvider) serve(w http.ResponseWriter, r *http.Request) {
	p.requests.Add(1)
	p.auth.Store(r.Header.Get("Authorization"))
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	_ = json.NewDecoder(r.Body).Decode(&req)
	w.Header().Set("X-Upstream", p.name)
	var usage string
	if n := r.URL.Query().Get("usage"); n != "none" {
		usage = fmt.Sprintf(`"usage":{"prompt_tokens":0,"completion_tokens":%s,"total_tokens":%[1]s}`, n)
	}
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		if usage != "" {
			usage = "," + usage
		}
		fmt.Fprintf(w, `{"id":"c1","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]%s}`, req.Model, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	for i := range 3 {
		fmt.Fprintf(w, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}],\"usage\":null}\n\n", req.Model, i)
		_ = rc.Flush()
	}
	if usage != "" {
		fmt.Fprintf(w, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[],%s}\n\n", req.Model, usage)
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

// startFakeMCP is an MCP server of Streamable HTTP without a stream of
// its own (a GET is answered 405): a JSON-RPC request is answered with
// its result, a notification or a response with 202,
// and a batch (an array, which the 2025-03-26 revision allowed) with a
// result for each of its requests. It counts the requests it receives.
func startFakeMCP(t *testing.T, requests *atomic.Int64) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if r.Method != http.MethodPost {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		body, _ := io.ReadAll(r.Body)
		var msgs []map[string]any
		batch := json.Unmarshal(body, &msgs) == nil
		if !batch {
			var msg map[string]any
			if err := json.Unmarshal(body, &msg); err != nil {
				http.Error(w, "not JSON-RPC", http.StatusBadRequest)
				return
			}
			msgs = []map[string]any{msg}
		}
		var results []string
		for _, m := range msgs {
			if m["method"] != nil && m["id"] != nil {
				id, _ := json.Marshal(m["id"])
				results = append(results, fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"ok"}]}}`, id))
			}
		}
		if len(results) == 0 {
			w.WriteHeader(http.StatusAccepted)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if batch {
			fmt.Fprint(w, "["+strings.Join(results, ",")+"]")
			return
		}
		fmt.Fprint(w, results[0])
	}))
	t.Cleanup(s.Close)
	return s
}

// gatewayPost posts body to the test site's path as JSON, with the
// gateway key key (none when empty), and returns the status, the
// response's header and its body.
func gatewayPost(t *testing.T, path, key, body string) (int, http.Header, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, siteURL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: reading the body: %v", path, err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

// gatewayChatBody is a chat completion's request for model, stating maxTokens
// (none when 0), streamed when stream is set.
func gatewayChatBody(model string, maxTokens int, stream bool) string {
	b := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"Say hi."}]`, model)
	if maxTokens > 0 {
		b += fmt.Sprintf(`,"max_tokens":%d`, maxTokens)
	}
	if stream {
		b += `,"stream":true,"stream_options":{"include_usage":true}`
	}
	return b + "}"
}

// chat sends a chat completion of the consumer of key for model, stating
// maxTokens, whose response reports usage (a number, or "none").
func chat(t *testing.T, key, model string, maxTokens int, usage string, stream bool) (int, http.Header, string) {
	t.Helper()
	return gatewayPost(t, "/v1/chat/completions?usage="+usage, key, gatewayChatBody(model, maxTokens, stream))
}

// toolCall is a JSON-RPC tools/call of the tool.
func toolCall(tool string) string {
	return `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"` + tool + `","arguments":{"q":"caddy"}}}`
}

// untilRefused sends requests with send until one is refused (at most
// max), and returns how many went through before and the refusal's
// status, header and body. The bucket refills meanwhile: a caller allows
// the tokens that the time taken gave back (refilled).
func untilRefused(t *testing.T, max int, send func() (int, http.Header, string)) (passed int, code int, h http.Header, body string, took time.Duration) {
	t.Helper()
	start := time.Now()
	for passed = 0; passed < max; passed++ {
		if code, h, body = send(); code != http.StatusOK {
			return passed, code, h, body, time.Since(start)
		}
	}
	t.Fatalf("%d requests went through, none refused", max)
	return
}

// refilled is how many tokens a bucket that gains one every interval
// may have gained in d, and one for the token in progress.
func refilled(d, interval time.Duration) int { return int(d/interval) + 1 }

// wantRefusal checks a 429 of the page's config: a Retry-After, the
// zone's item in RateLimit, and the JSON error body of its handle_errors
// naming the zone.
func wantRefusal(t *testing.T, what string, code int, h http.Header, body, zone string) int {
	t.Helper()
	if code != http.StatusTooManyRequests {
		t.Fatalf("%s: %d %q, want 429", what, code, body)
	}
	retry, err := strconv.Atoi(h.Get("Retry-After"))
	if err != nil || retry < 1 {
		t.Fatalf("%s: Retry-After %q, want whole seconds", what, h.Get("Retry-After"))
	}
	var e struct {
		Error struct{ Code, Message string }
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Code != "rate_limit_exceeded" ||
		e.Error.Message != fmt.Sprintf("%s: retry in %ds", zone, retry) || h.Get("Content-Type") != "application/json" {
		t.Fatalf("%s: body %q (%s), want the JSON error of zone %s", what, body, h.Get("Content-Type"), zone)
	}
	if !strings.Contains(h.Get("RateLimit"), `"`+zone+`";r=`) {
		t.Fatalf("%s: RateLimit %q has no item of %s", what, h.Get("RateLimit"), zone)
	}
	return retry
}

// tokensOf is what the admin API says a key's bucket holds.
func tokensOf(t *testing.T, zone, key string) float64 {
	t.Helper()
	v, _ := adminKeyAt(t, adminAddr, zone, key)["tokens"].(float64)
	return v
}

// TestGateway runs docs/gateway.md's config through a real Caddy, with
// fake upstreams, and checks what the page promises.
func TestGateway(t *testing.T) {
	t.Setenv("OPENAI_API_KEY", "sk-primary")
	t.Setenv("FALLBACK_API_KEY", "sk-fallback")
	primary, fallback := startFakeProvider(t, "primary"), startFakeProvider(t, "fallback")
	var mcpRequests atomic.Int64
	mcp := startFakeMCP(t, &mcpRequests)
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	tester := startCaddy(t, "", gatewayCaddyfile(t, host(primary.Server), host(fallback.Server), host(mcp)))
	usageOf := func(m map[string]float64, metric, zone string) float64 {
		return m[fmt.Sprintf(`caddy_rate_limit_%s{zone=%q}`, metric, zone)]
	}
	// settled waits until zone has been charged want tokens of usage
	// since base.
	settled := func(t *testing.T, base map[string]float64, zone string, want float64) {
		t.Helper()
		var got float64
		eventually(5*time.Second, func() bool {
			got = usageOf(scrape(t, tester), "usage_total", zone) - usageOf(base, "usage_total", zone)
			return got >= want
		})
		if got != want {
			t.Fatalf("%s was charged %v tokens of usage, want %v", zone, got, want)
		}
	}

	t.Run("anonymous", func(t *testing.T) {
		before := primary.requests.Load() + mcpRequests.Load()
		for _, key := range []string{"", "sk-gw-mallory"} {
			if code, _, _ := chat(t, key, "gpt-4o", 10, "10", false); code != http.StatusUnauthorized {
				t.Errorf("chat with key %q: %d, want 401", key, code)
			}
			if code, _, _ := gatewayPost(t, "/mcp", key, toolCall("web_search")); code != http.StatusUnauthorized {
				t.Errorf("MCP with key %q: %d, want 401", key, code)
			}
		}
		if n := primary.requests.Load() + mcpRequests.Load() - before; n != 0 {
			t.Errorf("%d requests without a known key reached an upstream", n)
		}
	})

	// A consumer's tokens: 15,000 used of a burst of 20,000 leave about
	// 5,000, so a request stating max_tokens 10,000 is refused with the
	// wait for the rest (about 5,000 tokens at 100,000/h: 180 s), and one
	// stating 1,000 passes. The provider sees its own key, never the
	// consumer's.
	t.Run("tokens per key", func(t *testing.T) {
		resetBucket(t, "per_key", "alice")
		resetBucket(t, "per_model", "alice/gpt-4o")
		resetBucket(t, "provider", "gpt-4o")
		base := scrape(t, tester)
		code, h, body := chat(t, "sk-gw-alice", "gpt-4o", 15000, "15000", false)
		if code != 200 || h.Get("X-Upstream") != "primary" || !strings.Contains(body, `"total_tokens":15000`) {
			t.Fatalf("first: %d, upstream %q, %q", code, h.Get("X-Upstream"), body)
		}
		if auth := primary.auth.Load(); auth != "Bearer sk-primary" {
			t.Fatalf("the primary received Authorization %q, want the gateway's own key", auth)
		}
		settled(t, base, "per_key", 15000)
		code, h, body = chat(t, "sk-gw-alice", "gpt-4o", 10000, "10000", false)
		if retry := wantRefusal(t, "max_tokens 10000 with 5000 left", code, h, body, "per_key"); retry < 150 || retry > 200 {
			t.Fatalf("Retry-After %d, want about 180 (5,000 tokens at 100,000/h)", retry)
		}
		if code, _, body := chat(t, "sk-gw-alice", "gpt-4o", 1000, "800", false); code != 200 {
			t.Fatalf("max_tokens 1000 with 5000 left: %d %q", code, body)
		}
		settled(t, base, "per_key", 15000+800)
	})

	// The monthly quota counts the usage too: a response that reports 5
	// million tokens spends the month's, and the next request is
	// refused until the month ends.
	t.Run("monthly quota", func(t *testing.T) {
		resetBucket(t, "per_key", "bob")
		resetBucket(t, "provider", "gpt-4o-mini")
		base := scrape(t, tester)
		if code, _, body := chat(t, "sk-gw-bob", "gpt-4o-mini", 100, "5000000", false); code != 200 {
			t.Fatalf("first: %d %q", code, body)
		}
		settled(t, base, "per_key", 5000000)
		code, h, body := chat(t, "sk-gw-bob", "gpt-4o-mini", 100, "100", false)
		retry := wantRefusal(t, "after 5 million tokens", code, h, body, "per_key")
		now := time.Now().UTC()
		monthEnd := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
		if left := monthEnd.Sub(now).Seconds(); left > 3600 && math.Abs(float64(retry)-left) > 10 {
			t.Fatalf("Retry-After %d, want the %.0f s until the month ends", retry, left)
		}
		quota, _ := adminKeyAt(t, adminAddr, "per_key", "bob")["quota"].(map[string]any)
		if quota["left"] != 0.0 || quota["used"].(float64) < 5000000 {
			t.Fatalf("the admin API's quota of bob: %v, want nothing left", quota)
		}
		resetBucket(t, "per_key", "bob")
		resetBucket(t, "provider", "gpt-4o-mini")
	})

	// Each model of a consumer has its bucket of requests: 10 at once,
	// then one every 3 s; the next to that model is refused while
	// another model passes.
	t.Run("requests per model", func(t *testing.T) {
		resetBucket(t, "per_key", "alice")
		resetBucket(t, "per_model", "alice/gpt-4o")
		resetBucket(t, "per_model", "alice/o3")
		base := scrape(t, tester)
		passed, code, h, body, took := untilRefused(t, 40, func() (int, http.Header, string) {
			return chat(t, "sk-gw-alice", "gpt-4o", 10, "10", false)
		})
		if passed < 10 || passed > 10+refilled(took, 3*time.Second) {
			t.Fatalf("%d requests to gpt-4o went through in %v, want 10 and what refilled", passed, took)
		}
		wantRefusal(t, "gpt-4o over its limit", code, h, body, "per_model")
		code, h, body = chat(t, "sk-gw-alice", "o3", 10, "10", false)
		if code != 200 || remainingOf(t, h, "per_model") != 9 {
			t.Fatalf("o3 after gpt-4o's 429: %d %q, RateLimit %q", code, body, h.Get("RateLimit"))
		}
		// Every response settled, before the next subtest counts.
		settled(t, base, "per_key", float64(10*(passed+1)))
		settled(t, base, "provider", float64(10*(passed+1)))
	})

	// When the primary's tokens of a model are spent (a response of 2
	// million tokens, twice its minute), that model's requests go to the
	// fallback, with its key, charged to the consumer as any; other
	// models still go to the primary.
	t.Run("spill to the fallback", func(t *testing.T) {
		for _, k := range []string{"alice", "bob"} {
			resetBucket(t, "per_key", k)
			resetBucket(t, "per_model", k+"/gpt-4.1")
			resetBucket(t, "per_model", k+"/gpt-4o")
		}
		resetBucket(t, "provider", "gpt-4.1")
		resetBucket(t, "provider", "gpt-4o")
		base := scrape(t, tester)
		if code, h, body := chat(t, "sk-gw-alice", "gpt-4.1", 100, "2000000", false); code != 200 || h.Get("X-Upstream") != "primary" {
			t.Fatalf("first: %d, upstream %q, %q", code, h.Get("X-Upstream"), body)
		}
		settled(t, base, "provider", 2000000)
		code, h, body := chat(t, "sk-gw-bob", "gpt-4.1", 100, "50", false)
		if code != 200 || h.Get("X-Upstream") != "fallback" || h.Get("Retry-After") != "" || remainingOf(t, h, "provider") != 0 || remainingOf(t, h, "per_model") != 9 {
			t.Fatalf("gpt-4.1 with the primary's minute spent: %d, upstream %q, Retry-After %q, RateLimit %q (%q); want the fallback",
				code, h.Get("X-Upstream"), h.Get("Retry-After"), h.Get("RateLimit"), body)
		}
		if auth := fallback.auth.Load(); auth != "Bearer sk-fallback" {
			t.Fatalf("the fallback received Authorization %q, want its own key", auth)
		}
		if code, h, body := chat(t, "sk-gw-bob", "gpt-4o", 100, "60", false); code != 200 || h.Get("X-Upstream") != "primary" {
			t.Fatalf("gpt-4o: %d, upstream %q, %q; want the primary", code, h.Get("X-Upstream"), body)
		}
		// The consumer pays for the fallback's answer; the primary's
		// zone is not charged for it.
		settled(t, base, "per_key", 2000000+50+60)
		settled(t, base, "provider", 2000000+60)
		m := scrape(t, tester)
		spilled := `caddy_rate_limit_requests_total{result="spilled",zone="provider"}`
		wantMetric(t, m, spilled, base[spilled]+1)
		resetBucket(t, "provider", "gpt-4.1")
	})

	// Production's reserve of the primary: bob, of no tier, is of the
	// lowest class, which may take a model's minute down to its last
	// 200,000 tokens, production's 20%; beyond, bob's requests go to the
	// fallback while alice's, production's, still go to the primary.
	// Each class reads its own part in provider's policy: 800,000
	// tokens, 48 s of the minute, for bob; 1,000,000 for alice. What the
	// bucket refills meanwhile (16,667 tokens a second) only helps alice:
	// bob's refusal holds for 8 s after his first request.
	t.Run("reserve for production", func(t *testing.T) {
		for _, k := range []string{"alice", "bob"} {
			resetBucket(t, "per_key", k)
			resetBucket(t, "per_model", k+"/gpt-4o")
		}
		resetBucket(t, "provider", "gpt-4o")
		base := scrape(t, tester)
		start := time.Now()
		// bob reserves 790,000 and his prompt's part of the 800,000 his
		// class may take, and uses 790,000.
		code, h, body := chat(t, "sk-gw-bob", "gpt-4o", 790000, "790000", false)
		if code != 200 || h.Get("X-Upstream") != "primary" {
			t.Fatalf("bob's first: %d, upstream %q, %q", code, h.Get("X-Upstream"), body)
		}
		if p := h.Get("RateLimit-Policy"); !strings.Contains(p, `"provider";q=800000;w=48`) {
			t.Fatalf("bob's RateLimit-Policy %q, want provider's q=800000;w=48: the lowest class's part", p)
		}
		left := 800000 - 790000 - int(math.Ceil(float64(len(gatewayChatBody("gpt-4o", 790000, false)))/4))
		if r := remainingOf(t, h, "provider"); r < left || r > left+int(time.Since(start).Seconds()*1000000/60)+1 {
			t.Fatalf("bob's provider r=%d, want %d and what refilled", r, left)
		}
		settled(t, base, "provider", 790000)
		// That usage spent bob's own tokens and more: only provider
		// decides below.
		resetBucket(t, "per_key", "bob")

		// The admin API tells each class's part of the one bucket.
		classes, _ := adminKeyAt(t, adminAddr, "provider", "gpt-4o")["classes"].([]any)
		if len(classes) != 2 {
			t.Fatalf("provider's gpt-4o: classes %v, want production and other", classes)
		}
		prod, _ := classes[0].(map[string]any)
		other, _ := classes[1].(map[string]any)
		if prod["class"] != "production" || prod["capacity"] != 1000000.0 || other["class"] != "other" || other["capacity"] != 800000.0 ||
			prod["remaining"].(float64)-other["remaining"].(float64) != 200000 || other["remaining"].(float64) < 10000 {
			t.Fatalf("provider's gpt-4o: classes %v, want production 1,000,000 at most and other 800,000, 200,000 apart, other about 10,000 now", classes)
		}

		code, h, body = chat(t, "sk-gw-bob", "gpt-4o", 150000, "50", false)
		if took := time.Since(start); took > 8*time.Second {
			t.Skipf("bob's requests took %v: the bucket may have refilled past the reserve", took)
		}
		if code != 200 || h.Get("X-Upstream") != "fallback" || h.Get("Retry-After") != "" || remainingOf(t, h, "provider") >= 150000 {
			t.Fatalf("bob's 150,000 with about 10,000 left to his class: %d, upstream %q, Retry-After %q, RateLimit %q (%q); want the fallback",
				code, h.Get("X-Upstream"), h.Get("Retry-After"), h.Get("RateLimit"), body)
		}
		code, h, body = chat(t, "sk-gw-alice", "gpt-4o", 150000, "1000", false)
		if code != 200 || h.Get("X-Upstream") != "primary" || !strings.Contains(h.Get("RateLimit-Policy"), `"provider";q=1000000;w=60`) {
			t.Fatalf("alice's 150,000 with about 210,000 left: %d, upstream %q, RateLimit-Policy %q (%q); want the primary and the whole burst",
				code, h.Get("X-Upstream"), h.Get("RateLimit-Policy"), body)
		}
		settled(t, base, "provider", 790000+1000)
		m := scrape(t, tester)
		spilled := `caddy_rate_limit_requests_total{result="spilled",zone="provider"}`
		wantMetric(t, m, spilled, base[spilled]+1)
		for _, k := range []string{"alice", "bob"} {
			resetBucket(t, "per_key", k)
		}
		resetBucket(t, "provider", "gpt-4o")
	})

	// A stream's usage is its last event's; a stream without one (the
	// client did not ask for stream_options.include_usage) keeps what
	// its request reserved: max_tokens and the prompt's part.
	t.Run("streams", func(t *testing.T) {
		resetBucket(t, "per_key", "alice")
		resetBucket(t, "per_model", "alice/gpt-4o")
		resetBucket(t, "provider", "gpt-4o")
		base := scrape(t, tester)
		start := time.Now()
		code, h, body := chat(t, "sk-gw-alice", "gpt-4o", 5000, "3000", true)
		if code != 200 || h.Get("Content-Type") != "text/event-stream" || !strings.HasSuffix(body, "data: [DONE]\n\n") || !strings.Contains(body, `"total_tokens":3000`) {
			t.Fatalf("stream: %d %s %q", code, h.Get("Content-Type"), body)
		}
		settled(t, base, "per_key", 3000)
		plain := gatewayChatBody("gpt-4o", 5000, false) // what a client that does not ask for the usage sends
		plain = strings.Replace(plain, `"max_tokens":5000`, `"max_tokens":5000,"stream":true`, 1)
		code, _, body = gatewayPost(t, "/v1/chat/completions?usage=none", "sk-gw-alice", plain)
		if code != 200 || strings.Contains(body, "total_tokens") {
			t.Fatalf("stream without usage: %d %q", code, body)
		}
		missing := `caddy_rate_limit_usage_missing_total{zone="per_key"}`
		if !eventually(5*time.Second, func() bool { return scrape(t, tester)[missing] == base[missing]+1 }) {
			t.Fatalf("%s did not count the stream without usage", missing)
		}
		reserved := 5000 + math.Ceil(float64(len(plain))/4)
		lo := 20000 - 3000 - reserved
		hi := lo + time.Since(start).Seconds()*100000/3600 + 1
		if tokens := tokensOf(t, "per_key", "alice"); tokens < lo || tokens > hi {
			t.Fatalf("alice holds %v tokens, want %v to %v: 3,000 used, and the stream without usage keeps its %v", tokens, lo, hi, reserved)
		}
	})

	// MCP: each tool of a consumer has its bucket (5 calls at once, then
	// one every 6 s); other messages are counted per consumer only; a
	// batch is refused before the server.
	t.Run("MCP tools", func(t *testing.T) {
		for _, k := range []string{"bob/web_search", "bob/read_file"} {
			resetBucket(t, "per_tool", k)
		}
		resetBucket(t, "mcp_messages", "bob")
		passed, code, h, body, took := untilRefused(t, 30, func() (int, http.Header, string) {
			return gatewayPost(t, "/mcp", "sk-gw-bob", toolCall("web_search"))
		})
		if passed < 5 || passed > 5+refilled(took, 6*time.Second) {
			t.Fatalf("%d calls of web_search went through in %v, want 5 and what refilled", passed, took)
		}
		wantRefusal(t, "web_search over its limit", code, h, body, "per_tool")
		code, h, body = gatewayPost(t, "/mcp", "sk-gw-bob", toolCall("read_file"))
		if code != 200 || !strings.Contains(body, `"result"`) || remainingOf(t, h, "per_tool") != 4 {
			t.Fatalf("read_file after web_search's 429: %d %q, RateLimit %q", code, body, h.Get("RateLimit"))
		}
		for i := range 3 {
			code, h, body := gatewayPost(t, "/mcp", "sk-gw-bob", `{"jsonrpc":"2.0","id":2,"method":"tools/list"}`)
			if code != 200 || strings.Contains(h.Get("RateLimit"), "per_tool") || !strings.Contains(h.Get("RateLimit"), `"mcp_messages"`) {
				t.Fatalf("tools/list %d: %d %q, RateLimit %q; want mcp_messages only", i, code, body, h.Get("RateLimit"))
			}
		}
		// A response to the server's request has no method: it passes.
		if code, _, body := gatewayPost(t, "/mcp", "sk-gw-bob", `{"jsonrpc":"2.0","id":"s1","result":{}}`); code != http.StatusAccepted {
			t.Fatalf("a response: %d %q, want the server's 202", code, body)
		}
		// GET, the server's stream, has no body: no zone applies.
		req, _ := http.NewRequest(http.MethodGet, siteURL+"/mcp", nil)
		req.Header.Set("Authorization", "Bearer sk-gw-bob")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("RateLimit") != "" {
			t.Fatalf("GET: %d, RateLimit %q; want the server's 405 and no zone", resp.StatusCode, resp.Header.Get("RateLimit"))
		}
		before := mcpRequests.Load()
		batch := "[" + toolCall("web_search") + "," + toolCall("web_search") + "]"
		if code, _, body := gatewayPost(t, "/mcp", "sk-gw-bob", batch); code != http.StatusBadRequest {
			t.Fatalf("a batch: %d %q, want 400", code, body)
		}
		if n := mcpRequests.Load() - before; n != 0 {
			t.Fatalf("a batch reached the MCP server")
		}
	})
}
