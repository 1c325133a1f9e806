// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package lua holds the Redis store's scripts, whose headers give their
// protocol (KEYS, ARGV sections, the reply, units). The decision script's
// source is split by concern into the files of decide/, which are joined
// in the order of their names into one script: one EVALSHA a call, as
// ever. It knows nothing of Go's side of the protocol.
package lua

import (
	"embed"
	"strings"
)

//go:embed decide/*.lua
var decide embed.FS

// Decide is the decision script: the decisions of many requests in one
// atomic call. Each file of decide/ starts with a line naming it, so
// that a line of Redis's errors (user_script:N) can be found in its file.
var Decide = join(decide, "decide")

// Peek is the script of the admin API's reads: a key's state, changing
// nothing.
//
//go:embed peek.lua
var Peek string

// Override is the script that sets or removes a key's own limit and its
// entry in the zone's list in one step.
//
//go:embed override.lua
var Override string

// join is the files of dir in fsys, in the order of their names, each
// after a line naming it.
func join(fsys embed.FS, dir string) string {
	entries, err := fsys.ReadDir(dir)
	if err != nil {
		panic(err) // embedded: never
	}
	var b strings.Builder
	for _, e := range entries {
		src, err := fsys.ReadFile(dir + "/" + e.Name())
		if err != nil {
			panic(err)
		}
		b.WriteString("-- file: lua/" + dir + "/" + e.Name() + "\n")
		b.Write(src)
	}
	return b.String()
}
