// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// The reply of k takes becomes each take's reply: the allowed ones owe
// a cost less for each allowed after them, the denied ones what the last
// allowed left, and the first carries the count of repaired keys.
func TestSplitTwins(t *testing.T) {
	got, err := splitTwins([]any{int64(2), int64(1), int64(3000), int64(0), int64(50), int64(0), int64(7)}, []time.Duration{1000, 10}, 3)
	want := [][]any{
		{int64(1), int64(1), int64(2000), int64(0), int64(40), int64(0), int64(7)},
		{int64(1), int64(0), int64(3000), int64(0), int64(50), int64(0), int64(7)},
		{int64(0), int64(0), int64(3000), int64(0), int64(50), int64(0), int64(7)},
	}
	if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("splitTwins = %v, %v; want %v", got, err, want)
	}
	for _, v := range [][]any{{int64(1), int64(5)}, {int64(1), "x", int64(5), int64(0), int64(7)}} {
		if _, err := splitTwins(v, []time.Duration{1}, 2); !errors.Is(err, ErrBadReply) {
			t.Errorf("splitTwins(%v) error %v, want a bad reply", v, err)
		}
	}
}
