// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"github.com/caddy-tokenbucket/ratelimit/internal/usagescan"
	"github.com/caddyserver/caddy/v2"
)

// The placeholders {http.rate_limit.json.<path>} give the value at a
// path of the request's JSON body (a model, an MCP tool's name), so that
// a zone can key, match or plan by it. The handler reads the body only
// when its zones' config names one of them (or has estimate): once, with
// the estimate's reader and bounds (usagescan.Body), and sets every
// placeholder its config names before the request's decision, so that
// the handlers after it see them too. A body the reader cannot read, or
// a path without a value, gives one fixed value, noJSONValue, never the
// empty string: such requests share one bucket, where an empty key
// would exempt them from the zone.

// jsonVarPrefix is the namespace of the placeholders of the request's
// JSON body. Zone names may not enter it (see checkZoneName).
const jsonVarPrefix = "http.rate_limit.json."

// NoJSONValue is what {http.rate_limit.json.<path>} gives when the
// request's body has no value at the path that a placeholder could
// give: the body is empty, compressed, over 1 MiB, not JSON or not an
// object, or the value at the path is absent, null, the empty string,
// an object or an array.
const NoJSONValue = "-"

// noJSONValue is NoJSONValue, boxed once for the replacer.
var noJSONValue any = NoJSONValue

// A jsonVar is a placeholder of the request's JSON body that the
// handler's zones name.
type jsonVar struct {
	name string // http.rate_limit.json.<path>
	spec usagescan.Spec
}

// jsonVarsOf is the placeholders of the request's JSON body that the
// zones' config names anywhere (key, rate, burst, cost, match, priority,
// and any field to come), each once. It
// reads every string of each zone's JSON, as Caddy's replacer would find
// the placeholders in them; a name in a string that no request expands
// only costs the body's reading.
func jsonVarsOf(zones []*Zone) ([]jsonVar, error) {
	var vars []jsonVar
	seen := make(map[string]bool)
	for _, z := range zones {
		raw, err := json.Marshal(z)
		if err != nil {
			return nil, fmt.Errorf("zone %s: %w", z.Name, err)
		}
		var v any
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("zone %s: %w", z.Name, err)
		}
		err = eachString(v, func(s string) error {
			for {
				i := strings.Index(s, "{"+jsonVarPrefix)
				if i < 0 {
					return nil
				}
				name, rest, closed := strings.Cut(s[i+1:], "}")
				if !closed {
					return nil // no placeholder, to the replacer
				}
				s = rest
				path := name[len(jsonVarPrefix):]
				if checkJSONPath(path) != nil {
					return fmt.Errorf("zone %s: invalid placeholder {%s}: expected object keys of the request's JSON body separated by dots, such as {%smodel}", z.Name, name, jsonVarPrefix)
				}
				if !seen[name] {
					seen[name] = true
					vars = append(vars, jsonVar{name: name, spec: usagescan.JSON(path)})
				}
			}
		})
		if err != nil {
			return nil, err
		}
	}
	return vars, nil
}

// eachString calls f with every string in v, a decoded JSON value,
// object keys included, until f fails.
func eachString(v any, f func(string) error) error {
	switch v := v.(type) {
	case string:
		return f(v)
	case []any:
		for _, e := range v {
			if err := eachString(e, f); err != nil {
				return err
			}
		}
	case map[string]any:
		for _, k := range slices.Sorted(maps.Keys(v)) {
			if err := f(k); err != nil {
				return err
			}
			if err := eachString(v[k], f); err != nil {
				return err
			}
		}
	}
	return nil
}

// setJSONVars sets r's placeholders of its JSON body that h's zones
// name, from body, which it reads if no zone did.
func (h *Handler) setJSONVars(r *http.Request, body *usagescan.Body) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	data, why := body.JSON(r)
	for i := range h.jsonVars {
		v := &h.jsonVars[i]
		val := noJSONValue
		if why == "" {
			if s, ok := v.spec.Value(data); ok && s != "" {
				val = s
			}
		}
		repl.Set(v.name, val)
	}
}
