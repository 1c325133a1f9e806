// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package siphash_test

import (
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/siphash"
)

// The reference vectors of SipHash-2-4: key 00 01 … 0f, message 00 01 …
// of each length.
func TestSipHashVectors(t *testing.T) {
	k := siphash.Key{0x0706050403020100, 0x0f0e0d0c0b0a0908}
	msg := make([]byte, 64)
	for i := range msg {
		msg[i] = byte(i)
	}
	for _, tc := range []struct {
		n    int
		want uint64
	}{
		{0, 0x726fdb47dd0e0e31},
		{1, 0x74f839c593dc67fd},
		{8, 0x93f5f5799a932462},
		{15, 0xa129ca6149be45e5},
	} {
		if got := siphash.Sum(k, string(msg[:tc.n])); got != tc.want {
			t.Errorf("%d bytes: %#x, want %#x", tc.n, got, tc.want)
		}
	}
	if got, want := siphash.SumWords(k, []uint64{0x0706050403020100, 0x0f0e0d0c0b0a0908}, 17<<56|16), siphash.Sum(k, string(msg[:17])); got != want {
		t.Errorf("SumWords = %#x, Sum of the same 17 bytes %#x", got, want)
	}
}
