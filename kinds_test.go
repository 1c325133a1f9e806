// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestKindsParsed: every subdirective that the directive's syntax lists,
// of a zone block and of the directive itself, is one the parser reads
// (a kind left out of kinds would leave its own unrecognized), and every
// subdirective a kind registers is in the syntax, so that the README
// tells of it.
func TestKindsParsed(t *testing.T) {
	var zoneSubs, handlerSubs []string
	block := "" // the directive's subdirective whose block the line is in
	for line := range strings.Lines(parserSyntax(t, "caddyfile.go", "Handler")) {
		depth := len(line) - len(strings.TrimLeft(line, "\t"))
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0] == "}" {
			continue
		}
		switch name := fields[0]; {
		case depth == 1:
			block = name
			if name != "zone" && name != "store" {
				handlerSubs = append(handlerSubs, name)
			}
		case depth == 2 && block == "zone" && !slices.Contains(zoneSubs, name):
			zoneSubs = append(zoneSubs, name)
		}
	}
	if len(zoneSubs) < 20 || len(handlerSubs) < 5 {
		t.Fatalf("read %d zone and %d directive subdirectives from the syntax: %v %v", len(zoneSubs), len(handlerSubs), zoneSubs, handlerSubs)
	}
	for _, name := range zoneSubs {
		err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit {\n\tzone a {\n\t\t" + name + "\n\t}\n}"))
		if err != nil && strings.Contains(err.Error(), "unrecognized") {
			t.Errorf("zone subdirective %s, in the syntax, is not read: %v", name, err)
		}
	}
	for _, name := range handlerSubs {
		err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit {\n\t" + name + "\n}"))
		if err != nil && strings.Contains(err.Error(), "unrecognized") {
			t.Errorf("subdirective %s, in the syntax, is not read: %v", name, err)
		}
	}
	for name := range zoneSubdirectives {
		if !slices.Contains(zoneSubs, name) {
			t.Errorf("zone subdirective %s, which a kind reads, is not in the syntax", name)
		}
	}
	for name := range handlerSubdirectives {
		if !slices.Contains(handlerSubs, name) {
			t.Errorf("subdirective %s, which a kind reads, is not in the syntax", name)
		}
	}
}
