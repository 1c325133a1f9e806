// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
)

// scanUsage reads body, of content type ct, for u, in pieces of size n
// (all at once for 0), as a response passes.
func scanUsage(u usagescan.Spec, ct, body string, n int, whole bool) (int64, usagescan.Reason) {
	var s usagescan.Scanner
	s.Reset(&u)
	h := http.Header{"Content-Type": {ct}}
	s.Start(h)
	if n == 0 {
		n = len(body)
	}
	for len(body) > 0 {
		p := body[:min(n, len(body))]
		body = body[len(p):]
		s.Write([]byte(p))
	}
	return s.End(h, whole)
}

// The number at a path of a JSON body, whatever the body's pieces: every
// split of each body gives the same answer.
func TestUsageJSON(t *testing.T) {
	openAI := `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",` +
		`"content":"a \"usage\": {\"total_tokens\": 9} in a string, and a } and a ]"}}],` +
		`"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}`
	for _, tc := range []struct {
		name, path, body string
		want             int64
		why              usagescan.Reason
	}{
		{"openai", "usage.total_tokens", openAI, 42, usagescan.Found},
		{"top level", "n", `{"n":7}`, 7, usagescan.Found},
		{"spaces", "a.b", " { \"a\" : { \"b\" : 5 } } ", 5, usagescan.Found},
		{"after others", "a.b", `{"x":[1,{"b":9},[{}]],"a":{"y":{"b":8},"b":3,"z":null}}`, 3, usagescan.Found},
		{"a path inside an array is not the path", "a.b", `{"a":[{"b":1}]}`, 0, usagescan.NoField},
		{"a key with an escape is not matched", "usage", `{"us\u0061ge":5}`, 0, usagescan.NoField},
		{"missing", "usage.total_tokens", `{"usage":{"prompt_tokens":3}}`, 0, usagescan.NoField},
		{"a string", "n", `{"n":"7"}`, 0, usagescan.NotNumber},
		{"null", "n", `{"n":null}`, 0, usagescan.NotNumber},
		{"an object", "n", `{"n":{"m":1}}`, 0, usagescan.NotNumber},
		{"negative", "n", `{"n":-3}`, 0, usagescan.NotNumber},
		{"a fraction rounds up", "n", `{"n":2.25}`, 3, usagescan.Found},
		{"an exponent", "n", `{"n":1e3}`, 1000, usagescan.Found},
		{"the last at the path counts", "n", `{"n":1,"n":4}`, 4, usagescan.Found},
		{"cut off", "n", `{"n":12`, 0, usagescan.Cut},
		{"cut off after the number", "n", `{"n":12,"m":[`, 0, usagescan.Cut},
		{"not an object", "n", `[{"n":1}]`, 0, usagescan.NoField},
		{"not JSON", "n", `n = 1`, 0, usagescan.NoField},
		{"huge", "n", `{"n":123456789012345678901234567890}`, usagescan.Max, usagescan.Found},
		{"huge, with an exponent", "n", `{"n":1e400}`, usagescan.Max, usagescan.Found},
		{"a long fraction rounds up", "n", `{"n":1.0000000000000000000000000001}`, 2, usagescan.Found},
		{"a tiny fraction rounds up", "n", `{"n":1e-400}`, 1, usagescan.Found},
		{"spaces after the text", "n", "{\"n\":1} \r\n", 1, usagescan.Found},
		{"an empty object", "n", `{}`, 0, usagescan.NoField},
		// A text that turns out not to be JSON has no usage, even when
		// the number came before the fault. Values off the path are
		// skipped, not checked.
		{"hex", "usage.total_tokens", `{"usage":{"total_tokens":0x10}}`, 0, usagescan.BadJSON},
		{"not JSON after the usage", "usage.total_tokens", `{"usage":{"total_tokens":30},x`, 0, usagescan.BadJSON},
		{"letters after the number", "usage.total_tokens", `{"usage":{"total_tokens":12abc}}`, 0, usagescan.BadJSON},
		{"a number not ended", "n", `{"n":1.}`, 0, usagescan.BadJSON},
		{"a leading zero", "n", `{"n":01}`, 0, usagescan.BadJSON},
		{"a trailing comma", "n", `{"n":1,}`, 0, usagescan.BadJSON},
		{"no colon", "n", `{"m" 2,"n":1}`, 0, usagescan.BadJSON},
		{"more after the text", "n", `{"n":1} x`, 0, usagescan.BadJSON},
		{"two texts", "n", `{"n":1}{"n":2}`, 0, usagescan.BadJSON},
		{"a value off the path is not checked", "n", `{"x":[1,,2],"n":5}`, 5, usagescan.Found},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for n := 0; n <= len(tc.body); n++ {
				got, why := scanUsage(usagescan.JSON(tc.path), "application/json", tc.body, n, true)
				if got != tc.want || why != tc.why {
					t.Fatalf("in pieces of %d: %d, %q; want %d, %q", n, got, why, tc.want, tc.why)
				}
			}
		})
	}
}

