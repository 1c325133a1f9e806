// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Plans and tiers: a zone whose rate, burst or cost holds placeholders
// (`rate {plan_rate}`, filled by a `map` of the client's plan) gives each
// request the limit that the placeholders' values say. A key keeps one
// bucket whatever its plan: the bucket is one instant (when it is full
// again) and the whole-bucket time of the limit that wrote it, so that a
// change of plan keeps the fraction of the bucket owed (see
// limit.rescale).
//
// Each distinct set of values is parsed once, into a plan that requests
// then carry to the stores and the headers; a zone keeps at most
// maxPlans of them. A value that does not make a valid limit, or one
// more than maxPlans, answers 500 and is logged once.

// A plan is one limit of a zone: the bucket's shape and the request's
// cost, computed once. A zone with fixed numbers has one plan; a zone
// with placeholders one per distinct set of values.
type plan struct {
	limit    gcra.Limit
	cost     int64         // tokens a request takes
	costTime time.Duration // what cost tokens are worth: limit.costTime(cost)
}

// newPlan is the plan of limit l and a cost of cost tokens.
func newPlan(l gcra.Limit, cost int64) *plan {
	return &plan{limit: l, cost: cost, costTime: l.CostTime(cost)}
}

// unknownPlan reads the bucket of a zone whose limit depends on the
// request, where no request says which (the admin API): it clamps
// nothing, and tells only when the bucket is full again.
var unknownPlan = &plan{limit: gcra.Limit{TokenTime: gcra.MaxBurstTime, BurstTime: gcra.MaxBurstTime, Burst: 1}}

// adminLimit is the limit of z's buckets as the admin API reads them,
// outside of any request: unknownPlan for a zone whose limit comes with
// each request.
func (z *Zone) adminLimit() gcra.Limit {
	if z.plans != nil {
		return unknownPlan.limit
	}
	return z.limit
}

// knownLimit reports whether the admin API knows the limit of the bucket
// b read: for a zone whose limit comes with each request, only a key's
// own limit is known without a request.
func (z *Zone) knownLimit(b *store.BucketDemand) bool { return z.plans == nil || b.Overridden }

// maxPlans is the most distinct limits a zone with placeholders keeps:
// beyond them, a request with yet another limit answers 500. It bounds
// the memory that values a client can choose could take.
const maxPlans = 1000

// maxRefusalsLogged is how many distinct refused values a zone logs each
// once; beyond them, refusals are logged at most once a minute.
const maxRefusalsLogged = 100

// A valueVar is a configured value with placeholders, expanded for each
// request.
type valueVar struct {
	template string // "" for a fixed value
	// When the template is just one placeholder: its name, and, for the
	// common ones read without the replacer's search, what it reads.
	name    string
	varName string // http.vars.<varName>
	header  string // http.request.header.<header>, canonical
}

func newValueVar(s string) valueVar {
	v := valueVar{template: s}
	if len(s) > 2 && s[0] == '{' && s[len(s)-1] == '}' && !strings.ContainsAny(s[1:len(s)-1], "{}\\") {
		v.name = s[1 : len(s)-1]
		if name, ok := strings.CutPrefix(v.name, "http.vars."); ok {
			v.varName = name
		} else if name, ok := strings.CutPrefix(v.name, "http.request.header."); ok {
			v.header = textproto.CanonicalMIMEHeaderKey(name)
		}
	}
	return v
}

// A source is where a request's values come from, each looked up in
// its context once, when first needed.
type source struct {
	r        *http.Request
	vars     map[string]any
	repl     *caddy.Replacer
	varsRead bool
}

func (src *source) replacer() *caddy.Replacer {
	if src.repl == nil {
		src.repl, _ = src.r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if src.repl == nil {
			src.repl = caddy.NewReplacer()
		}
	}
	return src.repl
}

// expand is the value for a request: "" for a fixed value. Variables and
// request headers are read as Caddy's replacer reads them, without its
// search through every placeholder it knows.
func (v *valueVar) expand(src *source) string {
	switch {
	case v.template == "":
		return ""
	case v.varName != "":
		if !src.varsRead {
			src.vars, _ = src.r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
			src.varsRead = true
		}
		return caddy.ToString(src.vars[v.varName])
	case v.header != "":
		return strings.Join(src.r.Header[v.header], ",")
	case v.name != "":
		s, _ := src.replacer().GetString(v.name)
		return s
	}
	return src.replacer().ReplaceAll(v.template, "")
}

// hasPlaceholders reports whether a configured value is a template.
func hasPlaceholders(s string) bool { return strings.Contains(s, "{") }

