// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseCaddyfile)
	// Right after try_files is before basic_auth and before its
	// deprecated spelling basicauth: clients are limited before they can
	// try passwords, and matchers see the rewritten request.
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.After, "try_files")
}

func parseCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(helper.Dispenser)
	return h, err
}

// anonymousZone is the name of the zone given on the directive's line.
const anonymousZone = "default"

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit [<matcher>] [<key> <rate> [<burst>]] {
//		zone <name> {
//			key         <template>
//			rate        <rate>
//			burst       <n>
//			cost        <n>
//			match       { <matchers> }
//			ipv4_prefix <bits>
//			ipv6_prefix <bits>
//			dry_run
//		}
//		store local {
//			max_keys <n>
//		}
//		headers both|legacy|ietf|off
//		jitter  <fraction>
//		log_key
//		dry_run
//		disable_metrics
//	}
//
// The line form `rate_limit <key> <rate> [<burst>]` is a zone named
// "default". For zones written for github.com/mholt/caddy-ratelimit,
// `window <duration>` with `events <n>` means `rate <n>/<duration>` and
// `burst <n>`.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name

	switch args := d.RemainingArgs(); len(args) {
	case 0:
	case 2, 3:
		z := &Zone{Name: anonymousZone, Key: args[0], Rate: args[1]}
		if len(args) == 3 {
			n, err := strconv.ParseInt(args[2], 10, 64)
			if err != nil || n < 1 {
				return d.Errf("invalid burst '%s': expected a whole number of at least 1", args[2])
			}
			z.Burst = n
		}
		if err := z.validate(); err != nil {
			return d.Errf("%v", err)
		}
		h.Zones = append(h.Zones, z)
	default:
		return d.Errf("wrong argument count: expected <key> <rate> [<burst>], got %d arguments", len(args))
	}

	seen := make(map[string]bool)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if sub != "zone" && seen[sub] {
			return d.Errf("%s already specified", sub)
		}
		seen[sub] = true
		switch sub {
		case "zone":
			if !d.NextArg() {
				return d.Err("zone needs a name: zone <name> { ... }")
			}
			name := d.Val()
			for _, z := range h.Zones {
				if z.Name == name {
					return d.Errf("duplicate zone name '%s'", name)
				}
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			z, err := unmarshalZone(d, name)
			if err != nil {
				return err
			}
			h.Zones = append(h.Zones, z)

		case "store":
			if !d.NextArg() {
				return d.Err("store needs a backend: store local|redis { ... }")
			}
			name := d.Val()
			unm, err := caddyfile.UnmarshalModule(d, "http.handlers.rate_limit.stores."+name)
			if err != nil {
				return err
			}
			h.StoreRaw = caddyconfig.JSONModuleObject(unm, "backend", name, nil)

		case "headers":
			if !d.AllArgs(&h.Headers) {
				return d.ArgErr()
			}
			if _, ok := headerModes[h.Headers]; !ok || h.Headers == "" {
				return d.Errf("invalid headers '%s': expected both, legacy, ietf or off", h.Headers)
			}

		case "jitter":
			if !d.NextArg() {
				return d.ArgErr()
			}
			f, err := strconv.ParseFloat(d.Val(), 64)
			if err != nil || f < 0 || f > 1 || math.IsNaN(f) {
				return d.Errf("invalid jitter '%s': expected a fraction between 0 and 1, such as 0.1", d.Val())
			}
			h.Jitter = f
			if d.NextArg() {
				return d.ArgErr()
			}

		case "log_key", "dry_run", "disable_metrics":
			if d.NextArg() {
				return d.ArgErr()
			}
			switch d.Val() {
			case "log_key":
				h.LogKey = true
			case "dry_run":
				h.DryRun = true
			default:
				h.DisableMetrics = true
			}

		case "distributed", "storage":
			return d.Errf("'%s' is a github.com/mholt/caddy-ratelimit option: use 'store redis { ... }' to share limits between instances", d.Val())
		case "sweep_interval":
			return d.Err("'sweep_interval' is a github.com/mholt/caddy-ratelimit option: refilled buckets are dropped automatically")
		default:
			return d.Errf("unrecognized subdirective '%s'", d.Val())
		}
	}
	if len(h.Zones) == 0 {
		return d.Err("no zones: use 'rate_limit <key> <rate> [<burst>]' or a 'zone <name> { ... }' block")
	}
	return nil
}