// The last event of a stream that has the path wins; [DONE], comments,
// other fields and events that are not JSON are skipped, and lines may
// end with LF, CR or CRLF.
func TestUsageEvents(t *testing.T) {
	chunk := func(content string) string {
		return `data: {"choices":[{"delta":{"content":"` + content + `"}}],"usage":null}` + "\n\n"
	}
	var stream strings.Builder
	for i := range 40 {
		stream.WriteString(chunk(fmt.Sprint("token ", i)))
	}
	withUsage := stream.String() + `data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":40,"total_tokens":45}}` + "\n\n" + "data: [DONE]\n\n"
	for _, tc := range []struct {
		name, body string
		want       int64
		why        usagescan.Reason
	}{
		{"openai with usage", withUsage, 45, usagescan.Found},
		{"openai without usage", stream.String() + "data: [DONE]\n\n", 0, usagescan.NoField},
		{"no usage field at all", "data: {\"a\":1}\n\ndata: [DONE]\n\n", 0, usagescan.NoField},
		{"CRLF", "event: message\r\ndata: {\"usage\":{\"total_tokens\":7}}\r\n\r\n", 7, usagescan.Found},
		{"CR", ": a comment\rdata: {\"usage\":{\"total_tokens\":8}}\r\r", 8, usagescan.Found},
		{"data over lines", "data: {\"usage\":\ndata: {\"total_tokens\":9}}\n\n", 9, usagescan.Found},
		{"not JSON", "data: usage total_tokens 5\n\n", 0, usagescan.NoField},
		{"the last that has it", "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":2}}\n\ndata: {\"x\":3}\n\n", 2, usagescan.Found},
		{"an event not ended", "data: {\"usage\":{\"total_tokens\":1}}\n", 0, usagescan.NoField},
		{"a byte order mark", "\xEF\xBB\xBFdata: {\"usage\":{\"total_tokens\":7}}\n\n", 7, usagescan.Found},
		{"a byte order mark, and an event", "\xEF\xBB\xBF\ndata: {\"usage\":{\"total_tokens\":7}}\n\n", 7, usagescan.Found},
		{"a second byte order mark", "\xEF\xBB\xBF\xEF\xBB\xBFdata: {\"usage\":{\"total_tokens\":7}}\n\n", 0, usagescan.NoField},
		{"the start of a byte order mark", "\xEF\xBBdata: {\"usage\":{\"total_tokens\":7}}\n\n", 0, usagescan.NoField},
		{"an event not JSON after the usage", "data: {\"usage\":{\"total_tokens\":30},x\n\n", 0, usagescan.NoField},
		{"the last JSON event that has it", "data: {\"usage\":{\"total_tokens\":2}}\n\ndata: {\"usage\":{\"total_tokens\":0x10}}\n\n", 2, usagescan.Found},
		{"too long an event", "data: {\"usage\":{\"total_tokens\":3},\"pad\":\"" + strings.Repeat("x", usagescan.MaxEvent) + "\"}\n\n", 0, usagescan.NoField},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, n := range []int{0, 1, 2, 3, 7, 64, 1000} {
				got, why := scanUsage(usagescan.JSON("usage.total_tokens"), "text/event-stream; charset=utf-8", tc.body, n, true)
				if got != tc.want || why != tc.why {
					t.Fatalf("in pieces of %d: %d, %q; want %d, %q", n, got, why, tc.want, tc.why)
				}
			}
			// An event a write, as an upstream flushes them.
			u := usagescan.JSON("usage.total_tokens")
			var s usagescan.Scanner
			s.Reset(&u)
			h := http.Header{"Content-Type": {"text/event-stream"}}
			s.Start(h)
			for rest := tc.body; rest != ""; {
				i := strings.Index(rest, "\n\n")
				if i < 0 {
					i = len(rest) - 2
				}
				s.Write([]byte(rest[:i+2]))
				rest = rest[i+2:]
			}
			if got, why := s.End(h, true); got != tc.want || why != tc.why {
				t.Fatalf("an event a write: %d, %q; want %d, %q", got, why, tc.want, tc.why)
			}
		})
	}
}

