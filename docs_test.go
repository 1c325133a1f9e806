// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The documentation is checked against the code: README.md, xcaddy.md,
// docs/*.md and docs/*/*.md.
//
// A fenced block's info string says what it is: ```caddy a whole
// Caddyfile, ```caddy fragment the inside of a site block, ```caddy syntax
// a parser's syntax summary, ```json a rate_limit handler, ```json
// fragment a piece of one. Other languages are not checked, and any other
// spelling of these (```caddyfile, ```caddy snippet) fails
// TestDocFencesTagged, so that no Caddyfile escapes the checks.

// docFiles are the Markdown files the tests read.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md", "xcaddy.md"}
	for _, pattern := range []string{"docs/*.md", "docs/*/*.md"} {
		matches, err := filepath.Glob(pattern)
		if err != nil || len(matches) == 0 {
			t.Fatalf("no %s: %v", pattern, err)
		}
		files = append(files, matches...)
	}
	return files
}

// fenceTags are the tags each checked language may carry.
var fenceTags = map[string][][]string{
	"caddy": {nil, {"fragment"}, {"syntax"}},
	"json":  {nil, {"fragment"}},
}

// TestDocFencesTagged: every fenced block of a Caddyfile or of JSON is
// tagged as the checks read it, and every fence opens with three
// backticks, the only form readMarkdown reads; a block tagged otherwise
// would not be checked at all.
func TestDocFencesTagged(t *testing.T) {
	for _, file := range docFiles(t) {
		prose, fences := readMarkdown(t, file)
		inTilde := false
		for i, line := range prose {
			if strings.HasPrefix(strings.TrimLeft(line, " "), "~~~") {
				if !inTilde {
					t.Errorf("%s:%d: a ~~~ fence, which the checks do not read; use ```", file, i+1)
				}
				inTilde = !inTilde
			}
		}
		for _, f := range fences {
			lang := strings.ToLower(f.lang)
			if strings.HasPrefix(lang, "`") {
				t.Errorf("%s: a fence of more than three backticks, which the checks do not read", f)
				continue
			}
			var known string
			for name := range fenceTags {
				if strings.HasPrefix(lang, name) {
					known = name
				}
			}
			if known == "" {
				continue
			}
			if f.lang != known || !slices.ContainsFunc(fenceTags[known], func(tags []string) bool { return slices.Equal(tags, f.tags) }) {
				var forms []string
				for _, tags := range fenceTags[known] {
					forms = append(forms, "```"+strings.Join(append([]string{known}, tags...), " "))
				}
				t.Errorf("%s is not checked; write %s", f, strings.Join(forms, ", "))
			}
		}
	}
}

// A fence is a fenced code block of a Markdown file.
type fence struct {
	file string
	line int    // of the opening fence
	lang string // the info string's first word
	tags []string
	body string
}

func (f fence) String() string {
	return fmt.Sprintf("%s:%d (```%s)", f.file, f.line, strings.Join(append([]string{f.lang}, f.tags...), " "))
}

func (f fence) tagged(tag string) bool { return slices.Contains(f.tags, tag) }

// readMarkdown returns the file's lines outside fenced blocks (fenced
// lines are left empty, so line numbers stay) and its fenced blocks.
func readMarkdown(t *testing.T, file string) (prose []string, fences []fence) {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(data), "\n")
	prose = make([]string, len(lines))
	var open *fence
	var indent string
	for i, line := range lines {
		trimmed := strings.TrimLeft(line, " ")
		switch {
		case open == nil && strings.HasPrefix(trimmed, "```"):
			info := strings.Fields(strings.TrimPrefix(trimmed, "```"))
			open = &fence{file: file, line: i + 1}
			if len(info) > 0 {
				open.lang, open.tags = info[0], info[1:]
			}
			indent = line[:len(line)-len(trimmed)]
		case open != nil && strings.TrimSpace(line) == "```":
			fences = append(fences, *open)
			open = nil
		case open != nil:
			open.body += strings.TrimPrefix(line, indent) + "\n"
		default:
			prose[i] = line
		}
	}
	if open != nil {
		t.Fatalf("%s: fence not closed", open)
	}
	return prose, fences
}

