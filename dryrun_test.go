// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
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
