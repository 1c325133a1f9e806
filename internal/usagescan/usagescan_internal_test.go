// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

import "testing"

// A usage is a number as JSON writes it, at least 0, rounded up exactly
// however many digits it has, and at most Max.
func TestReadUsage(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		why  Reason
	}{
		{"0", 0, Found},
		{"-0", 0, Found},
		{"-0.0e5", 0, Found},
		{"12", 12, Found},
		{"2.25", 3, Found},
		{"12.000000000000000000000000000", 12, Found},
		{"1.0000000000000000000000000001", 2, Found},
		{"0.0000000000000000000000000001", 1, Found},
		{"5e-1", 1, Found},
		{"100e-2", 1, Found},
		{"0.1e1", 1, Found},
		{"1.5E+2", 150, Found},
		{"12345678901234567.5e-3", 12345678901235, Found},
		{"1e-400", 1, Found},
		{"1e-99999999999999999999", 1, Found},
		{"999999999999999", Max, Found},
		{"999999999999998.5", Max, Found},
		{"123456789012344.0000000000000000000000000001", 123456789012345, Found},
		{"1000000000000000", Max, Found},
		{"99999999999999999999999", Max, Found},
		{"1e17", Max, Found},
		{"1e400", Max, Found},
		{"1e99999999999999999999", Max, Found},
		{"0.00000000000000000000000000001e400", Max, Found},
		{"", 0, NotNumber},
		{"-", 0, NotNumber},
		{"-1", 0, NotNumber},
		{"-0.5", 0, NotNumber},
		{"-1e-400", 0, NotNumber},
		{"1.", 0, NotNumber},
		{".5", 0, NotNumber},
		{"1e", 0, NotNumber},
		{"1e+", 0, NotNumber},
		{"01", 0, NotNumber},
		{"+5", 0, NotNumber},
		{"5 ", 0, NotNumber},
		{"1_000", 0, NotNumber},
		{"0x10", 0, NotNumber},
		{"Inf", 0, NotNumber},
		{"+Inf", 0, NotNumber},
		{"infinity", 0, NotNumber},
		{"NaN", 0, NotNumber},
	} {
		if got, why := readUsage(tc.in); got != tc.want || why != tc.why {
			t.Errorf("%q: %d, %q; want %d, %q", tc.in, got, why, tc.want, tc.why)
		}
	}
}

// A needle is found wherever it is, and only where it is whole.
func TestNeedle(t *testing.T) {
	n := newNeedle(`"total_tokens"`)
	if n.b[n.pivot] != '_' {
		t.Fatalf("pivot %q, want the underscore", n.b[n.pivot])
	}
	for _, tc := range []struct {
		data string
		want bool
	}{
		{`"total_tokens"`, true},
		{`{"usage":{"total_tokens":5}}`, true},
		{`x"total_tokens"`, true},
		{`"total_tokens`, false},
		{`total_tokens"`, false},
		{`"total_token"`, false},
		{`"a_b" "total-tokens" "total_tokenz"`, false},
		{`_`, false},
		{``, false},
	} {
		if got := n.in([]byte(tc.data)); got != tc.want {
			t.Errorf("%q: %v, want %v", tc.data, got, tc.want)
		}
	}
}
