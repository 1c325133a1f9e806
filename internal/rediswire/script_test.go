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
	costs, tokens := []time.Duration{1000, 10}, []time.Duration{500, 10}
	z := int64(0)
	got, err := splitTwins([]any{int64(2), int64(1), int64(3000), z, z, z, int64(50), z, z, z, int64(7)}, costs, tokens, 3)
	want := [][]any{
		{int64(1), int64(1), int64(2000), z, z, z, int64(40), z, z, z, int64(7)},
		{int64(1), z, int64(3000), z, z, z, int64(50), z, z, z, int64(7)},
		{z, z, int64(3000), z, z, z, int64(50), z, z, z, int64(7)},
	}
	if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("splitTwins = %v, %v; want %v", got, err, want)
	}
	// A bucket its key's own limit decided, a token of 250 in place of
	// 500: a take of two tokens costs 500 there.
	got, err = splitTwins([]any{int64(2), z, int64(3000), z, int64(250), int64(20), int64(50), z, z, z, int64(7)}, costs, tokens, 2)
	want = [][]any{
		{int64(1), z, int64(2500), z, int64(250), int64(20), int64(40), z, z, z, int64(7)},
		{int64(1), z, int64(3000), z, int64(250), int64(20), int64(50), z, z, z, int64(7)},
	}
	if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("splitTwins with an override = %v, %v; want %v", got, err, want)
	}
	for _, v := range [][]any{{int64(1), int64(5)}, {int64(1), "x", int64(5), z, z, z, int64(7)}} {
		if _, err := splitTwins(v, []time.Duration{1}, []time.Duration{1}, 2); !errors.Is(err, ErrBadReply) {
			t.Errorf("splitTwins(%v) error %v, want a bad reply", v, err)
		}
	}
}