// Bodies the scan does not read, or does not read to the end.
func TestUsageNotRead(t *testing.T) {
	u := usagescan.JSON("n")
	if _, why := scanUsage(u, "text/plain", `{"n":1}`, 0, true); why != usagescan.NotJSON {
		t.Fatalf("text/plain: %q", why)
	}
	if got, why := scanUsage(u, "application/problem+json", `{"n":1}`, 0, true); why != usagescan.Found || got != 1 {
		t.Fatalf("+json: %d, %q", got, why)
	}
	if _, why := scanUsage(u, "application/json", `{"n":1`, 0, false); why != usagescan.Cut {
		t.Fatalf("a response cut off in its JSON text: %q", why)
	}
	long := `{"pad":"` + strings.Repeat("x", usagescan.MaxBody) + `","n":1}`
	if _, why := scanUsage(u, "application/json", long, 4096, true); why != usagescan.TooLong {
		t.Fatalf("a body over 1 MiB: %q", why)
	}
	var s usagescan.Scanner
	s.Reset(&u)
	h := http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}}
	s.Start(h)
	if _, why := s.End(h, true); why != usagescan.Encoded {
		t.Fatalf("gzip: %q", why)
	}
}

// A whole JSON text, such as a request's body, read at once: the same
// numbers as a response's, and a text that ends early is no JSON.
func TestRead(t *testing.T) {
	chat := `{"model":"m","messages":[{"role":"user","content":"what is \"max_tokens\": 9?"}],` +
		`"max_tokens":200,"options":{"num_predict":64},"metadata":{"max_completion_tokens":5}}`
	for _, tc := range []struct {
		name, path, body string
		want             int64
		why              usagescan.Reason
	}{
		{"top level", "max_tokens", chat, 200, usagescan.Found},
		{"nested", "options.num_predict", chat, 64, usagescan.Found},
		{"the key off the path only", "max_completion_tokens", chat, 0, usagescan.NoField},
		{"the key in a string only", "content", `{"m":"a \"content\": 1"}`, 0, usagescan.NoField},
		{"a fraction rounds up", "max_tokens", `{"max_tokens":199.5}`, 200, usagescan.Found},
		{"huge", "max_tokens", `{"max_tokens":1e30}`, usagescan.Max, usagescan.Found},
		{"null", "max_tokens", `{"max_tokens":null}`, 0, usagescan.NotNumber},
		{"negative", "max_tokens", `{"max_tokens":-1}`, 0, usagescan.NotNumber},
		{"a text that ends early", "max_tokens", `{"max_tokens":200`, 0, usagescan.BadJSON},
		{"a text that ends early after the number", "max_tokens", `{"max_tokens":200,"m":[`, 0, usagescan.BadJSON},
		{"not JSON after the number", "max_tokens", `{"max_tokens":200} x`, 0, usagescan.BadJSON},
		{"empty", "max_tokens", ``, 0, usagescan.NoField},
		{"over MaxBody", "max_tokens", `{"max_tokens":1,"pad":"` + strings.Repeat("x", usagescan.MaxBody) + `"}`, 0, usagescan.TooLong},
	} {
		u := usagescan.JSON(tc.path)
		if got, why := u.Read([]byte(tc.body)); got != tc.want || why != tc.why {
			t.Errorf("%s: %d, %q; want %d, %q", tc.name, got, why, tc.want, tc.why)
		}
	}
}

