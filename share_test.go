// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestShareCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, input, wantErr string
		line                 int
	}{
		{"not a duration", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare soon\n\t}\n\tstore redis\n}", "invalid share 'soon': expected a duration such as 1s", 4},
		{"too short", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1ms\n\t}\n\tstore redis\n}", "invalid share 1ms: must be 10ms to 10m", 4},
		{"too long", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1h\n\t}\n\tstore redis\n}", "invalid share 1h0m0s: must be 10ms to 10m", 4},
		{"on the local store", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1s\n\t}\n}", "zone a: share needs the Redis store", 6},
		{"with sync", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1s\n\t\tsync 100ms\n\t}\n\tstore redis\n}", "zone a: share and sync exclude each other", 6},
		{"with ban", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1s\n\t\tban 1m\n\t}\n\tstore redis\n}", "zone a: share cannot go with ban", 6},
		{"with usage", "rate_limit {\n\tzone a {\n\t\trate 1r/s\n\t\tshare 1s\n\t\tusage header X-Used\n\t}\n\tstore redis\n}", "zone a: share cannot go with usage", 6},
		{"with plans", "rate_limit {\n\tzone a {\n\t\trate {http.request.header.X-Rate}\n\t\tburst 10\n\t\tshare 1s\n\t}\n\tstore redis\n}", "zone a: share needs a fixed limit", 6},
		{"without a rate", "rate_limit {\n\tzone a {\n\t\tconcurrency 4\n\t\tshare 1s\n\t}\n\tstore redis\n}", "zone a: share", 5},
	} {
		t.Run(tc.name, func(t *testing.T) { checkCaddyfileError(t, tc.input, tc.wantErr, tc.line) })
	}
}

func TestShareValidate(t *testing.T) {
	const redis = `"store":{"backend":"redis"}`
	for _, tc := range []struct {
		name, json, wantErr string
	}{
		{"ok", `{"zones":[{"name":"a","rate":"1r/s","share":"1s"}],` + redis + `}`, ""},
		{"with estimate", `{"zones":[{"name":"a","rate":"1000r/m","burst":"1000","share":"1s","estimate":{"json":["max_tokens"]}}],` + redis + `}`, ""},
		{"local store", `{"zones":[{"name":"a","rate":"1r/s","share":"1s"}]}`, "zone a: share needs the Redis store"},
		{"too short", `{"zones":[{"name":"a","rate":"1r/s","share":"5ms"}],` + redis + `}`, "invalid share 5ms: must be 10ms to 10m"},
		{"count", `{"zones":[{"name":"a","rate":"1r/s","count":{"status_code":[401]},"share":"1s"}],` + redis + `}`, "share cannot go with count"},
		{"quota", `{"zones":[{"name":"a","rate":"1r/s","quota":10,"quota_period":"day","share":"1s"}],` + redis + `}`, "share cannot go with quota"},
		{"delay", `{"zones":[{"name":"a","rate":"1r/s","delay":"1s","share":"1s"}],` + redis + `}`, "share cannot go with delay"},
	} {
		t.Run(tc.name, func(t *testing.T) { checkValidate(t, tc.json, tc.wantErr) })
	}
}

// shareSites is a Caddy site with three instances of a zone with share
// (each its own store, as three Caddy instances would have) at /a, /b
// and /c, and an exact zone of the same limit at /e.
func shareSites(addr, limit string) string {
	var out strings.Builder
	out.WriteString("http://localhost {\n")
	for i := range 3 {
		fmt.Fprintf(&out, `	handle /%c {
		rate_limit {
			zone s {
				key {http.request.header.X-Key}
				%s
				share 1s
			}
			store redis {
				address %s
				timeout 5s
				key_prefix t:
				pool_size %d
			}
		}
		respond "ok"
	}
`, 'a'+i, limit, addr, 10+i)
	}
	fmt.Fprintf(&out, `	handle /e {
		rate_limit {
			zone e {
				key {http.request.header.X-Key}
				%s
			}
			store redis {
				address %s
				timeout 5s
				key_prefix t:
			}
		}
		respond "ok"
	}
}
`, limit, addr)
	return out.String()
}