// parserSyntax is the syntax block of the doc comment of
// (*typeName).UnmarshalCaddyfile in file: the indented lines after
// "Syntax:", one tab removed.
func parserSyntax(t *testing.T, file, typeName string) string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "UnmarshalCaddyfile" || fn.Recv == nil || receiverName(fn) != typeName {
			continue
		}
		_, after, ok := strings.Cut(fn.Doc.Text(), "Syntax:\n")
		if !ok {
			t.Fatalf("%s: (*%s).UnmarshalCaddyfile's doc comment has no Syntax: block", file, typeName)
		}
		var block strings.Builder
		for line := range strings.Lines(strings.TrimLeft(after, "\n")) {
			if !strings.HasPrefix(line, "\t") {
				break
			}
			block.WriteString(strings.TrimPrefix(line, "\t"))
		}
		return block.String()
	}
	t.Fatalf("%s: no (*%s).UnmarshalCaddyfile", file, typeName)
	return ""
}

func receiverName(fn *ast.FuncDecl) string {
	typ := fn.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if id, ok := typ.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// syntaxDiff says how doc differs from code, a syntax block from its
// parser's doc comment (trailing spaces aside): the lines only one of
// them has, or else the first line out of order; "" when they are equal.
func syntaxDiff(doc, code string) string {
	lines := func(s string) []string {
		var out []string
		for l := range strings.Lines(s) {
			out = append(out, strings.TrimRight(l, " \t\n"))
		}
		return out
	}
	docLines, codeLines := lines(doc), lines(code)
	var diff []string
	for _, l := range codeLines {
		if !slices.Contains(docLines, l) {
			diff = append(diff, fmt.Sprintf("\tmissing from the docs:      %q", l))
		}
	}
	for _, l := range docLines {
		if !slices.Contains(codeLines, l) {
			diff = append(diff, fmt.Sprintf("\tnot in the doc comment:    %q", l))
		}
	}
	if len(diff) == 0 && !slices.Equal(docLines, codeLines) {
		for i := range min(len(docLines), len(codeLines)) {
			if docLines[i] != codeLines[i] {
				return fmt.Sprintf("\tline %d out of order: the docs have %q, the doc comment %q", i+1, docLines[i], codeLines[i])
			}
		}
		return "\tthe same lines, repeated differently"
	}
	return strings.Join(diff, "\n")
}

// TestSyntaxBlocksMatchParsers: the README's syntax block is the
// handler's parser's doc comment, and every syntax block of the docs is
// the doc comment of the parser it summarises, so that neither can drift.
func TestSyntaxBlocksMatchParsers(t *testing.T) {
	parsers := map[string]string{
		"rate_limit":  parserSyntax(t, "caddyfile.go", "Handler"),
		"store local": parserSyntax(t, "local_store.go", "LocalStore"),
		"store redis": parserSyntax(t, "redis_config.go", "RedisStore"),
	}
	readmeHasHandler := false
	for _, file := range docFiles(t) {
		_, fences := readMarkdown(t, file)
		for _, f := range fences {
			if f.lang != "caddy" || !f.tagged("syntax") {
				continue
			}
			var which string
			for name := range parsers {
				if strings.HasPrefix(f.body, name+" ") {
					which = name
				}
			}
			if which == "" {
				t.Errorf("%s: a syntax block of no parser: it starts %q", f, strings.SplitN(f.body, "\n", 2)[0])
				continue
			}
			if d := syntaxDiff(f.body, parsers[which]); d != "" {
				t.Errorf("%s differs from the doc comment of the %s parser (make them equal):\n%s", f, which, d)
			}
			readmeHasHandler = readmeHasHandler || file == "README.md" && which == "rate_limit"
		}
	}
	if !readmeHasHandler {
		t.Error("README.md has no ```caddy syntax block of rate_limit")
	}
}

// siteOf makes a fragment a whole Caddyfile: the inside of a site block.
func siteOf(fragment string) string {
	var b strings.Builder
	b.WriteString("http://localhost:9080 {\n")
	for line := range strings.Lines(fragment) {
		if strings.TrimSpace(line) != "" {
			b.WriteString("\t")
		}
		b.WriteString(line)
	}
	b.WriteString("}\n")
	return b.String()
}

// TestDocCaddyfilesAdapt: every Caddyfile of the docs adapts without
// warnings, and each rate_limit handler it makes loads through Caddy,
// with only documented JSON fields.
func TestDocCaddyfilesAdapt(t *testing.T) {
	ref := jsonReference(t)
	n := 0
	for _, file := range docFiles(t) {
		_, fences := readMarkdown(t, file)
		for _, f := range fences {
			if f.lang != "caddy" || f.tagged("syntax") {
				continue
			}
			n++
			t.Run(fmt.Sprintf("%s:%d", file, f.line), func(t *testing.T) {
				input := f.body
				if f.tagged("fragment") {
					input = siteOf(input)
				}
				for _, h := range rateLimitHandlers(t, adaptCaddyfile(t, input)) {
					ref.check(t, h)
					loadHandler(t, h)
				}
			})
		}
	}
	if n == 0 {
		t.Fatal("no Caddyfiles in the docs")
	}
}

// TestDocJSONLoads: every JSON handler of the docs loads through Caddy,
// with only documented fields; fragments are JSON at least.
func TestDocJSONLoads(t *testing.T) {
	ref := jsonReference(t)
	for _, file := range docFiles(t) {
		_, fences := readMarkdown(t, file)
		for _, f := range fences {
			if f.lang != "json" {
				continue
			}
			t.Run(fmt.Sprintf("%s:%d", file, f.line), func(t *testing.T) {
				var v map[string]any
				if err := json.Unmarshal([]byte(f.body), &v); err != nil {
					t.Fatalf("%s: not JSON: %v", f, err)
				}
				if f.tagged("fragment") {
					return
				}
				if v["handler"] != "rate_limit" {
					t.Fatalf(`%s: not a rate_limit handler ("handler": %v); mark a piece of one `+"```json fragment", f, v["handler"])
				}
				ref.check(t, []byte(f.body))
				loadHandler(t, []byte(f.body))
			})
		}
	}
}

// maxREADME is the most the README may hold, in bytes: it is the front
// door, and the detail is in docs/.
const maxREADME = 20_000

// TestREADMESize: the README holds no more than maxREADME bytes.
func TestREADMESize(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > maxREADME {
		t.Errorf("README.md is %d bytes, over %d: tighten it, or move detail to docs/", len(b), maxREADME)
	}
}

// TestREADMEJSONIsQuickStart: the README's JSON example is the handler
// that its quick start's Caddyfile adapts to.
func TestREADMEJSONIsQuickStart(t *testing.T) {
	prose, fences := readMarkdown(t, "README.md")
	section := func(line int) string {
		var heading string
		for _, l := range prose[:line-1] {
			if strings.HasPrefix(l, "## ") {
				heading = l
			}
		}
		return heading
	}
	var caddyfile, example *fence
	for i, f := range fences {
		switch {
		case caddyfile == nil && f.lang == "caddy" && section(f.line) == "## Quick start":
			caddyfile = &fences[i]
		case example == nil && f.lang == "json" && section(f.line) == "## JSON":
			example = &fences[i]
		}
	}
	if caddyfile == nil || example == nil {
		t.Fatal("README.md needs a ```caddy block under ## Quick start and a ```json block under ## JSON")
	}
	handlers := rateLimitHandlers(t, adaptCaddyfile(t, caddyfile.body))
	if len(handlers) != 1 {
		t.Fatalf("%s adapts to %d rate_limit handlers, want 1", caddyfile, len(handlers))
	}
	adapted, documented := canonicalHandler(t, handlers[0]), canonicalHandler(t, []byte(example.body))
	if adapted != documented {
		t.Errorf("%s is not the handler %s adapts to:\nREADME:  %s\nadapted: %s", example, caddyfile, documented, adapted)
	}
}

// canonicalHandler is a handler's config with defaults, durations and
// store written one way, so that two spellings of one config compare
// equal.
func canonicalHandler(t *testing.T, raw []byte) string {
	t.Helper()
	var h Handler
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatalf("%v: %s", err, raw)
	}
	if h.StoreRaw != nil {
		var backend struct {
			Backend string `json:"backend"`
		}
		if err := json.Unmarshal(h.StoreRaw, &backend); err != nil {
			t.Fatal(err)
		}
		var s any = new(LocalStore)
		if backend.Backend == "redis" {
			s = new(RedisStore)
		}
		if err := json.Unmarshal(h.StoreRaw, s); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(s)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		m["backend"] = backend.Backend
		h.StoreRaw, _ = json.Marshal(m)
	}
	b, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	var v any
	_ = json.Unmarshal(b, &v) // to sort the keys of the raw parts
	b, _ = json.Marshal(v)
	return string(b)
}