// What a header says of its body: compressed, JSON.
func TestIsEncodedIsJSON(t *testing.T) {
	for _, tc := range []struct {
		h             http.Header
		encoded, json bool
	}{
		{http.Header{}, false, false},
		{http.Header{"Content-Type": {"application/json"}}, false, true},
		{http.Header{"Content-Type": {"Application/JSON; charset=utf-8"}}, false, true},
		{http.Header{"Content-Type": {"application/vnd.api+json"}}, false, true},
		{http.Header{"Content-Type": {"text/plain"}}, false, false},
		{http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"identity"}}, false, true},
		{http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}}, true, true},
	} {
		if usagescan.IsEncoded(tc.h) != tc.encoded || usagescan.IsJSON(tc.h) != tc.json {
			t.Errorf("%v: encoded %v, JSON %v; want %v, %v", tc.h, usagescan.IsEncoded(tc.h), usagescan.IsJSON(tc.h), tc.encoded, tc.json)
		}
	}
}

// A response cut off has the usage read before the cut: that of a JSON
// text that had ended, of a stream's last complete event with the path;
// one cut before has none.
func TestUsageCutOff(t *testing.T) {
	usage := `data: {"usage":{"total_tokens":45}}` + "\n\n"
	for _, tc := range []struct {
		name, ct, body string
		want           int64
		why            usagescan.Reason
	}{
		{"a JSON text that had ended", "application/json", `{"n":0,"usage":{"total_tokens":12}} `, 12, usagescan.Found},
		{"a JSON text cut off", "application/json", `{"usage":{"total_tokens":12}`, 0, usagescan.Cut},
		{"a JSON text cut off in the number", "application/json", `{"usage":{"total_tokens":12`, 0, usagescan.Cut},
		{"a text not JSON, cut off", "application/json", `{"usage":{"total_tokens":12},x`, 0, usagescan.BadJSON},
		{"a stream after its usage event", "text/event-stream", "data: {}\n\n" + usage + "data: [DO", 45, usagescan.Found},
		{"a stream in its usage event", "text/event-stream", "data: {}\n\n" + usage[:len(usage)-1], 0, usagescan.Cut},
		{"a stream before its usage event", "text/event-stream", "data: {}\n\n", 0, usagescan.Cut},
	} {
		for _, n := range []int{0, 1, 5} {
			if got, why := scanUsage(usagescan.JSON("usage.total_tokens"), tc.ct, tc.body, n, false); got != tc.want || why != tc.why {
				t.Fatalf("%s, in pieces of %d: %d, %q; want %d, %q", tc.name, n, got, why, tc.want, tc.why)
			}
		}
	}
}

