// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Zones with estimate reserve at admission what a request may use, read
// from its body (an LLM request's max_tokens, its prompt's bytes), in
// place of their cost: parallel requests then cannot take the bucket past
// what they stated. With usage, the settlement charges the true usage
// less the reservation, as it does a cost (settle.go). The body is read
// before the decision, at most 1 MiB of it, and the handlers after this
// one read it as the client sent it: what was read, then the rest as it
// comes.

// estimateConfig is what a zone reserves at admission in place of its
// cost.
type estimateConfig struct {
	// What a request reserves when it is admitted, in place of cost,
	// read from its body: `{"json": ["max_tokens"], "prompt": 4}`
	// reserves the number at max_tokens in a JSON body, plus a token for
	// every 4 bytes of the body. An estimate above the burst reserves the
	// burst. With usage, the settlement charges the true usage less the
	// estimate, or gives back the rest; without, the estimate is the
	// request's cost. Needs a rate or a quota. Default: a request
	// reserves cost.
	Estimate *Estimate `json:"estimate,omitempty"`
}

// Estimate says how a request's cost is estimated from its body: a
// number it states, its length, or both added. At least one is set.
type Estimate struct {
	// Paths of object keys, separated by dots, to a number in the
	// request's JSON body (Content-Type `application/json` or `+json`),
	// such as `max_tokens`: the largest positive number at any of them
	// is the estimate, in the zone's tokens, since the upstream may
	// honour any of them. It is read as usage reads a response's: a
	// fraction rounds up, a number above 999,999,999,999,999 is read as
	// that; a value that is not a positive number (null, a string, 0,
	// -1) states no bound. A request that states none, or whose body is
	// not JSON, is compressed (Content-Encoding) or is over 1 MiB, takes
	// cost instead, and is counted as a missing estimate. Default: none
	// (the estimate is cost).
	JSON []string `json:"json,omitempty"`

	// Bytes of the request's body per token: its length divided by this,
	// rounded up, is added to the estimate (the prompt's tokens, roughly).
	// The length is the Content-Length; for a body without one, that of a
	// JSON body read whole (at most 1 MiB), else the request is counted
	// as a missing estimate and adds nothing. A positive number, such as
	// 4. Default: none.
	Prompt float64 `json:"prompt,omitempty"`

	specs []usagescan.Spec // where JSON reads, ready
}

var estimateKind = kind{
	in: func(z *Zone) bool { return z.Estimate != nil },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"estimate": estimateArg,
	},
	repeatable: []string{"estimate"},
	check:      (*Zone).checkEstimate,
	provision: func(z *Zone) error {
		if z.Estimate != nil {
			z.Estimate.provision()
		}
		return nil
	},
	join: func(_ *Handler, z *Zone, st *zoneState) {
		if z.Estimate != nil {
			st.estimateZone.Store(true)
		}
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if e := z.Estimate; e != nil {
			info.Estimate = &estimateZoneInfo{JSON: e.JSON, Prompt: e.Prompt, Missing: z.state.estimateMissing.Load()}
		}
	},
	descs: []*prometheus.Desc{estimateMissingDesc},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, _ *prometheus.Desc, _ zoneID, s *zoneState) {
		if s.estimateZone.Load() {
			counter(estimateMissingDesc, &s.estimateMissing)
		}
	},
}

// estimateCounts are what a zone with estimate counts, in its state.
type estimateCounts struct {
	estimateMissing atomic.Uint64 // requests that took cost, or no prompt part, for want of an estimate
	estimateZone    atomic.Bool   // a zone of this name has estimate: export estimateMissing
	// noEstimate throttles the warnings of requests without an estimate:
	// one a minute for the zone, whatever handler has it, and across
	// reloads.
	noEstimate throttle.Throttle
}

// estimateInfo is a zone's estimate in the admin API.
type (
	estimateInfo struct {
		Estimate *estimateZoneInfo `json:"estimate,omitempty"`
	}
	estimateZoneInfo struct {
		JSON    []string `json:"json,omitempty"`
		Prompt  float64  `json:"prompt,omitempty"`
		Missing uint64   `json:"missing"` // requests counted as missing an estimate
	}
)

var estimateMissingDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "estimate_missing_total"),
	"Requests of a zone with estimate whose body gave no estimate (none of the paths, not JSON, compressed, over 1 MiB, no length): they reserved the cost instead.",
	[]string{"zone", "limit"}, nil)

// estimateArg reads a line of estimate: json <path>... or prompt
// <bytes-per-token>. A zone has at most one of each.
func estimateArg(d *caddyfile.Dispenser, z *Zone) error {
	if z.Estimate == nil {
		z.Estimate = new(Estimate)
	}
	e := z.Estimate
	if !d.NextArg() {
		return d.Err("estimate needs what to read: estimate json <path>... or estimate prompt <bytes-per-token>")
	}
	switch form := d.Val(); form {
	case "json":
		if e.JSON != nil {
			return d.Errf("zone %s: estimate json already specified", z.Name)
		}
		if e.JSON = d.RemainingArgs(); len(e.JSON) == 0 {
			return d.Err("estimate json needs paths: estimate json <path>..., such as max_tokens")
		}
		return wrapErr(d, e.checkPaths())
	case "prompt":
		if e.Prompt != 0 {
			return d.Errf("zone %s: estimate prompt already specified", z.Name)
		}
		var v string
		if !d.AllArgs(&v) {
			return d.ArgErr()
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return d.Errf("invalid estimate prompt '%s': expected bytes per token, such as 4", v)
		}
		e.Prompt = f
		return wrapErr(d, checkPrompt(f))
	default:
		return d.Errf("invalid estimate '%s': expected json <path>... or prompt <bytes-per-token>", form)
	}
}