// rateLimitHandlers finds the rate_limit handlers of a JSON config, the
// "handler" key included.
func rateLimitHandlers(t *testing.T, config []byte) [][]byte {
	t.Helper()
	var cfg any
	if err := json.Unmarshal(config, &cfg); err != nil {
		t.Fatal(err)
	}
	var found [][]byte
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "rate_limit" {
				b, _ := json.Marshal(v)
				found = append(found, b)
			}
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(cfg)
	return found
}

// loadHandler loads a handler's JSON as Caddy loads a module: unknown
// fields refused, provisioned (which validates it and its store), then
// cleaned up.
func loadHandler(t *testing.T, raw []byte) {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	delete(m, "handler")
	b, _ := json.Marshal(m)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if _, err := ctx.LoadModuleByID("http.handlers.rate_limit", b); err != nil {
		t.Errorf("loading the handler: %v\n%s", err, raw)
	}
}

// A reference is the JSON fields docs/json.md documents, by the heading
// of their section.
type reference map[string][]string

// The sections of docs/json.md and the struct whose fields each lists.
var referenceSections = []struct {
	heading string
	typ     reflect.Type
	extra   []string // fields that are not struct tags
}{
	{"## Handler", reflect.TypeFor[Handler](), nil},
	{"## Zone", reflect.TypeFor[Zone](), nil},
	{"### count", reflect.TypeFor[caddyhttp.ResponseMatcher](), nil},
	{"### usage", reflect.TypeFor[Usage](), nil},
	{"### concurrency_adaptive", reflect.TypeFor[AdaptiveConcurrency](), nil},
	{"### reserve", reflect.TypeFor[AdaptiveReserve](), nil},
	{"## Local store", reflect.TypeFor[LocalStore](), []string{"backend"}},
	{"## Redis store", reflect.TypeFor[RedisStore](), []string{"backend"}},
	{"### tls", reflect.TypeFor[RedisTLS](), nil},
}

