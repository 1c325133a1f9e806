// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Command servertests prints the names of the tests, in the packages of
// the folders it is given, that start a Redis server: those that use
// internal/redistest (but for FreePort, which only finds a free port),
// themselves or through the declarations of their package's tests
// (helpers, types, variables) that do. .ci/run runs
// them on each server it tests the Redis store on, beyond the Redis the
// whole suite runs on, so that a test that starts a server runs there
// without being listed by hand.
//
// It reads the source, and errs on the side of running a test: a
// declaration counts as using another when it names it anywhere, even
// as a field or a local variable of the same name.
//
//	go run ./.ci/servertests . ./internal/redisstore
package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

const redistest = "github.com/caddy-tokenbucket/ratelimit/internal/redistest"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: servertests <package folder>...")
		os.Exit(2)
	}
	var tests []string
	for _, dir := range os.Args[1:] {
		found, err := serverTests(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		tests = append(tests, found...)
	}
	sort.Strings(tests)
	for _, t := range tests {
		fmt.Println(t)
	}
}

// serverTests is the tests of the package in dir that use redistest.
func serverTests(dir string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
	if err != nil {
		return nil, err
	}
	// The package's tests and its external tests (package x_test) are
	// one namespace here: a name both declare counts as one.
	names := map[string][]string{} // a declaration's name: the names it uses
	direct := map[string]bool{}    // declarations that use redistest
	var tests []string
	fset := token.NewFileSet()
	for _, path := range files {
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		pkg := "" // the name this file imports redistest by
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == redistest {
				pkg = "redistest"
				if imp.Name != nil {
					pkg = imp.Name.Name
				}
			}
		}
		declare := func(name string, node ast.Node) {
			ast.Inspect(node, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.SelectorExpr:
					if x, ok := n.X.(*ast.Ident); ok && pkg != "" && x.Name == pkg && n.Sel.Name != "FreePort" {
						direct[name] = true
					}
				case *ast.Ident:
					names[name] = append(names[name], n.Name)
				}
				return true
			})
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				declare(d.Name.Name, d)
				if isTest(d) {
					tests = append(tests, d.Name.Name)
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						declare(s.Name.Name, s)
					case *ast.ValueSpec:
						for _, n := range s.Names {
							declare(n.Name, s)
						}
					}
				}
			}
		}
	}
	// What uses a declaration that uses redistest uses it too, until
	// nothing more does.
	uses := direct
	for changed := true; changed; {
		changed = false
		for name, used := range names {
			if uses[name] {
				continue
			}
			for _, u := range used {
				if uses[u] {
					uses[name], changed = true, true
					break
				}
			}
		}
	}
	var found []string
	for _, t := range tests {
		if uses[t] {
			found = append(found, t)
		}
	}
	return found, nil
}

// isTest reports whether d is a test function: TestXxx(t *testing.T).
func isTest(d *ast.FuncDecl) bool {
	name, ok := strings.CutPrefix(d.Name.Name, "Test")
	if !ok || d.Recv != nil || name != "" && strings.ToLower(name[:1]) == name[:1] && name[0] != '_' {
		return false
	}
	params := d.Type.Params.List
	if len(params) != 1 || len(params[0].Names) > 1 {
		return false
	}
	star, ok := params[0].Type.(*ast.StarExpr)
	if !ok {
		return false
	}
	sel, ok := star.X.(*ast.SelectorExpr)
	return ok && sel.Sel.Name == "T"
}