// perRequest reports whether the zone's limit depends on the request.
func (z *Zone) perRequest() bool {
	return hasPlaceholders(z.Rate) || z.burstVar.template != "" || z.costVar.template != ""
}

// The characters that a template may hold outside its placeholders.
const (
	rateChars  = "0123456789.r/nsuµmhd"
	wholeChars = "0123456789"
)

// checkTemplate checks the shape of a value with placeholders, all that
// can be known of it before a request brings the placeholders' values:
// every '{' has its '}', and the text around the placeholders could be
// part of a value (chars).
func checkTemplate(field, s, chars, example string) error {
	open := -1
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '{' && open >= 0:
			return fmt.Errorf("invalid %s '%s': '{' inside a placeholder", field, s)
		case c == '{':
			open = i
		case c == '}' && open < 0:
			return fmt.Errorf("invalid %s '%s': '}' without its '{'", field, s)
		case c == '}' && i == open+1:
			return fmt.Errorf("invalid %s '%s': empty placeholder", field, s)
		case c == '}':
			open = -1
		case open < 0 && strings.IndexByte(chars, c) < 0:
			return fmt.Errorf("invalid %s '%s': expected %s, or placeholders such as %s", field, s, example, "{plan_"+field+"}")
		}
	}
	if open >= 0 {
		return fmt.Errorf("invalid %s '%s': placeholder not closed", field, s)
	}
	return nil
}

func checkRateTemplate(s string) error {
	return checkTemplate("rate", s, rateChars, "a rate such as 10r/s")
}

func checkWholeTemplate(field, s string) error {
	return checkTemplate(field, s, wholeChars, "a whole number")
}

// checkVars checks what can be checked at load of a zone whose limit
// depends on the request: the templates' shape and the fixed values.
func (z *Zone) checkVars() error {
	switch {
	case z.windowForm():
		return errors.New("placeholders in rate, burst or cost need rate and burst, not window and max_events")
	case z.Rate == "":
		return errors.New("rate is required with placeholders in burst or cost")
	}
	var err error
	if hasPlaceholders(z.Rate) {
		err = checkRateTemplate(z.Rate)
	} else {
		_, _, err = parseRate(z.Rate)
	}
	if err != nil {
		return err
	}
	if v := z.burstVar.template; v != "" {
		err = checkWholeTemplate("burst", v)
	} else if z.Burst != 0 {
		err = checkBurst(z.Burst)
	}
	if err != nil {
		return err
	}
	if v := z.costVar.template; v != "" {
		err = checkWholeTemplate("cost", v)
	} else if z.Cost != 0 {
		err = checkMin("cost", z.Cost, 1)
	}
	if err != nil {
		return err
	}
	if z.burstVar.template == "" && z.Burst != 0 && z.costVar.template == "" && z.Cost > z.Burst {
		return fmt.Errorf("cost %d exceeds burst %d: no request could ever pass", z.Cost, z.Burst)
	}
	return nil
}

// A planKey is the values of a zone's placeholders for one request: ""
// for a fixed value.
type planKey struct{ rate, burst, cost string }

// parsePlan is the zone's limit for the values k.
func (z *Zone) parsePlan(k planKey) (*plan, error) {
	rate := z.Rate
	if z.rateVar.template != "" {
		rate = k.rate
	}
	perSec, n, err := parseRate(rate)
	if err != nil {
		return nil, err
	}
	burst := z.Burst
	switch {
	case z.burstVar.template != "":
		if burst, err = parseWhole("burst", k.burst); err != nil {
			return nil, err
		}
	case burst == 0:
		if n > maxBurst {
			return nil, fmt.Errorf("invalid rate '%s': %g is too large a default burst", rate, n)
		}
		burst = int64(math.Ceil(n))
	}
	cost := z.Cost
	if z.costVar.template != "" {
		if cost, err = parseWhole("cost", k.cost); err != nil {
			return nil, err
		}
	}
	l, err := checkLimit(rate, perSec, burst, cost)
	if err != nil {
		return nil, err
	}
	if err := z.shapeKinds(&l); err != nil {
		return nil, err
	}
	return newPlan(l, cost), nil
}

func parseWhole(field, s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("invalid %s '%s': expected a whole number", field, s)
	}
	return n, nil
}

// plans are the limits that a zone with placeholders has met, parsed.
// Requests read them without a lock; a new limit copies the map.
type plans struct {
	m      atomic.Pointer[map[planKey]*plan]
	mu     sync.Mutex           // serializes additions, guards logged
	logged map[planKey]struct{} // refused values logged already
	more   throttle.Throttle    // refusals beyond maxRefusalsLogged
	logger *zap.Logger
}