var referenceRow = regexp.MustCompile("^\\| `([a-z0-9_]+)` \\|")

// jsonReference reads the fields of each section of docs/json.md: the
// first cell of its tables' rows.
func jsonReference(t *testing.T) reference {
	t.Helper()
	prose, _ := readMarkdown(t, "docs/json.md")
	ref := make(reference)
	var section string
	for _, line := range prose {
		if strings.HasPrefix(line, "#") {
			section = strings.ReplaceAll(line, "`", "")
			continue
		}
		if m := referenceRow.FindStringSubmatch(line); m != nil {
			ref[section] = append(ref[section], m[1])
		}
	}
	return ref
}

// jsonFields are the names in the struct tags of typ's fields.
func jsonFields(typ reflect.Type) []string {
	var names []string
	for f := range typ.Fields() {
		if f.Anonymous && f.Tag.Get("json") == "" {
			names = append(names, jsonFields(f.Type)...) // a kind's fields (kinds.go)
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			names = append(names, name)
		}
	}
	return names
}

// TestJSONFieldsDocumented: docs/json.md lists every JSON field of the
// handler, its zones, its stores and their nested configs, each in its
// struct's section, and no field that is not there.
func TestJSONFieldsDocumented(t *testing.T) {
	ref := jsonReference(t)
	for _, s := range referenceSections {
		want := append(jsonFields(s.typ), s.extra...)
		got := ref[s.heading]
		for _, name := range want {
			if !slices.Contains(got, name) {
				t.Errorf("docs/json.md, section %q: JSON field %q of %s is not documented", s.heading, name, s.typ)
			}
		}
		for _, name := range got {
			if !slices.Contains(want, name) {
				t.Errorf("docs/json.md, section %q: documents %q, which %s has not", s.heading, name, s.typ)
			}
		}
	}
}