// checkEstimate checks estimate, and what it needs of the zone.
func (z *Zone) checkEstimate() error {
	e := z.Estimate
	switch {
	case e == nil:
		return nil
	case len(e.JSON) == 0 && e.Prompt == 0:
		return errors.New("estimate needs json paths or prompt: estimate json <path>... or estimate prompt <bytes-per-token>")
	case !z.charges():
		return errors.New("estimate needs a rate or a quota: they are what the estimate reserves")
	}
	if err := e.checkPaths(); err != nil {
		return err
	}
	if e.Prompt != 0 {
		return checkPrompt(e.Prompt)
	}
	return nil
}

func (e *Estimate) checkPaths() error {
	for _, p := range e.JSON {
		if err := checkJSONPath(p); err != nil {
			return fmt.Errorf("invalid estimate json path '%s': expected object keys separated by dots, such as max_tokens", p)
		}
	}
	return nil
}

// checkJSONPath checks a path of object keys separated by dots.
func checkJSONPath(p string) error {
	for _, k := range strings.Split(p, ".") {
		if k == "" {
			return errors.New("an empty key")
		}
	}
	return nil
}

func checkPrompt(f float64) error {
	if !(f > 0) || math.IsInf(f, 0) {
		return fmt.Errorf("invalid estimate prompt %v: must be a positive number of bytes per token, such as 4", f)
	}
	return nil
}

func (e *Estimate) provision() {
	e.specs = make([]usagescan.Spec, len(e.JSON))
	for i, p := range e.JSON {
		e.specs[i] = usagescan.JSON(p)
	}
}

// reserve is what a request of estimate n reserves in zone z, of
// limit l: the bucket's tokens, and the quota's units, each at most
// what it holds, so that a request that asks for more than the bucket
// holds waits until it is full and takes it all.
func (z *Zone) reserve(n int64, l *gcra.Limit) (time.Duration, int64) {
	units := n
	if z.quota != nil {
		units = min(n, z.quota.limit)
	}
	return l.CostTime(min(n, l.Capacity())), units
}

// estimate is the tokens r reserves in zone z, whose cost for r is cost:
// the largest number at the zone's paths in r's JSON body, or cost,
// plus the prompt part. body is what the request's zones read of r's
// body, once. A request without an estimate is counted, and logged at
// most once a minute for the zone, without the key.
func (h *Handler) estimate(r *http.Request, z *Zone, body *usagescan.Body, cost int64) int64 {
	e := z.Estimate
	n, why := cost, ""
	if len(e.specs) > 0 {
		n, why = e.stated(r, body, cost)
	}
	if e.Prompt > 0 {
		p, known := e.promptPart(r, body)
		if !known && why == "" {
			why = "the request's body has no Content-Length, and is not a JSON body that was read"
		}
		n = min(n+p, usagescan.Max)
	}
	if why != "" {
		z.state.estimateMissing.Add(1)
		if held, ok := z.state.noEstimate.Allow(time.Minute); ok {
			h.logger.Warn("rate limit: no estimate in a request; it reserves the zone's cost",
				zap.String("zone", z.Name), zap.String("reason", why), zap.Int64("more_since_last", held))
		}
	}
	return n
}

// stated is the largest positive number at e's paths in r's JSON body,
// or cost and why it states none. The upstream may honour any of the
// paths (OpenAI-compatible servers take max_completion_tokens over
// max_tokens), so the client cannot pick the smaller bound; a value that
// is not a positive number (null, a string, 0, Ollama's -1 for "no
// limit") states no bound.
func (e *Estimate) stated(r *http.Request, body *usagescan.Body, cost int64) (int64, string) {
	data, why := body.JSON(r)
	if why != "" {
		return cost, why
	}
	bound, unbounded := int64(0), false
	for i := range e.specs {
		n, got := e.specs[i].Read(data)
		switch {
		case got == usagescan.BadJSON:
			return cost, "the request's body is not valid JSON"
		case got == usagescan.Found && n > 0:
			bound = max(bound, n)
		case got == usagescan.Found, got == usagescan.NotNumber:
			unbounded = true
		}
	}
	switch {
	case bound > 0:
		return bound, ""
	case unbounded:
		return cost, "the value at a path is not a positive number"
	}
	return cost, "the request states none of the paths"
}

// promptPart is the prompt part of r's estimate: its body's length over
// e.Prompt, rounded up. known is false when the length is not known: no
// Content-Length, and the body was not read whole.
func (e *Estimate) promptPart(r *http.Request, body *usagescan.Body) (n int64, known bool) {
	length := r.ContentLength
	if length < 0 && !usagescan.IsEmpty(r) {
		body.JSON(r)
		if !body.Whole {
			return 0, false
		}
		length = int64(len(body.Data))
	}
	return int64(min(math.Ceil(float64(max(length, 0))/e.Prompt), usagescan.Max)), true
}

// clampOwnBurst, for a request refused, clamps the reservation of each
// bucket of a zone with estimate whose key's own limit has a burst below
// it to that burst, as the zone's burst clamps it (see reserve), and
// reports whether it clamped one: the request is then decided again.
// Only the store knows a key's own limit, and it refuses a cost above
// it without charging anything.
func (h *Handler) clampOwnBurst(d *store.Demands) bool {
	clamped := false
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if b.Overridden && b.Cost > b.Limit.Room() && h.Zones[b.Zone].Estimate != nil {
			b.Cost, clamped = b.Limit.CostTime(b.Limit.Capacity()), true
		}
	}
	return clamped
}
