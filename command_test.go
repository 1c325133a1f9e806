// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The caddy rate-limit command against a real Caddy built from
// ./cmd/caddy: its tables and JSON, its exit codes for an unknown zone,
// an admin API that cannot be reached and a mistyped subcommand; a key's own limit of the
// local store across a restart; and zones and keys named . and .. .
func TestRateLimitCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs Caddy")
	}
	bin, dir := buildCaddy(t)
	admin, port := freePort(t, 0), freePort(t, 0)
	config := writeFile(t, dir, "Caddyfile", binaryGlobal(admin, port, dir)+fmt.Sprintf(`
http://127.0.0.1:%d {
	rate_limit {
		zone cmd {
			key {http.request.header.X-Key}
			rate 1r/m
			burst 2
		}
		zone cmd_reserve {
			key {http.request.header.X-Reserve-Key} # none: the zone does not apply
			rate 1r/h
			burst 10
			priority {http.request.header.X-Class}
			reserve high 30%%
		}
		zone . {
			key {http.request.header.X-Key}
			rate 1r/m
			burst 100
		}
		zone .. {
			key {http.request.header.X-Key}
			rate 1r/m
			burst 100
		}
		store local {
			persist_interval 200ms
		}
	}
	respond "ok"
}
`, port))
	env := append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+filepath.Join(dir, "data"), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"))
	address := fmt.Sprintf("localhost:%d", admin)
	start := func() *exec.Cmd {
		t.Helper()
		cmd := exec.Command(bin, "run", "--config", config, "--adapter", "caddyfile")
		cmd.Env = env
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		ready := make(chan struct{})
		go func() {
			sc := bufio.NewScanner(stderr)
			said := false
			for sc.Scan() {
				if !said && strings.Contains(sc.Text(), "serving initial configuration") {
					said = true
					close(ready)
				}
			}
			_, _ = io.Copy(io.Discard, stderr)
		}()
		select {
		case <-ready:
		case <-time.After(time.Minute):
			t.Fatal("Caddy did not start within a minute")
		}
		return cmd
	}
	// runIn runs caddy rate-limit with args in the directory wd (the
	// test's when ""), and returns its output, its error output and its
	// exit code.
	runIn := func(wd string, args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, append([]string{"rate-limit"}, args...)...)
		cmd.Env, cmd.Dir = env, wd
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatal(err)
		}
		return out.String(), errOut.String(), cmd.ProcessState.ExitCode()
	}
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return runIn("", args...)
	}
	ok := func(args ...string) string {
		t.Helper()
		out, errOut, code := run(append(args, "--address", address)...)
		if code != 0 {
			t.Fatalf("caddy rate-limit %s: exit %d: %s", strings.Join(args, " "), code, errOut)
		}
		return out
	}
	status := func(key string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
		req.Header.Set("X-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	spend := func(key string, want int) {
		t.Helper()
		if code := status(key); code != want {
			t.Fatalf("a request of %s: %d, want %d", key, code, want)
		}
	}

	caddy := start()
	if out := ok("zones"); !strings.Contains(out, "ZONE") || !strings.Contains(out, "cmd") || !strings.Contains(out, "1r/m burst 2") {
		t.Fatalf("zones:\n%s", out)
	}
	// Without --address, in a directory whose Caddyfile has the admin
	// address, as caddy reload finds it.
	if out, errOut, code := runIn(dir, "zones"); code != 0 || !strings.Contains(out, "1r/m burst 2") {
		t.Fatalf("zones in the Caddyfile's directory, without --address: exit %d: %s%s", code, out, errOut)
	}
	if out := ok("limit", "cmd", "alice", "--burst", "5", "--for", "1h"); !strings.Contains(out, "burst") || !strings.Contains(out, "5") {
		t.Fatalf("limit:\n%s", out)
	}
	// Three of her five tokens spent; at 1r/m, a token comes back a
	// minute after: what she holds is 2 and what the time since the
	// spending gave back, which on a loaded machine can be much of a
	// minute.
	spent := time.Now()
	for range 3 {
		spend("alice", 200)
	}
	holds := func() float64 { return 2 + time.Since(spent).Minutes() }
	out := ok("get", "cmd", "alice")
	if !strings.Contains(out, "override.burst") || !strings.Contains(out, "override.rate") {
		t.Fatalf("get: no own limit in\n%s", out)
	}
	t.Logf("caddy rate-limit get cmd alice:\n%s", out)
	var got struct {
		Tokens   float64 `json:"tokens"`
		Override struct {
			Burst     int64   `json:"burst"`
			ExpiresIn float64 `json:"expires_in"`
		} `json:"override"`
	}
	if err := json.Unmarshal([]byte(ok("get", "cmd", "alice", "--json")), &got); err != nil || got.Override.Burst != 5 || got.Tokens < 2 || got.Tokens > holds() {
		t.Fatalf("get --json: %+v, %v; want alice's own burst of 5, 2 tokens and what %v gave back", got, err, time.Since(spent))
	}
	// A zone with reserves: each class's tokens, now and at most, from
	// the highest class, after two requests of the lowest (at 1r/h, a
	// token comes back in an hour).
	for range 2 {
		req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
		req.Header.Set("X-Reserve-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("a request of the lowest class: %d", resp.StatusCode)
		}
	}
	out = ok("get", "cmd_reserve", "k")
	var classes []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "classes") {
			classes = append(classes, strings.Join(strings.Fields(line), " "))
		}
	}
	if strings.Join(classes, "; ") != "classes.high 8 of 10; classes.other 5 of 7" {
		t.Fatalf("get of a zone with reserves: classes %q, want high 8 of 10, then other 5 of 7, in\n%s", classes, out)
	}
	if out := ok("top", "cmd", "-n", "5"); !strings.Contains(out, "DENIALS") {
		t.Fatalf("top:\n%s", out)
	}
	// Errors: the admin API's message, exit 1.
	if _, errOut, code := run("limit", "nope", "alice", "--burst", "5", "--address", address); code != 1 || !strings.Contains(errOut, `unknown zone "nope"`) {
		t.Fatalf("an unknown zone: exit %d, %q", code, errOut)
	}
	if _, errOut, code := run("zones", "--address", fmt.Sprintf("localhost:%d", freePort(t, 0))); code != 1 || !strings.Contains(errOut, "connection refused") {
		t.Fatalf("an admin API that is not there: exit %d, %q", code, errOut)
	}
	// A mistyped subcommand fails, with the one meant, rather than print
	// the help and exit 0; alone, the command prints its help.
	for typo, meant := range map[string]string{"rest": "reset", "unlimt": "unlimit"} {
		_, errOut, code := run(typo, "cmd", "alice", "--address", address)
		if _, hint, _ := strings.Cut(errOut, "did you mean "); code != 1 || !strings.Contains(errOut, `unknown command "`+typo+`"`) || !strings.Contains(hint, meant) {
			t.Fatalf("the mistyped subcommand %q: exit %d, %q", typo, code, errOut)
		}
	}
	if out, errOut, code := run("--address", address); code != 0 || !strings.Contains(out, "caddy rate-limit get") {
		t.Fatalf("caddy rate-limit alone: exit %d, %q%q; want its help", code, out, errOut)
	}
	if _, errOut, code := run("limit", "cmd", "alice", "--address", address); code != 1 || !strings.Contains(errOut, "--rate") {
		t.Fatalf("limit without a limit: exit %d, %q", code, errOut)
	}
	// An empty key is refused, not sent: Caddy would redirect its path,
	// /rate_limit/cmd//limit, to that of the key "limit".
	for _, args := range [][]string{{"unlimit", "cmd", ""}, {"limit", "cmd", "", "--burst", "5"}, {"get", "", "alice"}} {
		if _, errOut, code := run(append(args, "--address", address)...); code != 1 || !strings.Contains(errOut, "must not be empty") {
			t.Fatalf("%q: exit %d, %q", args, code, errOut)
		}
	}

	// A restart keeps alice's own limit, and her bucket under it.
	time.Sleep(500 * time.Millisecond)
	if out, err := exec.Command(bin, "stop", "--address", address).CombinedOutput(); err != nil {
		t.Fatalf("caddy stop: %v\n%s", err, out)
	}
	_ = caddy.Wait()
	start()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got.Override.Burst = 0
		_ = json.Unmarshal([]byte(ok("get", "cmd", "alice", "--json")), &got)
		if got.Override.Burst == 5 && got.Tokens >= 2 && got.Tokens <= holds() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after a restart alice reads %+v, want her own burst of 5, 2 tokens and what %v gave back", got, time.Since(spent))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Her whole tokens go through; the next request is refused, unless
	// the time since the read gave her another token by its answer.
	read := time.Now()
	for range int(got.Tokens) {
		spend("alice", 200)
	}
	left := got.Tokens - float64(int(got.Tokens))
	sent := time.Now()
	code := status("alice")
	switch {
	case left+time.Since(read).Minutes() < 1 && code != 429:
		t.Fatalf("alice's request after her whole tokens: %d, want 429", code)
	case left+sent.Sub(read).Minutes() >= 1 && code != 200:
		t.Fatalf("alice's request a token after the read: %d, want 200", code)
	}
	ok("unlimit", "cmd", "alice")
	if _, errOut, code := run("unlimit", "cmd", "alice", "--address", address); code != 1 || !strings.Contains(errOut, "404") {
		t.Fatalf("unlimit of a key with the zone's limit: exit %d, %q", code, errOut)
	}
	ok("reset", "cmd", "alice")
	spend("alice", 200)

	// Zones and keys named . and ..: each a name, not this path or the
	// one up (which the admin endpoint would answer for).
	spend(".", 200)
	spend("..", 200)
	for _, zone := range []string{"cmd", ".", ".."} {
		for _, key := range []string{".", ".."} {
			var got struct{ Zone, Key, Bucket string }
			if err := json.Unmarshal([]byte(ok("get", zone, key, "--json")), &got); err != nil || got.Zone != zone || got.Key != key || got.Bucket != key {
				t.Fatalf("get %q %q: %+v, %v", zone, key, got, err)
			}
			ok("reset", zone, key)
			var set struct {
				Zone, Key string
				Burst     int64
			}
			if err := json.Unmarshal([]byte(ok("limit", zone, key, "--burst", "7", "--json")), &set); err != nil || set.Zone != zone || set.Key != key || set.Burst != 7 {
				t.Fatalf("limit %q %q: %+v, %v", zone, key, set, err)
			}
			if out := ok("get", zone, key); !strings.Contains(out, "override.burst") {
				t.Fatalf("get %q %q: no own limit in\n%s", zone, key, out)
			}
			ok("unlimit", zone, key)
		}
		if out := ok("top", zone); !strings.Contains(out, "DENIALS") {
			t.Fatalf("top %q:\n%s", zone, out)
		}
	}
}
