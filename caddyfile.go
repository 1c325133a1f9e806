// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"fmt"
	"strconv"
	"time"

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
//			rate        <rate>|<placeholders>
//			burst       <n>|<placeholders>
//			cost        <n>|<placeholders>
//			match       { <matchers> }
//			ipv4_prefix <bits>
//			ipv6_prefix <bits>
//			ban         <duration>
//			delay       <duration>  # wait up to this long for tokens instead of a 429
//			count       { status <codes...>; header <field> [<value>] }
//			concurrency <n>         # requests in flight per key; a rate is then optional
//			concurrency adaptive {  # a limit in flight learnt from latency; the block is optional
//				min <n>             # default 4
//				max <n>             # default 1000
//				priority <placeholders>  # a request's class, for reserve
//				reserve <class> <n>%     # held back for a class and those above; from the highest
//			}
//			lease       <duration>  # with concurrency: how long a Redis slot is held
//			priority    <placeholders>  # a request's class, for reserve
//			reserve     <class> <n>%  # burst kept for classes above
//			quota       <n> per day|week|month  # a calendar quota per key; a rate is then optional
//			usage       json <path>|header <field>  # the true cost, read from the response
//			max_debt    <n>         # with usage: how far past empty it may take the bucket
//			estimate    json <path>...  # reserve what the request states
//			estimate    prompt <bytes>  # plus a token per <bytes> of body
//			max_overrides <n>       # keys with their own limit, set through the admin API
//			timezone    <IANA zone>             # where the quota's days start; default UTC
//			sync        <duration>  # decide here, reconcile with Redis this often
//			share       <duration>  # busy keys from shares of Redis's tokens
//			dry_run
//			spill                   # over the limit, go on marked
//			window      <duration>  # with events: caddy-ratelimit's form of rate and burst
//			events      <n>
//		}
//		store local {
//			max_keys         <n>
//			persist          on|off
//			persist_interval <duration>
//		}
//		store redis {
//			address <host:port>...
//			<other options of the Redis store>
//		}
//		headers both|legacy|ietf|off
//		grpc_status resource_exhausted|unavailable|off  # the gRPC code of a 429
//		jitter  <fraction>
//		max_delayed <n>  # requests waiting for zones with delay at once
//		log_key
//		dry_run
//		disable_metrics
//		sweep_interval <duration>  # caddy-ratelimit's; ignored
//	}
//
// The line form `rate_limit <key> <rate> [<burst>]` is a zone named
// "default". For zones written for github.com/mholt/caddy-ratelimit,
// `window <duration>` with `events <n>` (instead of rate and burst) means
// `rate <n>/<duration>` and `burst <n>`, with caddy-ratelimit's meaning of
// the key; its `sweep_interval` is accepted and ignored.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name

	switch args := d.RemainingArgs(); len(args) {
	case 0:
	case 2, 3:
		z := &Zone{Name: anonymousZone, Key: args[0], Rate: args[1]}
		if hasPlaceholders(args[1]) {
			if err := checkRateTemplate(args[1]); err != nil {
				return d.WrapErr(err)
			}
		}
		if len(args) == 3 {
			if err := wholeOrVar("burst", args[2], &z.Burst, &z.burstVar); err != nil {
				return d.WrapErr(err)
			}
			if z.burstVar.template == "" {
				if err := checkBurst(z.Burst); err != nil {
					return d.WrapErr(err)
				}
			}
		}
		if err := z.validate(); err != nil {
			return d.WrapErr(err)
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
		var err error
		switch sub {
		case "zone":
			if err := h.unmarshalZone(d); err != nil {
				return err
			}
		case "store":
			if err := h.unmarshalStore(d); err != nil {
				return err
			}
		case "headers":
			if !d.AllArgs(&h.Headers) {
				return d.ArgErr()
			}
			err = checkHeaderMode(h.Headers)
		case "grpc_status":
			if !d.AllArgs(&h.GRPCStatus) {
				return d.ArgErr()
			}
			err = checkGRPCStatus(h.GRPCStatus)
		case "jitter":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			if h.Jitter, err = strconv.ParseFloat(v, 64); err != nil {
				return d.Errf("invalid jitter '%s': expected a fraction such as 0.1", v)
			}
			err = checkJitter(h.Jitter)
		case "log_key":
			if err := flag(d, &h.LogKey); err != nil {
				return err
			}
		case "dry_run":
			if err := flag(d, &h.DryRun); err != nil {
				return err
			}
		case "disable_metrics":
			if err := flag(d, &h.DisableMetrics); err != nil {
				return err
			}
		case "distributed":
			return d.Err("'distributed' is a github.com/mholt/caddy-ratelimit option: use 'store redis { ... }' to share limits between instances")
		case "storage":
			return d.Err("'storage' is a github.com/mholt/caddy-ratelimit option: use 'store redis { ... }' to share limits between instances")
		case "sweep_interval":
			// caddy-ratelimit's; accepted and ignored: refilled buckets
			// carry nothing, and the store drops them by itself.
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			w, err := caddy.ParseDuration(v)
			if err != nil || w < 0 {
				return d.Errf("invalid sweep_interval '%s': expected a duration such as 1m", v)
			}
			h.SweepInterval = caddy.Duration(w)
		default:
			parse := handlerSubdirectives[sub]
			if parse == nil {
				return d.Errf("unrecognized subdirective '%s'", sub)
			}
			if err := parse(d, h); err != nil {
				return err
			}
		}
		if err != nil {
			return d.WrapErr(err)
		}
	}
	if len(h.Zones) == 0 {
		return d.Err("no zones: use 'rate_limit <key> <rate> [<burst>]' or a 'zone <name> { ... }' block")
	}
	if err := h.checkKinds(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// unmarshalStore reads `store <backend> [{ ... }]`.
func (h *Handler) unmarshalStore(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Err("store needs a backend: store local|redis { ... }")
	}
	name := d.Val()
	unm, err := caddyfile.UnmarshalModule(d, "http.handlers.rate_limit.stores."+name)
	if err != nil {
		return err
	}
	h.StoreRaw = caddyconfig.JSONModuleObject(unm, "backend", name, nil)
	return nil
}

// unmarshalZone reads `zone <name> { ... }`.
func (h *Handler) unmarshalZone(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Err("zone needs a name: zone <name> { ... }")
	}
	name := d.Val()
	if err := checkZoneName(name); err != nil {
		return d.WrapErr(err)
	}
	for _, z := range h.Zones {
		if z.Name == name {
			return d.Errf("duplicate zone name '%s'", name)
		}
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	z := &Zone{Name: name}
	seen := make(map[string]bool)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] && !zoneRepeatable[sub] {
			return d.Errf("zone %s: %s already specified", name, sub)
		}
		seen[sub] = true
		var err error
		switch sub {
		case "key":
			if !d.AllArgs(&z.Key) {
				return d.ArgErr()
			}
		case "rate":
			if !d.AllArgs(&z.Rate) {
				return d.ArgErr()
			}
			if hasPlaceholders(z.Rate) {
				err = checkRateTemplate(z.Rate)
			} else {
				_, _, err = parseRate(z.Rate)
			}
		case "burst":
			if err := limitArg(d, &z.Burst, &z.burstVar); err != nil {
				return err
			}
			if z.burstVar.template == "" {
				err = checkBurst(z.Burst)
			}
		case "cost":
			if err := limitArg(d, &z.Cost, &z.costVar); err != nil {
				return err
			}
			if z.costVar.template == "" {
				err = checkMin("cost", z.Cost, 1)
			}
		case "ipv4_prefix":
			if z.IPv4Prefix, err = intArg[int](d); err != nil {
				return err
			}
			err = checkIPv4Prefix(z.IPv4Prefix)
		case "ipv6_prefix":
			if z.IPv6Prefix, err = intArg[int](d); err != nil {
				return err
			}
			err = checkIPv6Prefix(z.IPv6Prefix)
		case "match":
			set, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
			if err != nil {
				return err
			}
			z.MatcherSetsRaw = append(z.MatcherSetsRaw, set)
		case "window":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			w, err := caddy.ParseDuration(v)
			if err != nil || w <= 0 {
				return d.Errf("invalid window '%s': expected a positive duration such as 1m", v)
			}
			z.Window = caddy.Duration(w)
		case "events":
			if z.MaxEvents, err = intArg[int64](d); err != nil {
				return err
			}
			err = cmp.Or(checkMin("events", z.MaxEvents, 1), checkBurst(z.MaxEvents))
		default:
			parse := zoneSubdirectives[sub]
			if parse == nil {
				return d.Errf("unrecognized zone subdirective '%s'", sub)
			}
			if err := parse(d, z); err != nil {
				return err
			}
		}
		if err != nil {
			return d.WrapErr(err)
		}
	}

	// caddy-ratelimit's window and events: events per window, all of them
	// at once if the client was idle.
	switch {
	case !z.windowForm():
	case z.Rate != "":
		return d.Errf("zone %s: use either rate or window and events, not both", name)
	case z.Window == 0 || z.MaxEvents == 0:
		return d.Errf("zone %s: window and events go together", name)
	case z.Burst != 0 || z.burstVar.template != "":
		return d.Errf("zone %s: events is already the burst of window and events", name)
	}
	if err := z.validate(); err != nil {
		return d.Errf("zone %s: %v", name, err)
	}
	if _, err := jsonVarsOf([]*Zone{z}); err != nil {
		return d.Err(err.Error())
	}
	h.Zones = append(h.Zones, z)
	return nil
}

