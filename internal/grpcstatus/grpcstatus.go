// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package grpcstatus is what a gRPC refusal carries in its headers, by
// hand: the grpc-message's percent-encoding, and grpc-status-details-bin's
// google.rpc.Status with a google.rpc.RetryInfo, in protobuf. It knows
// nothing of HTTP, Caddy or gRPC's libraries.
package grpcstatus

import (
	"encoding/binary"
	"time"
)

// Message encodes a grpc-message: UTF-8 with every byte outside
// printable ASCII, and '%', as %XX.
func Message(s string) string {
	const hex = "0123456789ABCDEF"
	var b []byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= ' ' && c <= '~' && c != '%' {
			if b != nil {
				b = append(b, c)
			}
			continue
		}
		if b == nil {
			b = append(make([]byte, 0, len(s)+16), s[:i]...)
		}
		b = append(b, '%', hex[c>>4], hex[c&15])
	}
	if b == nil {
		return s
	}
	return string(b)
}

// retryInfoType is the type URL of google.rpc.RetryInfo in an Any.
const retryInfoType = "type.googleapis.com/google.rpc.RetryInfo"

// Details is the protobuf encoding of a google.rpc.Status of code and
// msg, whose one detail is a google.rpc.RetryInfo of delay:
//
//	Status    { int32 code = 1; string message = 2; repeated Any details = 3; }
//	Any       { string type_url = 1; bytes value = 2; }
//	RetryInfo { Duration retry_delay = 1; }
//	Duration  { int64 seconds = 1; int32 nanos = 2; }
//
// Fields of zero value are left out, as proto3 encodes them.
func Details(code int, msg string, delay time.Duration) []byte {
	var d []byte
	if s := uint64(delay / time.Second); s != 0 {
		d = protoVarint(d, 1, s)
	}
	if n := uint64(delay % time.Second); n != 0 {
		d = protoVarint(d, 2, n)
	}
	info := protoBytes(nil, 1, d)
	detail := protoBytes(protoBytes(nil, 1, retryInfoType), 2, info)
	st := protoVarint(nil, 1, uint64(code))
	if msg != "" {
		st = protoBytes(st, 2, msg)
	}
	return protoBytes(st, 3, detail)
}

// protoVarint appends field number f as a varint (wire type 0).
func protoVarint(b []byte, f, v uint64) []byte {
	return binary.AppendUvarint(binary.AppendUvarint(b, f<<3), v)
}

// protoBytes appends field number f as length-delimited bytes (wire type
// 2): a string, or an embedded message.
func protoBytes[T string | []byte](b []byte, f uint64, v T) []byte {
	b = binary.AppendUvarint(binary.AppendUvarint(b, f<<3|2), uint64(len(v)))
	return append(b, v...)
}
