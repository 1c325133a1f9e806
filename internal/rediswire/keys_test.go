// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
)

// Each key has a name of its own: a long key's hash is named as no short
// key is, even the key of its 32 hex digits. The short keys that builds
// before named so keep their names, and with Hash every key is its hash,
// as before.
func TestStoredNamesApart(t *testing.T) {
	long := strings.Repeat("k", HashLongerThan+1)
	sum := sha256.Sum256([]byte(long))
	digits := hex.EncodeToString(sum[:16])
	sumOfDigits := sha256.Sum256([]byte(digits))
	for _, tc := range []struct {
		keys Keys
		key  string
		want string
	}{
		{Keys{}, long, "#" + digits},
		{Keys{}, long[:HashLongerThan], long[:HashLongerThan]},
		{Keys{}, digits, digits},
		{Keys{}, "#" + digits, "##" + digits},
		{Keys{}, "##" + digits, "###" + digits},
		{Keys{}, "#" + strings.ToUpper(digits), "#" + strings.ToUpper(digits)},
		{Keys{}, "#" + digits[1:], "#" + digits[1:]},
		{Keys{}, "#" + digits + "0", "#" + digits + "0"},
		{Keys{}, "#foo", "#foo"},
		{Keys{}, "#", "#"},
		{Keys{}, "", ""},
		{Keys{Hash: true}, long, digits},
		{Keys{Hash: true}, digits, hex.EncodeToString(sumOfDigits[:16])},
	} {
		if got := tc.keys.Stored(tc.key); got != tc.want {
			t.Errorf("Keys{Hash: %v}.Stored(%.40q) = %q, want %q", tc.keys.Hash, tc.key, got, tc.want)
		}
	}
	// The names of a long key's bucket and own limit are not its digits'.
	n := Keys{Prefix: "p:"}
	for _, other := range []string{digits, "#" + digits} {
		h1, f1, l1 := n.BucketLimit("z:", long)
		h2, f2, l2 := n.BucketLimit("z:", other)
		if h1+f1 == h2+f2 || l1 == l2 {
			t.Errorf("the long key and %q share %q %q", other, h1+f1, l1)
		}
	}
	// The list of overrides holds keys as they are, so that they can be
	// named again; with Hash, hashed.
	for _, key := range []string{long, digits, "#" + digits, "#foo"} {
		if got := n.Listed(key); got != key {
			t.Errorf("Listed(%.40q) = %.40q", key, got)
		}
		if _, _, limit := n.BucketLimit("z:", key); n.ListedLimit("z:", n.Listed(key)) != limit {
			t.Errorf("ListedLimit of %.40q as listed is not its limit %q", key, limit)
		}
		hashed := Keys{Prefix: "p:", Hash: true}
		if _, _, limit := hashed.BucketLimit("z:", key); hashed.Listed(key) != hashed.Stored(key) || hashed.ListedLimit("z:", hashed.Listed(key)) != limit {
			t.Errorf("with Hash, %.40q is listed as %q, not as its limit %q", key, hashed.Listed(key), limit)
		}
	}
}
