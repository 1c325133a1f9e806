// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"net/netip"
	"testing"
)

// The reference vectors of SipHash-2-4: key 00 01 … 0f, message 00 01 …
// of each length.
func TestSipHashVectors(t *testing.T) {
	k := hashKey{0x0706050403020100, 0x0f0e0d0c0b0a0908}
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
		if got := sipHash(k, string(msg[:tc.n])); got != tc.want {
			t.Errorf("%d bytes: %#x, want %#x", tc.n, got, tc.want)
		}
	}
	if got, want := sipHashWords(k, []uint64{0x0706050403020100, 0x0f0e0d0c0b0a0908}, 17<<56|16), sipHash(k, string(msg[:17])); got != want {
		t.Errorf("sipHashWords = %#x, sipHash of the same 17 bytes %#x", got, want)
	}
}

// IP networks and strings hash apart, and so do the two families. (The
// networks of one zone have one length per family, which need not be
// hashed.)
func TestTableHashKinds(t *testing.T) {
	tab := newBuckets(100, t0)
	seen := map[uint64]string{}
	for _, k := range []bucketKey{
		{ip: netip.MustParsePrefix("192.0.2.1/32")},
		{ip: netip.MustParsePrefix("192.0.2.0/24")},
		{ip: netip.MustParsePrefix("::ffff:192.0.2.1/128")},
		{ip: netip.MustParsePrefix("2001:db8::/64")},
		{ip: netip.MustParsePrefix("2001:db8:0:1::/64")},
		{ip: netip.MustParsePrefix("0:0:c000:201::/64")}, // 192.0.2.1 as an IPv6 word
		{ip: netip.MustParsePrefix("2001:db8::1/128")},
		{ip: netip.MustParsePrefix("2001:db8::2/128")},
		{ip: netip.MustParsePrefix("2001:db8::/96")},
		{s: "192.0.2.1"},
		{s: ""},
	} {
		h := tab.hash(k)
		if other, ok := seen[h]; ok {
			t.Errorf("%v and %s hash alike", k, other)
		}
		seen[h] = k.String()
	}
	other := newBuckets(100, t0)
	if k := key("a"); tab.hash(k) == other.hash(k) {
		t.Error("two tables with random keys hash alike")
	}
	other.key = tab.key
	if k := key("a"); tab.hash(k) != other.hash(k) {
		t.Error("two tables with one key hash apart")
	}
}

func BenchmarkTableHash(b *testing.B) {
	tab := newBuckets(100, t0)
	for _, k := range []bucketKey{
		{ip: netip.MustParsePrefix("192.0.2.1/32")},
		{ip: netip.MustParsePrefix("2001:db8::/64")},
		{s: "an-api-key-of-32-bytes-abcdefghi"},
	} {
		b.Run(k.String()[:min(len(k.String()), 12)], func(b *testing.B) {
			for b.Loop() {
				_ = tab.hash(k)
			}
		})
	}
}