// Through Caddy: one key flooded round robin on three instances is
// allowed no more than one exact bucket's burst and refill, and about
// what the exact zone allows beside it; busy, it is decided mostly
// here; the metrics say so; a key's own limit is refused in the zone.
func TestShareThroughCaddy(t *testing.T) {
	r := startRedis(t)
	tester := startCaddy(t, "", shareSites(r.Addr(), "rate 20r/s\n\t\t\t\tburst 40"))
	send := func(path string) int { return sendKey(t, tester, path, "k") }
	allowed, exact := 0, 0
	start := time.Now()
	for i := 0; time.Since(start) < 2*time.Second; i++ {
		if send([]string{"a", "b", "c"}[i%3]) == http.StatusOK {
			allowed++
		}
		if send("e") == http.StatusOK {
			exact++
		}
	}
	elapsed := time.Since(start)
	bound := 40 + int(20*elapsed.Seconds()) + 1
	t.Logf("allowed %d, exact %d, bound %d", allowed, exact, bound)
	if allowed > bound || allowed < exact*9/10 {
		t.Errorf("allowed %d in %v, want %d to %d (exact %d)", allowed, elapsed, exact*9/10, bound, exact)
	}

	// A refusal says when the shared bucket will hold a request again, and
	// what is left. A loaded machine's slow answers can leave a token's
	// refill (50ms) between the flood and the next request: requests go
	// until one is refused.
	var resp *http.Response
	for range 10 {
		req, _ := http.NewRequest(http.MethodGet, siteURL+"/a", nil)
		req.Header.Set("X-Key", "k")
		var err error
		if resp, err = tester.Client.Do(req); err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			break
		}
	}
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" || !strings.Contains(resp.Header.Get("RateLimit"), `"s";r=0`) {
		t.Errorf("a request of the flooded key: %d, Retry-After %q, RateLimit %q; want 429 with both", resp.StatusCode, resp.Header.Get("Retry-After"), resp.Header.Get("RateLimit"))
	}

	// A busy key at a high rate: decided here, from shares.
	reload(t, tester, "", shareSites(r.Addr(), "rate 100000r/s\n\t\t\t\tburst 100000"))
	for i := range 600 {
		if got := sendKey(t, tester, []string{"a", "b", "c"}[i%3], "0"); got != http.StatusOK {
			t.Fatalf("request %d: %d", i, got)
		}
	}
	m := scrape(t, tester)
	here, redis := m[`caddy_rate_limit_share_decisions_total{limit="100000r/s burst 100000",where="here",zone="s"}`],
		m[`caddy_rate_limit_share_decisions_total{limit="100000r/s burst 100000",where="redis",zone="s"}`]
	if here < 500 || m[`caddy_rate_limit_share_grants_total{limit="100000r/s burst 100000",zone="s"}`] == 0 {
		t.Errorf("600 requests: %v decided here, %v by Redis, %v grants; want most here", here, redis,
			m[`caddy_rate_limit_share_grants_total{limit="100000r/s burst 100000",zone="s"}`])
	}

	// The admin API shows the key's shares: busy on three instances, the
	// one that answers holds one, and the bucket's tokens leave room for
	// all of them. A share goes back once its key is idle for a quarter
	// of its ttl, which a loaded machine's slow answers can make of the
	// time before the GET: each GET follows a few more requests, until
	// one finds the share.
	var got []byte
	for attempt := 0; ; attempt++ {
		for i := range 30 {
			sendKey(t, tester, []string{"a", "b", "c"}[i%3], "0")
		}
		resp, err := http.Get("http://" + adminAddr + "/rate_limit/s/0")
		if err != nil {
			t.Fatal(err)
		}
		var view struct {
			Tokens float64       `json:"tokens"`
			Share  *shareKeyView `json:"share"`
		}
		got, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err := json.Unmarshal(got, &view); err != nil || view.Share == nil {
			t.Fatalf("GET of a key: %v, %s", err, got)
		}
		sh := view.Share
		if view.Tokens+sh.Out > 100000 {
			t.Fatalf("GET of a busy key: %s; want tokens + out at most the burst", got)
		}
		if sh.Holders > 0 && sh.Out > 0 && sh.Here > 0 && sh.EndsIn > 0 {
			break
		}
		if attempt == 10 {
			t.Fatalf("GET of a busy key, after 10 rounds of requests: %s; want this instance's share among the holders", got)
		}
	}

	req, _ := http.NewRequest(http.MethodPut, "http://"+adminAddr+"/rate_limit/s/0/limit", strings.NewReader(`{"rate":"1r/s","burst":1}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict || !strings.Contains(string(body), "share") {
		t.Errorf("PUT of a key's own limit in a zone with share: %d %s, want 409 saying why", resp.StatusCode, body)
	}
}

// An instance killed with -9 while it holds a share: within the share's
// ttl and a second, Redis has written it off and the other instance sees
// nothing out; the cluster admitted no more than one exact bucket, and
// lost no more than that share.
func TestShareDeadHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	r := startRedis(t)
	bin, _ := buildCaddy(t)
	site := fmt.Sprintf(`	rate_limit {
		zone s {
			key {http.request.header.X-Key}
			rate 10r/s
			burst 40
			share 1s
		}
		store redis {
			address %s
			timeout 5s
		}
	}
	respond "ok"`, r.Addr())
	a, b := startCaddyProcess(t, bin, site), startCaddyProcess(t, bin, site)
	client := &http.Client{Timeout: 10 * time.Second}
	get := func(c *faultCaddy) (int, bool) {
		req, _ := http.NewRequest(http.MethodGet, c.url, nil)
		req.Header.Set("X-Key", "k")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.StatusCode == http.StatusOK
	}
	shares := func(c *faultCaddy) shareKeyView {
		resp, err := client.Get("http://" + c.admin + "/rate_limit/s/k")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v struct{ Share shareKeyView }
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatal(err)
		}
		return v.Share
	}

	start := time.Now()
	for i := range 12 {
		if code, ok := get(a); !ok {
			t.Fatalf("request %d to a: %d", i, code)
		}
	}
	held := shares(a)
	if held.Here <= 0 || held.Here > 10 {
		t.Fatalf("a's share after 12 requests: %+v, want one of at most a quarter of the burst", held)
	}
	if err := syscall.Kill(a.pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	waitFor(t, 5*time.Second, "the dead share written off", func() bool { return shares(b).Holders == 0 })
	if d := time.Since(killed); d > 2*time.Second+500*time.Millisecond {
		t.Errorf("the dead share was out %v after the kill, want within its ttl and a second", d)
	}
	admitted := 12
	for {
		if _, ok := get(b); !ok {
			break
		}
		admitted++
	}
	span := time.Since(start).Seconds()
	bound := 40 + 10*span
	t.Logf("admitted %d in %.2fs (exact bound %.1f); a's share held %.0f", admitted, span, bound, held.Here)
	if float64(admitted) > bound+1 {
		t.Errorf("admitted %d in %.2fs, over the exact bound %.1f", admitted, span, bound)
	}
	if float64(admitted) < bound-held.Out-10 {
		t.Errorf("admitted %d in %.2fs, want at least the exact bound %.1f less the dead share's %.0f", admitted, span, bound, held.Out)
	}
}