// A header, or a trailer of that name, whatever the body: the header as
// the response started (a handler around this one may delete it then,
// to hide it from clients), the trailer at its end, which wins. Of
// several values, the last counts.
func TestUsageHeader(t *testing.T) {
	u := usagescan.Header("x-usage-tokens")
	// hdr is a header of the name/value pairs, a name repeated for each
	// of its values.
	hdr := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			h[kv[i]] = append(h[kv[i]], kv[i+1])
		}
		return h
	}
	const name, trailer, announce = "X-Usage-Tokens", http.TrailerPrefix + "X-Usage-Tokens", "Trailer"
	for _, tc := range []struct {
		name       string
		start, end http.Header // as the response started, and ended
		want       int64
		why        usagescan.Reason
	}{
		{"header", hdr(name, "12"), hdr(name, "12"), 12, usagescan.Found},
		{"trailer", hdr(), hdr(trailer, " 13 "), 13, usagescan.Found},
		{"the header deleted once the response started", hdr(name, "12"), hdr(), 12, usagescan.Found},
		{"the last value", hdr(name, "1", name, "14"), hdr(name, "1", name, "14"), 14, usagescan.Found},
		{"a trailer over the header", hdr(name, "5"), hdr(name, "5", trailer, "40"), 40, usagescan.Found},
		{"an announced trailer after the header's value", hdr(announce, "X-Other, x-usage-tokens", name, "5"), hdr(name, "5", name, "40"), 40, usagescan.Found},
		{"an announced trailer, the header deleted", hdr(announce, "X-Other, x-usage-tokens", name, "5"), hdr(name, "40"), 40, usagescan.Found},
		{"an announced trailer that never came", hdr(announce, "X-Usage-Tokens"), hdr(), 0, usagescan.NoField},
		{"a value set after the start, not a trailer", hdr(name, "5"), hdr(name, "hidden"), 5, usagescan.Found},
		{"missing", hdr(), hdr(), 0, usagescan.NoField},
		{"not a number", hdr(name, "many"), hdr(name, "many"), 0, usagescan.NotNumber},
		{"negative", hdr(name, "-1"), hdr(name, "-1"), 0, usagescan.NotNumber},
		{"infinite", hdr(name, "Inf"), hdr(name, "Inf"), 0, usagescan.NotNumber},
		{"a long fraction", hdr(name, "1.0000000000000000000000000001"), hdr(name, "1.0000000000000000000000000001"), 2, usagescan.Found},
	} {
		var s usagescan.Scanner
		s.Reset(&u)
		s.Start(tc.start)
		s.Write([]byte("anything"))
		if got, why := s.End(tc.end, false); got != tc.want || why != tc.why {
			t.Fatalf("%s: %d, %q; want %d, %q", tc.name, got, why, tc.want, tc.why)
		}
	}
}

// openAIBodies are an OpenAI chat completion of 4 KB, and a stream of 40
// chunks with its usage chunk: the responses of BenchmarkUsageScan (and of the handler's BenchmarkUsage).
func openAIBodies() (jsonBody []byte, events [][]byte) {
	content := strings.Repeat("All work and no play makes Jack a dull boy. ", 90)
	jsonBody = fmt.Appendf(nil, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",`+
		`"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],`+
		`"usage":{"prompt_tokens":12,"completion_tokens":900,"total_tokens":912}}`, content)
	for i := range 40 {
		events = append(events, fmt.Appendf(nil, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"token %d "}}],"usage":null}`+"\n\n", i))
	}
	events = append(events, []byte(`data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}}`+"\n\n"), []byte("data: [DONE]\n\n"))
	return jsonBody, events
}

// BenchmarkUsageScan is the reading of a response's usage alone: a 4 KB
// JSON body in one write, and a stream of 42 events each in its own.
func BenchmarkUsageScan(b *testing.B) {
	jsonBody, events := openAIBodies()
	u := usagescan.JSON("usage.total_tokens")
	var s usagescan.Scanner
	for _, tc := range []struct {
		ct     string
		pieces [][]byte
		want   int64
	}{
		{"application/json", [][]byte{jsonBody}, 912},
		{"text/event-stream", events, 52},
	} {
		b.Run(tc.ct, func(b *testing.B) {
			h := http.Header{"Content-Type": {tc.ct}}
			b.ReportAllocs()
			for b.Loop() {
				s.Reset(&u)
				s.Start(h)
				for _, p := range tc.pieces {
					s.Write(p)
				}
				if n, why := s.End(h, true); n != tc.want || why != usagescan.Found {
					b.Fatalf("%d, %v", n, why)
				}
			}
		})
	}
}

// BenchmarkRead is the reading of a request's estimate alone: the number
// at max_tokens in a chat completion request of 1 KiB and of 64 KiB,
// whose messages come after it.
func BenchmarkRead(b *testing.B) {
	u := usagescan.JSON("max_tokens")
	for _, size := range []int{1 << 10, 64 << 10} {
		head, tail := `{"model":"m","max_tokens":200,"messages":[{"role":"user","content":"`, `"}]}`
		body := []byte(head + strings.Repeat("x", size-len(head)-len(tail)) + tail)
		b.Run(fmt.Sprintf("body=%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if n, why := u.Read(body); n != 200 || why != usagescan.Found {
					b.Fatalf("%d, %v", n, why)
				}
			}
		})
	}
}