func newPlans(logger *zap.Logger) *plans {
	ps := &plans{logged: make(map[planKey]struct{}), logger: logger}
	m := make(map[planKey]*plan)
	ps.m.Store(&m)
	return ps
}

// planFor is the plan of r in a zone with placeholders, or nil when r's
// values make no valid limit, or a limit more than the zone keeps.
func (z *Zone) planFor(r *http.Request) *plan {
	src := source{r: r}
	k := planKey{z.rateVar.expand(&src), z.burstVar.expand(&src), z.costVar.expand(&src)}
	if p := (*z.plans.m.Load())[k]; p != nil {
		return p
	}
	return z.plans.add(z, k)
}

// add parses and keeps the plan of k, if the zone has room for it.
func (ps *plans) add(z *Zone, k planKey) *plan {
	p, err := z.parsePlan(k)
	ps.mu.Lock()
	defer ps.mu.Unlock()
	m := *ps.m.Load()
	if q := m[k]; q != nil {
		return q
	}
	if err == nil && len(m) >= maxPlans {
		err = fmt.Errorf("the zone has %d distinct limits already, the most it keeps", maxPlans)
	}
	if err != nil {
		ps.refused(z, k, err)
		return nil
	}
	next := make(map[planKey]*plan, len(m)+1)
	maps.Copy(next, m)
	next[k] = p
	ps.m.Store(&next)
	return p
}

// refused logs, once per distinct set of values, a limit that answered
// 500. Requires ps.mu to be held.
func (ps *plans) refused(z *Zone, k planKey, err error) {
	fields := []zap.Field{zap.String("zone", z.Name)}
	if z.rateVar.template != "" {
		fields = append(fields, zap.String("rate", k.rate))
	}
	if z.burstVar.template != "" {
		fields = append(fields, zap.String("burst", k.burst))
	}
	if z.costVar.template != "" {
		fields = append(fields, zap.String("cost", k.cost))
	}
	fields = append(fields, zap.Error(err))
	const msg = "rate limit: no valid limit for the request: answered 500"
	if _, ok := ps.logged[k]; ok {
		return
	}
	if len(ps.logged) < maxRefusalsLogged {
		ps.logged[k] = struct{}{}
		ps.logger.Error(msg, fields...)
		return
	}
	if held, ok := ps.more.Allow(time.Minute); ok {
		ps.logger.Error(msg, append(fields, zap.Int64("more_since_last", held))...)
	}
}

// zoneJSON is a Zone's JSON without its methods, for Zone's own.
type zoneJSON Zone

// UnmarshalJSON reads a zone, whose burst and cost are whole numbers or
// strings: of digits, or with placeholders. Unknown fields are refused,
// as Caddy refuses them.
func (z *Zone) UnmarshalJSON(b []byte) error {
	var v struct {
		*zoneJSON
		Burst json.RawMessage `json:"burst,omitempty"`
		Cost  json.RawMessage `json:"cost,omitempty"`
	}
	v.zoneJSON = (*zoneJSON)(z)
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return err
	}
	var err error
	if z.Burst, z.burstVar, err = numberOrVar("burst", v.Burst); err != nil {
		return err
	}
	z.Cost, z.costVar, err = numberOrVar("cost", v.Cost)
	return err
}

// numberOrVar reads a JSON number, or a string of one or with
// placeholders.
func numberOrVar(field string, raw json.RawMessage) (int64, valueVar, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return 0, valueVar{}, nil
	}
	if raw[0] != '"' {
		var n int64
		if err := json.Unmarshal(raw, &n); err != nil {
			return 0, valueVar{}, fmt.Errorf("invalid %s %s: expected a whole number or a string with placeholders", field, raw)
		}
		return n, valueVar{}, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return 0, valueVar{}, err
	}
	if hasPlaceholders(s) {
		return 0, newValueVar(s), nil
	}
	n, err := parseWhole(field, s)
	return n, valueVar{}, err
}

// MarshalJSON writes a zone, with burst and cost as strings when they
// hold placeholders.
func (z Zone) MarshalJSON() ([]byte, error) {
	v := struct {
		*zoneJSON
		Burst any `json:"burst,omitempty"`
		Cost  any `json:"cost,omitempty"`
	}{zoneJSON: (*zoneJSON)(&z)}
	if z.burstVar.template != "" {
		v.Burst = z.burstVar.template
	} else if z.Burst != 0 {
		v.Burst = z.Burst
	}
	if z.costVar.template != "" {
		v.Cost = z.costVar.template
	} else if z.Cost != 0 {
		v.Cost = z.Cost
	}
	return json.Marshal(v)
}
