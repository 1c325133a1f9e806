// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// usageConfig is where a zone reads its requests' true cost, and how far
// past empty it may take the bucket.
type usageConfig struct {
	// The request's true cost, read from its response, for an upstream
	// that bills by what it did, such as an LLM API by tokens:
	// `{"json": "usage.total_tokens"}` reads the number at that path of
	// object keys in a JSON response, or in the last event of a
	// `text/event-stream` that has it (OpenAI's usage chunk);
	// `{"header": "X-Usage-Tokens"}` reads a response header or trailer.
	// The request takes its cost when it is admitted, as any request
	// (a reservation: parallel requests cannot outrun the burst); once
	// the response has been sent, the zone's bucket and quota are charged
	// the usage less the cost, or given back the difference. A bucket may
	// so go past empty, by max_debt tokens at most, and then refuses every
	// request until it holds its cost again. A response cut off is
	// charged the usage that went by before the cut; a response without
	// usage keeps its reservation, so set cost to a typical request's
	// usage. Needs a rate or a quota; not with ban or delay. Default: a
	// request's cost is its cost.
	Usage *Usage `json:"usage,omitempty"`

	// How far past empty a response's usage may take the zone's bucket,
	// in tokens. Needs usage and a rate. Default: the burst.
	MaxDebt *int64 `json:"max_debt,omitempty"`
}

var usageKind = kind{
	in: func(z *Zone) bool { return z.Usage != nil },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"usage": func(d *caddyfile.Dispenser, z *Zone) error {
			var err error
			if z.Usage, err = usageArg(d); err != nil {
				return err
			}
			return wrapErr(d, z.Usage.validate())
		},
		"max_debt": func(d *caddyfile.Dispenser, z *Zone) error {
			n, err := intArg[int64](d)
			if err != nil {
				return err
			}
			z.MaxDebt = &n
			return nil
		},
	},
	check: (*Zone).checkUsage,
	shape: (*Zone).withDebt,
	provision: func(z *Zone) error {
		if z.Usage != nil {
			z.Usage.provision()
		}
		return nil
	},
	join: func(h *Handler, z *Zone, st *zoneState) {
		if z.Usage != nil {
			st.usageZone.Store(true)
		}
	},
	descs: []*prometheus.Desc{usageDesc, usageMissingDesc},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, _ *prometheus.Desc, _ zoneID, s *zoneState) {
		if s.usageZone.Load() {
			counter(usageDesc, &s.usage)
			counter(usageMissingDesc, &s.usageMissing)
		}
	},
}

// usageCounts are what a zone with usage counts, in its state.
type usageCounts struct {
	usage        atomic.Uint64 // the usage that responses reported (usage)
	usageMissing atomic.Uint64 // responses without a usage: the requests kept their cost
	usageZone    atomic.Bool   // a zone of this name has usage: export usage and usageMissing
	// noUsage throttles the warnings of responses without a usage: one a
	// minute for the zone, whatever handler has it, and across reloads.
	noUsage throttle.Throttle
}

var (
	usageDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "usage_total"),
		"The usage (such as an LLM API's tokens) that the responses of a zone with usage reported, and were charged.",
		[]string{"zone", "limit"}, nil)
	usageMissingDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "usage_missing_total"),
		"Responses of a zone with usage that reported none (the field missing, not a number, a body too long, a response cut off): their requests kept the cost they took.",
		[]string{"zone", "limit"}, nil)
)

// checkUsage checks usage and max_debt.
func (z *Zone) checkUsage() error {
	if z.Usage == nil {
		if z.MaxDebt != nil {
			return errors.New("max_debt needs usage: it is how far a response's usage may take the bucket past empty")
		}
		return nil
	}
	if err := z.Usage.validate(); err != nil {
		return err
	}
	switch {
	case !z.charges():
		return errors.New("usage needs a rate or a quota: they are what a response's usage is charged to")
	case z.MaxDebt != nil && !z.hasRate():
		return errors.New("max_debt needs a rate: it is how far the bucket may owe")
	case z.MaxDebt != nil && (*z.MaxDebt < 0 || *z.MaxDebt > maxBurst):
		return fmt.Errorf("invalid max_debt %d: must be 0 to %d", *z.MaxDebt, int64(maxBurst))
	}
	return nil
}

// withDebt sets the debt that usage may run up in l: max_debt tokens, by
// default the burst.
func (z *Zone) withDebt(l *gcra.Limit) error {
	if z.Usage == nil || !z.hasRate() {
		return nil
	}
	n := l.Burst
	if z.MaxDebt != nil {
		n = *z.MaxDebt
	}
	if n > int64((gcra.MaxBurstTime-l.BurstTime)/l.TokenTime) {
		return fmt.Errorf("invalid max_debt %d: the burst and the debt must refill within 100 years at rate %s", n, z.rateString())
	}
	l.Owe = l.CostTime(n)
	return nil
}

// usageArg reads the arguments of usage: json <path> or header <field>.
func usageArg(d *caddyfile.Dispenser) (*Usage, error) {
	var kind, v string
	if !d.AllArgs(&kind, &v) {
		return nil, d.Err("usage needs where to read it: usage json <path> or usage header <field>")
	}
	switch kind {
	case "json":
		return &Usage{JSON: v}, nil
	case "header":
		return &Usage{Header: v}, nil
	}
	return nil, d.Errf("invalid usage '%s': expected json <path> or header <field>", kind)
}

// Usage says where a response tells its request's true cost: in JSON,
// the number at a path of object keys, or in a header. Exactly one is
// set.
type Usage struct {
	// The path of object keys, separated by dots, to the number in a JSON
	// response (`application/json` or `+json`), such as
	// `usage.total_tokens`. In a `text/event-stream`, each event's data
	// is read as JSON, and the last event that has the path wins: OpenAI's
	// final chunk with `stream_options.include_usage`. Keys are matched as
	// written, without unescaping. The number is the request's cost in
	// the zone's tokens, at least 0; a fraction rounds up, and a number
	// above 999,999,999,999,999 is read as that. A JSON body over 1 MiB,
	// or one that turns out not to be JSON, has no usage. Set this or
	// header, not both. Default: none.
	JSON string `json:"json,omitempty"`

	// The response header, or trailer (a trailer wins), that holds the
	// number, such as `X-Usage-Tokens`: the request's cost in the zone's
	// tokens, a number as JSON writes it, at least 0; a fraction rounds
	// up. The header is read as the response starts, so one that the
	// site hides from clients with the header handler still counts
	// (reverse_proxy's header_down removes it before it is read); of
	// several values, the last counts. Set this or json, not both.
	// Default: none.
	Header string `json:"header,omitempty"`

	spec usagescan.Spec // where to read it, ready
}

func (u *Usage) validate() error {
	switch {
	case (u.JSON == "") == (u.Header == ""):
		return errors.New("usage needs one of json <path> or header <field>")
	case u.Header != "":
		for i := 0; i < len(u.Header); i++ {
			if c := u.Header[i]; c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
				return fmt.Errorf("invalid usage header '%s': expected a header field name", u.Header)
			}
		}
	default:
		for _, k := range strings.Split(u.JSON, ".") {
			if k == "" {
				return fmt.Errorf("invalid usage json path '%s': expected object keys separated by dots, such as usage.total_tokens", u.JSON)
			}
		}
	}
	return nil
}

func (u *Usage) provision() {
	if u.JSON != "" {
		u.spec = usagescan.JSON(u.JSON)
	} else {
		u.spec = usagescan.Header(u.Header)
	}
}