// check fails the test for each key of a handler's JSON that docs/json.md
// does not document where it is.
func (ref reference) check(t *testing.T, raw []byte) {
	t.Helper()
	var h map[string]any
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatal(err)
	}
	keys := func(section string, v any) {
		m, _ := v.(map[string]any)
		for k := range m {
			if !slices.Contains(ref[section], k) && !(section == "## Handler" && k == "handler") {
				t.Errorf("field %q is not in docs/json.md, section %q", k, section)
			}
		}
	}
	keys("## Handler", h)
	var zones []any
	if z, ok := h["zones"].([]any); ok {
		zones = z
	}
	if rl, ok := h["rate_limits"].(map[string]any); ok {
		for _, z := range rl {
			zones = append(zones, z)
		}
	}
	for _, z := range zones {
		keys("## Zone", z)
		if z, ok := z.(map[string]any); ok {
			keys("### count", z["count"])
			keys("### usage", z["usage"])
			keys("### concurrency_adaptive", z["concurrency_adaptive"])
			if a, ok := z["concurrency_adaptive"].(map[string]any); ok {
				reserves, _ := a["reserve"].([]any)
				for _, r := range reserves {
					keys("### reserve", r)
				}
			}
		}
	}
	if s, ok := h["store"].(map[string]any); ok {
		section := map[any]string{"local": "## Local store", "redis": "## Redis store"}[s["backend"]]
		keys(section, s)
		keys("### tls", s["tls"])
	}
}

// TestConfigFieldsHaveDocComments: every exported JSON field of the
// handler, zone, store, usage and adaptive configs has a doc comment of
// its own, written for users, which says its default or that it is
// required, since caddyserver.com renders a module's JSON docs from them.
func TestConfigFieldsHaveDocComments(t *testing.T) {
	types := map[string]bool{"Handler": true, "Zone": true, "LocalStore": true, "RedisStore": true, "RedisTLS": true, "Usage": true, "AdaptiveConcurrency": true, "AdaptiveReserve": true}
	// The kinds' fields are the zone's and the handler's own in JSON
	// (kinds.go), each kind's struct in its own file: every production
	// file is read.
	embedded := func(yield func(reflect.StructField) bool) {
		for f := range reflect.TypeFor[Zone]().Fields() {
			if !yield(f) {
				return
			}
		}
		for f := range reflect.TypeFor[Handler]().Fields() {
			if !yield(f) {
				return
			}
		}
	}
	for f := range embedded {
		if f.Anonymous {
			types[f.Type.Name()] = true
		}
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	files = slices.DeleteFunc(files, func(f string) bool { return strings.HasSuffix(f, "_test.go") })
	goName := regexp.MustCompile(`\b(Handler|Zone|LocalStore|RedisStore|RedisTLS|Usage|AdaptiveConcurrency|AdaptiveReserve)\.[A-Z]`)
	// A field either has a default, or must be set, or is refused (the
	// caddy-ratelimit options that this handler does not take).
	defaultSaid := regexp.MustCompile(`\b(Default:|Required|[Rr]equired with|Refused)`)
	fset := token.NewFileSet()
	found := 0
	for _, file := range files {
		f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			spec, ok := n.(*ast.TypeSpec)
			if !ok || !types[spec.Name.Name] {
				return true
			}
			found++
			for _, field := range spec.Type.(*ast.StructType).Fields.List {
				if len(field.Names) != 1 || !field.Names[0].IsExported() || field.Tag == nil ||
					strings.Contains(field.Tag.Value, `json:"-"`) {
					continue
				}
				where := fmt.Sprintf("%s: %s.%s", fset.Position(field.Pos()), spec.Name.Name, field.Names[0].Name)
				doc := strings.TrimSpace(field.Doc.Text())
				switch {
				case doc == "":
					t.Errorf("%s has no doc comment of its own", where)
				case len(strings.Fields(doc)) < 4 || !strings.HasSuffix(doc, "."):
					t.Errorf("%s: doc comment %q is not a sentence for users", where, doc)
				case !unicode.IsUpper([]rune(doc)[0]) && doc[0] != '`':
					t.Errorf("%s: doc comment should start with a capital: %q", where, doc)
				case goName.MatchString(doc):
					t.Errorf("%s: doc comment names a Go field (%s); name the JSON field", where, goName.FindString(doc))
				case !defaultSaid.MatchString(doc):
					t.Errorf("%s: doc comment says no default (\"Default: ...\"), nor that the field is required", where)
				}
			}
			return false
		})
		for _, field := range fieldsWithSeveralNames(f) {
			t.Errorf("%s: fields declared together share one doc comment; give each its own", fset.Position(field.Pos()))
		}
	}
	if found != len(types) {
		t.Fatalf("found %d of the %d config types", found, len(types))
	}
}

