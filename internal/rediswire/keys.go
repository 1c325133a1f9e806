// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

// Keys name what a store keeps in Redis. A bucket is the field
// `<zone>:<shape>:<key>` of the hash `<prefix>{<group>}` (see
// BucketField), where the group is one of 16384, chosen by the key alone:
// so the zones of one client share a hash and a cluster slot, and are
// decided in one call even on Redis Cluster. A calendar quota's counter
// is the key `<hash><zone>:<key>:quota`, a zone's slots the sorted set
// `<hash><zone>:<key>:s`, and a key's own limit (an override) the string
// `<hash><field>:limit`, after the bucket's field: all in the bucket's
// slot, and named as no hash of buckets is (those end with the tag). The
// overrides of a zone are listed in the sorted set
// `<prefix>{<zone>:<shape>:}:limits`; on Redis Cluster, a change of a
// key's own limit holds the lock `<hash><field>:limit:lock`.
//
// The key never chooses its slot: the hash tag is the group, four hex
// digits of a fixed hash of the key, whatever the key's bytes; nor does
// it choose another key's names (see Stored).
type Keys struct {
	Prefix string
	// Hash makes every key its SHA-256 (128 bits, in hex); keys longer
	// than HashLongerThan bytes are hashed whatever Hash says.
	Hash bool
}

// HashLongerThan is the longest key written as it is.
const HashLongerThan = 128

// Bucket is the hash and the field of the bucket of key in a zone whose
// fields start with zone (see ZoneField).
func (n Keys) Bucket(zone, key string) (hash, field string) {
	s := n.name(zone, key, "")
	i := len(n.Prefix) + len("{0000}")
	return s[:i], s[i:]
}

// BucketLimit is Bucket, and the key of the override of key in the zone:
// the three made as one string.
func (n Keys) BucketLimit(zone, key string) (hash, field, limit string) {
	limit = n.name(zone, key, LimitSuffix)
	i := len(n.Prefix) + len("{0000}")
	return limit[:i], limit[i : len(limit)-len(LimitSuffix)], limit
}

// LimitSuffix ends the key of an override.
const LimitSuffix = ":limit"

// Stored is key as the names hold it, one name for each key. With Hash,
// it is the key's SHA-256 in 32 hex digits. Without, a key longer than
// HashLongerThan is '#' and those digits, and a shorter key is itself,
// unless it is '#'s and 32 hex digits: that could be the name of a long
// key, or of another such key, so it gets one '#' more. (Builds before
// named a long key as the key of its 32 digits: only long keys and
// these are named anew.)
func (n Keys) Stored(key string) string {
	if n.Hash || len(key) > HashLongerThan {
		sum := sha256.Sum256([]byte(key))
		if n.Hash {
			return hex.EncodeToString(sum[:16])
		}
		return "#" + hex.EncodeToString(sum[:16])
	}
	if hashLike(key) {
		return "#" + key
	}
	return key
}

// hashLike reports whether s is one '#' or more, then 32 lowercase hex
// digits: a key whose stored name gets a '#' more.
func hashLike(s string) bool {
	h := strings.TrimLeft(s, "#")
	if len(h) != 32 || len(h) == len(s) {
		return false
	}
	for i := 0; i < len(h); i++ {
		if c := h[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Listed is key as the list of a zone's overrides holds it: the key
// itself, so that the admin API lists a key it can be given, long ones
// too; with Hash, as stored, so that the list holds no key either.
func (n Keys) Listed(key string) string {
	if n.Hash {
		return n.Stored(key)
	}
	return key
}

// ListedLimit is the key of the override of a key as the list of the
// zone's overrides holds it (Listed).
func (n Keys) ListedLimit(zone, listed string) string {
	if n.Hash {
		return n.named(zone, listed, LimitSuffix)
	}
	return n.name(zone, listed, LimitSuffix)
}

// Limits is the sorted set that lists the overrides of a zone whose
// buckets' fields start with zone (see BucketField): their keys as
// Listed, scored by when they end (ms since 1970; +inf for never). Its
// hash tag is zone, escaped, so it is named as no other key.
func (n Keys) Limits(zone string) string {
	return n.Prefix + "{" + escapeTag(zone, "%{}") + "}:limits"
}

// Counter is the key of a zone's calendar quota counter for key.
func (n Keys) Counter(zone, key string) string { return n.name(zone, key, ":quota") }

// Slots is the key of the sorted set of a zone's slots for key.
func (n Keys) Slots(zone, key string) string { return n.name(zone, key, ":s") }

func (n Keys) name(zone, key, end string) string { return n.named(zone, n.Stored(key), end) }

// named is the name of a key already as stored.
func (n Keys) named(zone, key, end string) string {
	g := Group(key)
	const digits = "0123456789abcdef"
	tag := [4]byte{digits[g>>12], digits[g>>8&15], digits[g>>4&15], digits[g&15]}
	return n.Prefix + "{" + string(tag[:]) + "}" + zone + key + end
}

// ZoneField is how a zone's keys of a client start: its name, with '%'
// and ':' escaped (a ':' would make them another zone's), then ':'.
func ZoneField(name string) string { return escapeTag(name, "%:") + ":" }

// BucketField is how the fields of a zone's buckets start: ZoneField,
// then four characters of a fixed hash of the zone's shape (its rate and
// burst, as the caller writes them) and ':'. So zones of one name with
// different limits keep buckets of their own, and a zone whose rate or
// burst changes starts with full buckets, as in the local store.
func BucketField(name, shape string) string {
	const digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	h := fnv1a(shape)
	tag := [5]byte{digits[h>>18&63], digits[h>>12&63], digits[h>>6&63], digits[h&63], ':'}
	return ZoneField(name) + string(tag[:])
}

// CounterZone is how the keys of a zone's quota counters start after the
// hash: ZoneField, then the tag BucketField would make of window (the
// quota's period and time zone). So zones of one name with quotas of
// different periods count apart, as in the local store; a quota whose
// limit changes keeps its counts.
func CounterZone(name, window string) string { return BucketField(name, "quota "+window) }

// Groups is how many hashes the buckets are spread over. Redis keeps a
// hash of up to 512 short fields as one compact list
// (hash-max-listpack-entries), so buckets cost least from 100k to a few
// million of them: 50 B each at 100k, 31 B at 1M and 3M (Redis 7.0);
// under 10k, about what a key of their own would.
const Groups = 1 << 14

// Group is the group of a key's buckets: the 32-bit FNV-1a hash of the
// key, folded. Buckets written by one version must be found by the next:
// this never changes.
func Group(k string) uint16 {
	h := fnv1a(k)
	return uint16(h>>16^h) & (Groups - 1)
}

// fnv1a is the 32-bit FNV-1a hash of s.
func fnv1a(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// escapeTag percent-escapes the bytes of chars (which hold '%') in s, so
// that the escaped strings of distinct s differ. The empty string, which
// would make an empty hash tag (and so no tag at all), becomes "%", which
// no other string escapes to.
func escapeTag(s, chars string) string {
	if s == "" {
		return "%"
	}
	if !strings.ContainsAny(s, chars) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; strings.IndexByte(chars, c) >= 0 {
			fmt.Fprintf(&b, "%%%02X", c)
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}
