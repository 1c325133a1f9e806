// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package siphash is the keyed hash that names a key's state in memory:
// SipHash-2-4 under a secret key that can be written down, and a
// bijection of 64-bit words for keys that fit one. It knows nothing of
// what it hashes.
package siphash

import (
	"crypto/rand"
	"encoding/binary"
	"math/bits"
)

// A Key is the secret 128-bit key of SipHash-2-4, the keyed hash that
// names buckets in a table. Unlike hash/maphash's seeds, a key can be
// written down, so a table's hashes mean the same after a restart and its
// snapshot can be loaded back. Being secret, it keeps clients from
// choosing keys that collide with another client's bucket.
type Key [2]uint64

// Sum is SipHash-2-4 (Aumasson and Bernstein, 2012) of p. (The
// rounds are written out, as the compiler then inlines them all.)
func Sum(k Key, p string) uint64 {
	v0, v1, v2, v3 := sipInit(k)
	n := len(p)
	for ; len(p) >= 8; p = p[8:] {
		m := uint64(p[0]) | uint64(p[1])<<8 | uint64(p[2])<<16 | uint64(p[3])<<24 |
			uint64(p[4])<<32 | uint64(p[5])<<40 | uint64(p[6])<<48 | uint64(p[7])<<56
		v3 ^= m
		v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
		v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
		v0 ^= m
	}
	m := uint64(n) << 56
	for i := len(p) - 1; i >= 0; i-- {
		m |= uint64(p[i]) << (8 * i)
	}
	v3 ^= m
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0 ^= m
	return sipFinish(v0, v1, v2, v3)
}

// SumWords is Sum of a message given as its whole 8-byte words
// and its last block (the message's length in the top byte, its last
// len%8 bytes below).
func SumWords(k Key, words []uint64, last uint64) uint64 {
	v0, v1, v2, v3 := sipInit(k)
	for _, m := range words {
		v3 ^= m
		v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
		v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
		v0 ^= m
	}
	v3 ^= last
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0 ^= last
	return sipFinish(v0, v1, v2, v3)
}

func sipInit(k Key) (v0, v1, v2, v3 uint64) {
	return k[0] ^ 0x736f6d6570736575, k[1] ^ 0x646f72616e646f6d,
		k[0] ^ 0x6c7967656e657261, k[1] ^ 0x7465646279746573
}

func sipFinish(v0, v1, v2, v3 uint64) uint64 {
	v2 ^= 0xff
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	v0, v1, v2, v3 = sipRound(v0, v1, v2, v3)
	return v0 ^ v1 ^ v2 ^ v3
}

func sipRound(v0, v1, v2, v3 uint64) (uint64, uint64, uint64, uint64) {
	v0 += v1
	v1 = bits.RotateLeft64(v1, 13)
	v1 ^= v0
	v0 = bits.RotateLeft64(v0, 32)
	v2 += v3
	v3 = bits.RotateLeft64(v3, 16)
	v3 ^= v2
	v0 += v3
	v3 = bits.RotateLeft64(v3, 21)
	v3 ^= v0
	v2 += v1
	v1 = bits.RotateLeft64(v1, 17)
	v1 ^= v2
	v2 = bits.RotateLeft64(v2, 32)
	return v0, v1, v2, v3
}

// Mix64 is a bijection of 64-bit words that spreads every bit of its
// input over all of its output (MurmurHash3's finalizer).
func Mix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// NewKey is a new secret key.
func NewKey() Key {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails
	return Key{binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint64(b[8:])}
}
