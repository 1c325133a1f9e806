// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
)

// Zones with count charge only the requests whose response matches: a
// request takes its tokens before it goes on, as any request, and a
// response that does not match gives them back, in the adjustment that
// settles the request after its response (settle.go).

// countConfig is the response matcher of a zone with count.
type countConfig struct {
	// Charge only the requests whose response matches: a request still
	// takes its tokens before it goes on (so concurrent requests cannot
	// outrun the burst), and gets them back after a response that does
	// not match, e.g. `{"status_code": [401, 403]}` to count failed
	// logins only. Needs a rate. Default: every request counts.
	Count *caddyhttp.ResponseMatcher `json:"count,omitempty"`
}

var countKind = kind{
	in: func(z *Zone) bool { return z.Count != nil },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"count": func(d *caddyfile.Dispenser, z *Zone) error {
			// The response matcher of handle_response and reverse_proxy,
			// with count as its name.
			m := make(map[string]caddyhttp.ResponseMatcher)
			if err := caddyhttp.ParseNamedResponseMatcher(d.NewFromNextSegment(), m); err != nil {
				return err
			}
			rm := m["count"]
			z.Count = &rm
			return wrapErr(d, checkCount(&rm))
		},
	},
	check: func(z *Zone) error {
		switch {
		case z.Count == nil:
			return nil
		case !z.charges():
			return errors.New("count needs a rate: it gives tokens back")
		}
		return checkCount(z.Count)
	},
	descs: []*prometheus.Desc{refundsDesc},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, _ *prometheus.Desc, _ zoneID, s *zoneState) {
		counter(refundsDesc, &s.refunds)
	},
}

// countCounts are what count counts, in a zone's state.
type countCounts struct {
	refunds atomic.Uint64 // allowed requests given their tokens back (count)
}

var refundsDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "refunds_total"),
	"Allowed requests whose tokens a zone with count gave back, as their response did not match.",
	[]string{"zone", "limit"}, nil)

func checkCount(m *caddyhttp.ResponseMatcher) error {
	if len(m.StatusCode) == 0 && len(m.Headers) == 0 {
		return errors.New("count needs a response matcher: status <codes> or header <field> [<value>]")
	}
	for _, c := range m.StatusCode {
		if c < 1 || c > 5 && c < 100 || c > 599 {
			return fmt.Errorf("invalid count status %d: expected a status code or a class such as 4xx", c)
		}
	}
	return nil
}
