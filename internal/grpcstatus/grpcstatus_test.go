// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package grpcstatus_test

import (
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/grpcstatus"
)

// The protobuf bytes, written out by hand from the messages' definitions:
// google.rpc.Status{code: 8, message: "m", details: [Any{type_url:
// RetryInfo's, value: RetryInfo{retry_delay: {seconds: 1, nanos:
// 500000000}}}]}.
func TestStatusProto(t *testing.T) {
	const retryInfoType = "type.googleapis.com/google.rpc.RetryInfo"
	info := "\x0a\x08" + "\x08\x01" + "\x10\x80\xca\xb5\xee\x01" // retry_delay {seconds 1, nanos 500000000}
	detail := "\x0a\x28" + retryInfoType + "\x12\x0a" + info
	want := "\x08\x08" + "\x12\x01m" + "\x1a\x36" + detail
	if got := grpcstatus.Details(8, "m", 1500*time.Millisecond); string(got) != want {
		t.Errorf("Details: %x, want %x", got, want)
	}
	// A whole number of seconds has no nanos, and an empty message no
	// field.
	want = "\x08\x0e" + "\x1a\x30" + "\x0a\x28" + retryInfoType + "\x12\x04" + "\x0a\x02\x08\x01"
	if got := grpcstatus.Details(14, "", 1000*time.Millisecond); string(got) != want {
		t.Errorf("Details: %x, want %x", got, want)
	}
}

func TestPercentEncode(t *testing.T) {
	for in, want := range map[string]string{
		"zone api: rate limit exceeded": "zone api: rate limit exceeded",
		"zone é%:":                      "zone %C3%A9%25:",
		"tab\there\x7f~":                "tab%09here%7F~",
		"":                              "",
	} {
		if got := grpcstatus.Message(in); got != want {
			t.Errorf("Message(%q) = %q, want %q", in, got, want)
		}
	}
}