// fieldsWithSeveralNames are the exported struct fields of f declared
// several to a line (A, B string), whose one comment Caddy's docs would
// show for each.
func fieldsWithSeveralNames(f *ast.File) []*ast.Field {
	var out []*ast.Field
	ast.Inspect(f, func(n ast.Node) bool {
		if st, ok := n.(*ast.StructType); ok {
			for _, field := range st.Fields.List {
				if len(field.Names) > 1 && field.Names[0].IsExported() && field.Tag != nil {
					out = append(out, field)
				}
			}
		}
		return true
	})
	return out
}

// TestDocLinksResolve: every relative link of the docs names a file that exists and, for an anchor into a Markdown file, one of
// its headings.
func TestDocLinksResolve(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	code := regexp.MustCompile("`[^`]*`")
	anchors := make(map[string][]string)
	for _, file := range docFiles(t) {
		prose, _ := readMarkdown(t, file)
		for i, line := range prose {
			for _, m := range link.FindAllStringSubmatch(code.ReplaceAllString(line, ""), -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				path = filepath.Join(filepath.Dir(file), path)
				if _, err := os.Stat(path); err != nil {
					t.Errorf("%s:%d: link %s: %v", file, i+1, target, err)
					continue
				}
				if anchor == "" || !strings.HasSuffix(path, ".md") {
					continue
				}
				if _, ok := anchors[path]; !ok {
					anchors[path] = headingAnchors(t, path)
				}
				if !slices.Contains(anchors[path], anchor) {
					t.Errorf("%s:%d: link %s: no heading #%s in %s", file, i+1, target, anchor, path)
				}
			}
		}
	}
}

// headingAnchors are the anchors GitHub gives the headings of a Markdown
// file: lower case, spaces as hyphens, punctuation but hyphens and
// underscores left out, a repeated one numbered.
func headingAnchors(t *testing.T, file string) []string {
	t.Helper()
	prose, _ := readMarkdown(t, file)
	var out []string
	seen := make(map[string]int)
	for _, line := range prose {
		text, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " ")
		if !strings.HasPrefix(line, "#") || !ok {
			continue
		}
		var b strings.Builder
		for _, r := range strings.ToLower(strings.TrimSpace(text)) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			out = append(out, fmt.Sprintf("%s-%d", a, n))
		} else {
			out = append(out, a)
		}
		seen[a]++
	}
	return out
}
