// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Stops reads how a request goes through the handler's files: it follows
// the request's scratch from a method of Handler (decide, or the one
// named after the package's directory) through the functions it is
// passed to (an argument of type *scratch, or the receiver of a method
// called on it), depth first in source order, each call site once per
// way in. It prints each function entered with its file, then how many
// stops that made, in how many files, and how many times the way came
// back to a file it had left: as a callee's file, or as its caller's
// again on return.
//
//	cd bench && go run ./stops ..            # from Handler.decide
//	cd bench && go run ./stops .. ServeHTTP  # the whole request
package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

type fn struct {
	file string
	decl *ast.FuncDecl
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: stops <package dir> [<Handler method>]")
		os.Exit(2)
	}
	dir := os.Args[1]
	start := "decide"
	if len(os.Args) > 2 {
		start = os.Args[2]
	}
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		panic(err)
	}
	funcs := map[string]fn{}
	for _, p := range pkgs {
		files := make([]string, 0, len(p.Files))
		for name := range p.Files {
			files = append(files, name)
		}
		sort.Strings(files)
		for _, name := range files {
			for _, d := range p.Files[name].Decls {
				if fd, ok := d.(*ast.FuncDecl); ok {
					funcs[fd.Name.Name+"/"+recv(fd)] = fn{filepath.Base(name), fd}
				}
			}
		}
	}
	var path, trace, stack []string
	seen := map[string]bool{}
	var walk func(key string)
	walk = func(key string) {
		f, ok := funcs[key]
		if !ok || seen[key] {
			return
		}
		seen[key] = true
		defer delete(seen, key) // entered again by a later call, counted again
		path = append(path, f.file+" "+key)
		trace = append(trace, f.file)
		defer func() {
			if len(stack) > 0 {
				trace = append(trace, stack[len(stack)-1])
			}
		}()
		stack = append(stack, f.file)
		defer func() { stack = stack[:len(stack)-1] }()
		// the name the scratch has in f: a parameter of type *scratch, or the receiver
		names := map[string]bool{}
		for _, l := range append(f.decl.Type.Params.List, recvList(f.decl)...) {
			if st, ok := l.Type.(*ast.StarExpr); ok {
				if id, ok := st.X.(*ast.Ident); ok && id.Name == "scratch" {
					for _, n := range l.Names {
						names[n.Name] = true
					}
				}
			}
		}
		if key == start+"/Handler" {
			names["sc"] = true
		}
		ast.Inspect(f.decl.Body, func(n ast.Node) bool {
			c, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			passes := false
			for _, a := range c.Args {
				if id, ok := a.(*ast.Ident); ok && names[id.Name] {
					passes = true
				}
			}
			sel, ok := c.Fun.(*ast.SelectorExpr)
			if !ok {
				if id, ok := c.Fun.(*ast.Ident); ok && passes {
					walk(id.Name + "/")
				}
				return true
			}
			if x, ok := sel.X.(*ast.Ident); ok && names[x.Name] {
				walk(sel.Sel.Name + "/scratch")
				return true
			}
			if passes {
				t := ""
				if x, ok := sel.X.(*ast.Ident); ok && f.decl.Recv != nil && len(f.decl.Recv.List[0].Names) > 0 && f.decl.Recv.List[0].Names[0].Name == x.Name {
					t = recv(f.decl)
				}
				var match []string
				for k := range funcs {
					if strings.HasPrefix(k, sel.Sel.Name+"/") && (t == "" || k == sel.Sel.Name+"/"+t) {
						match = append(match, k)
					}
				}
				if len(match) == 1 {
					walk(match[0])
				}
			}
			return true
		})
	}
	walk(start + "/Handler")
	for _, p := range path {
		fmt.Println(p)
	}
	// returns: the times the request's way, as the files it is in one
	// after another (a callee's file, then its caller's again), comes back
	// to a file it left before.
	files := map[string]bool{}
	returns := 0
	last := ""
	for _, file := range trace {
		if file != last && files[file] {
			returns++
		}
		files[file] = true
		last = file
	}
	fmt.Printf("%d stops in %d files, %d returns to a file already left\n", len(path), len(files), returns)
}

func recvList(fd *ast.FuncDecl) []*ast.Field {
	if fd.Recv == nil {
		return nil
	}
	return fd.Recv.List
}

func recv(fd *ast.FuncDecl) string {
	if fd.Recv == nil {
		return ""
	}
	t := fd.Recv.List[0].Type
	if st, ok := t.(*ast.StarExpr); ok {
		t = st.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}