// durationArg reads the subdirective's one argument as a duration; a
// duration such as example is what the error expects.
func durationArg(d *caddyfile.Dispenser, example string) (time.Duration, error) {
	sub := d.Val()
	var v string
	if !d.AllArgs(&v) {
		return 0, d.ArgErr()
	}
	t, err := caddy.ParseDuration(v)
	if err != nil {
		return 0, d.Errf("invalid %s '%s': expected a duration such as %s", sub, v, example)
	}
	return t, nil
}

// intArg reads the subdirective's one argument as a whole number.
func intArg[T ~int | ~int64](d *caddyfile.Dispenser) (T, error) {
	sub := d.Val()
	if !d.NextArg() {
		return 0, d.ArgErr()
	}
	n, err := strconv.ParseInt(d.Val(), 10, 64)
	if err != nil || int64(T(n)) != n {
		return 0, d.Errf("invalid %s '%s': expected a whole number", sub, d.Val())
	}
	if d.NextArg() {
		return 0, d.ArgErr()
	}
	return T(n), nil
}

// limitArg reads the one argument of burst or cost: a whole number, or
// placeholders that give one per request.
func limitArg(d *caddyfile.Dispenser, n *int64, v *valueVar) error {
	sub := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return d.ArgErr()
	}
	if err := wholeOrVar(sub, s, n, v); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

// wholeOrVar reads s, the value of field, as a whole number into n, or,
// when it holds placeholders, as a template into v.
func wholeOrVar(field, s string, n *int64, v *valueVar) error {
	if hasPlaceholders(s) {
		if err := checkWholeTemplate(field, s); err != nil {
			return err
		}
		*v = newValueVar(s)
		return nil
	}
	x, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return fmt.Errorf("invalid %s '%s': expected a whole number, or placeholders such as {plan_%s}", field, s, field)
	}
	*n = x
	return nil
}

// flag reads a subdirective without arguments that turns v on.
func flag(d *caddyfile.Dispenser, v *bool) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	*v = true
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