// unmarshalZone reads the block of `zone <name>`.
func unmarshalZone(d *caddyfile.Dispenser, name string) (*Zone, error) {
	z := &Zone{Name: name}
	var window, events string
	seen := make(map[string]bool)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return nil, d.Errf("zone %s: %s already specified", name, sub)
		}
		seen[sub] = true
		switch sub {
		case "key":
			if !d.AllArgs(&z.Key) {
				return nil, d.ArgErr()
			}
		case "rate":
			if !d.AllArgs(&z.Rate) {
				return nil, d.ArgErr()
			}
			if _, _, err := parseRate(z.Rate); err != nil {
				return nil, d.Errf("invalid rate '%s': %v", z.Rate, err)
			}
		case "burst", "cost":
			n, err := intArg(d)
			if err != nil {
				return nil, err
			}
			if n < 1 {
				return nil, d.Errf("invalid %s '%s': must be at least 1", sub, d.Val())
			}
			if sub == "burst" {
				z.Burst = n
			} else {
				z.Cost = n
			}
		case "ipv4_prefix", "ipv6_prefix":
			n, err := intArg(d)
			if err != nil {
				return nil, err
			}
			bits := int64(32)
			if sub == "ipv6_prefix" {
				bits = 128
			}
			if n < 1 || n > bits {
				return nil, d.Errf("invalid %s '%s': expected 1 to %d bits", sub, d.Val(), bits)
			}
			if sub == "ipv4_prefix" {
				z.IPv4Prefix = int(n)
			} else {
				z.IPv6Prefix = int(n)
			}
		case "dry_run":
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			z.DryRun = true
		case "match":
			set, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
			if err != nil {
				return nil, err
			}
			z.MatcherSetsRaw = append(z.MatcherSetsRaw, set)
		case "window":
			if !d.AllArgs(&window) {
				return nil, d.ArgErr()
			}
			if w, err := caddy.ParseDuration(window); err != nil || w <= 0 {
				return nil, d.Errf("invalid window '%s': expected a positive duration such as 1m", window)
			}
		case "events":
			n, err := intArg(d)
			if err != nil {
				return nil, err
			}
			if n < 1 {
				return nil, d.Errf("invalid events '%s': must be at least 1", d.Val())
			}
			events = d.Val()
		default:
			return nil, d.Errf("unrecognized zone subdirective '%s'", sub)
		}
	}

	// caddy-ratelimit's window and events: events per window, all of them
	// at once if the client was idle.
	switch {
	case window == "" && events == "":
	case z.Rate != "":
		return nil, d.Errf("zone %s: use either rate or window and events, not both", name)
	case window == "" || events == "":
		return nil, d.Errf("zone %s: window and events go together", name)
	case z.Burst != 0:
		return nil, d.Errf("zone %s: events is already the burst of window and events", name)
	default:
		z.Rate = events + "/" + window
		z.Burst, _ = strconv.ParseInt(events, 10, 64)
	}
	if err := z.validate(); err != nil {
		return nil, d.Errf("zone %s: %v", name, err)
	}
	return z, nil
}

// intArg reads the subdirective's one argument as an integer.
func intArg(d *caddyfile.Dispenser) (int64, error) {
	sub := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	n, err := strconv.ParseInt(d.Val(), 10, 64)
	if err != nil {
		return 0, d.Errf("invalid %s '%s': expected a whole number", sub, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return n, nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
