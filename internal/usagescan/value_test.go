// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
)

// The value at a path of a request's JSON body, as a placeholder gives
// it: a string unescaped, a number in its JSON text, true or false; the
// last value at the path counts; none for a path absent or holding null,
// an object or an array, and none in a body that is not a JSON object.
func TestValue(t *testing.T) {
	mcp := `{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"search","arguments":{"name":"not this","q":"x"}}}`
	for _, tc := range []struct {
		name, path, body string
		want             string
		ok               bool
	}{
		{"a string", "model", `{"model":"gpt-4o","messages":[]}`, "gpt-4o", true},
		{"nested", "params.name", mcp, "search", true},
		{"nested, not a deeper key of the same name", "params.arguments.name", mcp, "not this", true},
		{"a number as written", "id", mcp, "7", true},
		{"a negative fraction", "t", `{"t":-0.5e-3}`, "-0.5e-3", true},
		{"a big number", "n", `{"n":123456789012345678901234567890}`, "123456789012345678901234567890", true},
		{"true", "stream", `{"stream":true}`, "true", true},
		{"false, then spaces", "stream", `{"stream" : false }`, "false", true},
		{"escapes", "s", `{"s":"a\"b\\c\/d\n\t\u00e9\ud83d\ude00"}`, "a\"b\\c/d\n\té😀", true},
		{"a lone surrogate", "s", `{"s":"\ud800x"}`, "\uFFFDx", true},
		{"a surrogate and another escape", "s", `{"s":"\ud800\u0041"}`, "\uFFFDA", true},
		{"UTF-8 as it is", "s", `{"s":"naïve ☃"}`, "naïve ☃", true},
		{"an empty string", "s", `{"s":""}`, "", true},
		{"the last of a repeated key", "model", `{"model":"a","x":1,"model":"b"}`, "b", true},
		{"the last, of another type", "model", `{"model":"a","model":3}`, "3", true},
		{"the last is an object", "model", `{"model":"a","model":{"id":"b"}}`, "", false},
		{"an object", "params", mcp, "", false},
		{"an array", "messages", `{"messages":[{"role":"user"}]}`, "", false},
		{"null", "model", `{"model":null}`, "", false},
		{"absent", "model", `{"messages":[]}`, "", false},
		{"inside an array is not the path", "a.b", `{"a":[{"b":"x"}]}`, "", false},
		{"a key with an escape is not matched", "model", `{"mod\u0065l":"x"}`, "", false},
		{"a JSON array", "model", `[{"model":"x"}]`, "", false},
		{"a string text", "model", `"model"`, "", false},
		{"cut off", "model", `{"model":"x"`, "", false},
		{"cut off in the value", "model", `{"model":"x`, "", false},
		{"not JSON after the value", "model", `{"model":"x",}`, "", false},
		{"two texts", "model", `{"model":"x"}{"model":"y"}`, "", false},
		{"a literal that is none", "stream", `{"stream":truth}`, "", false},
		{"a bad escape", "s", `{"s":"a\qb"}`, "", false},
		{"a short unicode escape", "s", `{"s":"\u12"}`, "", false},
		{"a number not ended", "n", `{"n":1.}`, "", false},
		{"not JSON", "model", `model=x`, "", false},
		{"empty", "model", ``, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := usagescan.JSON(tc.path)
			got, ok := u.Value([]byte(tc.body))
			if got != tc.want || ok != tc.ok {
				t.Fatalf("Value(%s) in %s = %q, %v; want %q, %v", tc.path, tc.body, got, ok, tc.want, tc.ok)
			}
			// Where encoding/json reads a string, it reads the same.
			var m map[string]any
			if s, isString := tc.want, tc.ok; isString && json.Unmarshal([]byte(tc.body), &m) == nil && !strings.Contains(tc.path, ".") {
				if v, ok := m[tc.path].(string); ok && v != s {
					t.Fatalf("encoding/json reads %q", v)
				}
			}
		})
	}
}

// A body over MaxBody has no value, as it has no estimate.
func TestValueTooLong(t *testing.T) {
	u := usagescan.JSON("model")
	body := `{"model":"x","pad":"` + strings.Repeat("p", usagescan.MaxBody) + `"}`
	if v, ok := u.Value([]byte(body)); ok {
		t.Fatalf("%q from a body of %d bytes", v, len(body))
	}
}

// BenchmarkValue is the reading of one placeholder's value: the model of
// a chat completion request of 1 KiB and of 64 KiB, whose messages come
// after it.
func BenchmarkValue(b *testing.B) {
	u := usagescan.JSON("model")
	for _, size := range []int{1 << 10, 64 << 10} {
		head, tail := `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"`, `"}]}`
		body := []byte(head + strings.Repeat("x", size-len(head)-len(tail)) + tail)
		b.Run(fmt.Sprintf("body=%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if v, ok := u.Value(body); v != "gpt-4o" || !ok {
					b.Fatalf("%q, %v", v, ok)
				}
			}
		})
	}
}
