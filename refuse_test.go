// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestJitterCap: a jitter of any size adds at most one full refill.
func TestJitterCap(t *testing.T) {
	h := newTestHandler(t, `{"zones":[{"name":"jitter_cap","rate":"1r/m","burst":1}],"jitter":100}`)
	serve(h, "192.0.2.1")
	longer := false
	for range 20 {
		status, hdr := serve(h, "192.0.2.1")
		if status != 429 {
			t.Fatalf("status %d, want 429", status)
		}
		var secs int
		fmt.Sscan(hdr.Get("Retry-After"), &secs)
		if secs < 60 || secs > 120 {
			t.Errorf("Retry-After %d, want 60 to 120: the wait plus at most one refill", secs)
		}
		longer = longer || secs > 61
	}
	if !longer {
		t.Error("jitter 100 never lengthened Retry-After")
	}
}

// TestDenialLogOfItsOwn: Caddy's log config keeps this module's DEBUG
// denial lines, as the README shows for users of caddy-ratelimit's INFO
// lines.
func TestDenialLogOfItsOwn(t *testing.T) {
	file := filepath.Join(t.TempDir(), "rate_limit.log")
	tester := startCaddy(t, fmt.Sprintf(`	log rate_limit {
		include http.handlers.rate_limit
		level DEBUG
		output file %s
	}
`, file), `http://localhost {
	rate_limit {
		zone own_log {
			rate 1r/m
			burst 1
		}
	}
	respond "ok"
}
`)
	get(t, tester, "/", 200, "ok")
	get(t, tester, "/", 429, "")
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(file)
		if strings.Contains(string(b), `"msg":"rate limit exceeded"`) && strings.Contains(string(b), `"zone":"own_log"`) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no denial in %s: %s", file, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
