// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// The admin API's keys with their own limit (overrides.go): set, read and
// removed under /rate_limit/<zone>/<key>/limit, listed under
// /rate_limit/<zone>/limits. Each change is logged at INFO with the
// admin client's address, the key only with log_key.

// limitBody is the body of a PUT of a key's own limit.
type limitBody struct {
	// The rate, written as a zone's; default: the zone's.
	Rate string `json:"rate,omitempty"`
	// The burst; default: the zone's.
	Burst *int64 `json:"burst,omitempty"`
	// How long the limit lasts, then the key has the zone's again;
	// default: until it is removed.
	ExpiresIn *caddy.Duration `json:"expires_in,omitempty"`
}

// ownLimit describes a key's own limit in the admin API.
type ownLimit struct {
	Key   string `json:"key,omitempty"` // in a list
	Rate  string `json:"rate"`
	Burst int64  `json:"burst"`
	// Seconds until it ends, and when; none: it lasts until removed.
	ExpiresIn float64 `json:"expires_in,omitempty"`
	ExpiresAt string  `json:"expires_at,omitempty"`
}

// limitInfo describes a key's own limit in a zone.
type limitInfo struct {
	Zone   string `json:"zone"`
	Limit  string `json:"limit"` // the zone's, in words
	Key    string `json:"key"`
	Bucket string `json:"bucket"`
	*ownLimit
}

// limitsInfo lists a zone's keys with their own limit.
type limitsInfo struct {
	Zone      string      `json:"zone"`
	Limit     string      `json:"limit"`
	Overrides []*ownLimit `json:"overrides"`
}

func (ref zoneRef) ownLimit(key string, o store.Override) *ownLimit {
	out := &ownLimit{Key: key, Rate: o.Rate, Burst: o.Burst}
	if !o.Expires.IsZero() {
		out.ExpiresIn = math.Max(time.Until(o.Expires).Seconds(), 0)
		out.ExpiresAt = o.Expires.UTC().Format(time.RFC3339)
	}
	return out
}

// serveLimit answers a GET, PUT or DELETE of a key's own limit in each
// zone of refs: all of them, or, when any cannot, none.
func serveLimit(w http.ResponseWriter, r *http.Request, refs []zoneRef, key string) error {
	for _, ref := range refs {
		if ref.z.rateless {
			return apiError(http.StatusBadRequest, "zone %q has no rate: a key's own limit is a rate and a burst", ref.z.Name)
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	var out []any
	var err error
	if r.Method == http.MethodPut {
		out, err = putLimits(ctx, r, refs, key)
	} else {
		out, err = eachLimit(ctx, r, refs, key)
	}
	if err != nil {
		return err
	}
	if len(out) == 0 {
		return apiError(http.StatusNotFound, "no own limit: key %q has the zone's limit in zone %q", key, refs[0].z.Name)
	}
	if len(out) == 1 {
		return writeJSON(w, out[0])
	}
	return writeJSON(w, map[string]any{"zones": out})
}

// eachLimit answers a GET or DELETE of the key's own limit in each zone
// of refs that has one.
func eachLimit(ctx context.Context, r *http.Request, refs []zoneRef, key string) ([]any, error) {
	var out []any
	for _, ref := range refs {
		var info *limitInfo
		var err error
		if r.Method == http.MethodDelete {
			info, err = ref.deleteLimit(ctx, r, key)
		} else {
			info, err = ref.getLimit(ctx, key)
		}
		if err != nil {
			return nil, err
		}
		if info != nil {
			out = append(out, info)
		}
	}
	return out, nil
}

// An ownLimitChange is a PUT's change of the key's own limit in one zone, and
// what the key had there before.
type ownLimitChange struct {
	ref zoneRef
	k   store.Key
	o   store.Override
	was store.Override
	had bool
}

// putLimits sets the key's own limit of a PUT's body in each zone of
// refs, or in none (zones of one name in several sites may differ in
// their limits, costs and max_overrides): the body is checked against
// every zone, and so is the room each zone's max_overrides leaves,
// before any changes. Should a zone fail even so (its store fails, or
// other keys took its last room meanwhile), the zones changed before it
// get back what the key had there.
func putLimits(ctx context.Context, r *http.Request, refs []zoneRef, key string) ([]any, error) {
	var body limitBody
	if err := readLimitBody(r, &body); err != nil {
		return nil, apiError(http.StatusBadRequest, "%v", err)
	}
	now := time.Now()
	changes := make([]ownLimitChange, len(refs))
	for i, ref := range refs {
		c, err := ref.checkPut(ctx, key, body, now)
		if err != nil {
			return nil, err
		}
		changes[i] = c
	}
	for i, c := range changes {
		if err := c.ref.h.store.SetOverride(ctx, now, c.ref.z.index, c.k, c.o); err != nil {
			undoLimits(ctx, changes[:i])
			return nil, c.ref.setError(err)
		}
	}
	out := make([]any, len(changes))
	for i, c := range changes {
		out[i] = c.ref.limitSet(r, key, c.k, c.o)
	}
	return out, nil
}

// checkPut checks a PUT of the key's own limit in the zone: the limit
// the body gives, and room for it under max_overrides.
func (ref zoneRef) checkPut(ctx context.Context, key string, body limitBody, now time.Time) (ownLimitChange, error) {
	if ref.z.Share != 0 {
		return ownLimitChange{}, apiError(http.StatusConflict, "zone %q: %v", ref.z.Name, errShareOwnLimit)
	}
	o, err := ref.z.overrideOf(body, now)
	if err != nil {
		return ownLimitChange{}, apiError(http.StatusBadRequest, "zone %q: %v", ref.z.Name, err)
	}
	c := ownLimitChange{ref: ref, k: ref.z.adminKey(key), o: o}
	st := ref.h.store
	if c.was, c.had, err = st.Override(ctx, ref.z.index, c.k); err != nil {
		return ownLimitChange{}, apiError(http.StatusBadGateway, "reading the key's limit: %v", err)
	}
	if c.had {
		return c, nil
	}
	n, err := st.OverrideCount(ctx, ref.z.index)
	if err != nil {
		return ownLimitChange{}, apiError(http.StatusBadGateway, "counting the keys' limits: %v", err)
	}
	if int64(n) >= ref.maxOverrides() {
		return ownLimitChange{}, ref.setError(store.ErrTooManyOverrides)
	}
	return c, nil
}

// undoLimits gives the key back, in each zone that changes set, the limit
// it had there before. What cannot be given back is logged.
func undoLimits(ctx context.Context, changes []ownLimitChange) {
	// Even when the PUT ran out of time.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	for _, c := range slices.Backward(changes) {
		st, zone := c.ref.h.store, c.ref.z.index
		var err error
		if c.had {
			err = st.SetOverride(ctx, time.Now(), zone, c.k, c.was)
		} else {
			_, err = st.DeleteOverride(ctx, time.Now(), zone, c.k)
		}
		if err != nil {
			c.ref.h.logger.Error("rate limit: a key's own limit, set in a zone before another of its name refused it, could not be given back",
				zap.String("zone", c.ref.z.Name), zap.String("limit", c.ref.z.id.limit), zap.Error(err))
		}
	}
}

// setError is the admin API's answer to a store's refusal to set a key's
// own limit in the zone.
func (ref zoneRef) setError(err error) error {
	if errors.Is(err, store.ErrTooManyOverrides) {
		return apiError(http.StatusConflict, "zone %q has %d keys with their own limit, its max_overrides: remove one first", ref.z.Name, ref.maxOverrides())
	}
	return apiError(http.StatusBadGateway, "setting the key's limit: %v", err)
}

// readLimitBody reads a PUT's body, refusing unknown fields.
func readLimitBody(r *http.Request, body *limitBody) error {
	b, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(body); err != nil {
		return fmt.Errorf("bad body: %v", err)
	}
	return nil
}

// limitSet logs the key's own limit o, set in the zone, and describes
// it.
func (ref zoneRef) limitSet(r *http.Request, key string, k store.Key, o store.Override) *limitInfo {
	fields := []zap.Field{zap.String("rate", o.Rate), zap.Int64("burst", o.Burst)}
	if !o.Expires.IsZero() {
		fields = append(fields, zap.Time("expires", o.Expires))
	}
	ref.audit(r, "rate limit: a key's own limit set", key, fields...)
	return &limitInfo{Zone: ref.z.Name, Limit: ref.z.id.limit, Key: key, Bucket: k.String(), ownLimit: ref.ownLimit("", o)}
}

func (ref zoneRef) deleteLimit(ctx context.Context, r *http.Request, key string) (*limitInfo, error) {
	k := ref.z.adminKey(key)
	found, err := ref.h.store.DeleteOverride(ctx, time.Now(), ref.z.index, k)
	if err != nil {
		return nil, apiError(http.StatusBadGateway, "removing the key's limit: %v", err)
	}
	if !found {
		return nil, nil
	}
	ref.audit(r, "rate limit: a key's own limit removed", key, zap.String("now", ref.z.id.limit))
	return &limitInfo{Zone: ref.z.Name, Limit: ref.z.id.limit, Key: key, Bucket: k.String()}, nil
}

func (ref zoneRef) getLimit(ctx context.Context, key string) (*limitInfo, error) {
	k := ref.z.adminKey(key)
	o, ok, err := ref.h.store.Override(ctx, ref.z.index, k)
	if err != nil {
		return nil, apiError(http.StatusBadGateway, "reading the key's limit: %v", err)
	}
	if !ok {
		return nil, nil
	}
	return &limitInfo{Zone: ref.z.Name, Limit: ref.z.id.limit, Key: key, Bucket: k.String(), ownLimit: ref.ownLimit("", o)}, nil
}

// audit logs a change of a key's limit: the zone, the admin client, the
// key with log_key.
func (ref zoneRef) audit(r *http.Request, msg, key string, fields ...zap.Field) {
	fields = append([]zap.Field{zap.String("zone", ref.z.Name), zap.String("limit", ref.z.id.limit)}, fields...)
	fields = append(fields, zap.String("admin_remote", r.RemoteAddr))
	if ref.h.LogKey {
		fields = append(fields, zap.String("key", key))
	}
	ref.h.logger.Info(msg, fields...)
}

func (ref zoneRef) maxOverrides() int64 { return ref.z.spec().MaxOverrides }

// serveLimits lists the keys of each zone of refs with their own limit.
func serveLimits(w http.ResponseWriter, r *http.Request, refs []zoneRef) error {
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	out := make([]limitsInfo, len(refs))
	for i, ref := range refs {
		out[i] = limitsInfo{Zone: ref.z.Name, Limit: ref.z.id.limit, Overrides: []*ownLimit{}}
		if ref.z.rateless {
			continue
		}
		list, err := ref.h.store.Overrides(ctx, ref.z.index)
		if err != nil {
			return apiError(http.StatusBadGateway, "listing the keys' limits: %v", err)
		}
		for _, ko := range list {
			out[i].Overrides = append(out[i].Overrides, ref.ownLimit(ko.Key, ko.Override))
		}
	}
	if len(out) == 1 {
		return writeJSON(w, out[0])
	}
	return writeJSON(w, map[string]any{"zones": out})
}

// overrideOf is the key's own limit a PUT's body gives in the zone: the
// zone's rate or burst where it gives none, checked as the zone's own.
func (z *Zone) overrideOf(b limitBody, now time.Time) (store.Override, error) {
	if b.Rate == "" && b.Burst == nil {
		return store.Override{}, errors.New("a key's own limit needs a rate, a burst or both")
	}
	rate := b.Rate
	if rate == "" {
		if hasPlaceholders(z.Rate) {
			return store.Override{}, errors.New("the zone's rate comes with each request: give one")
		}
		rate = z.rateString()
	}
	if len(rate) > maxRateText {
		return store.Override{}, fmt.Errorf("invalid rate: %d bytes, at most %d", len(rate), maxRateText)
	}
	perSec, n, err := parseRate(rate)
	if err != nil {
		return store.Override{}, err
	}
	burst, err := z.overrideBurst(b.Burst, n)
	if err != nil {
		return store.Override{}, err
	}
	cost := z.Cost
	if z.costVar.template != "" {
		cost = 1
	}
	l, err := checkLimit(rate, perSec, burst, cost)
	if err != nil {
		return store.Override{}, err
	}
	if l.BurstTime+z.limit.Owe > gcra.MaxBurstTime {
		return store.Override{}, fmt.Errorf("burst %d at rate %s and the zone's max_debt take more than 100 years to refill", burst, rate)
	}
	o := store.Override{TokenTime: l.TokenTime, Burst: burst, Rate: rate}
	if b.ExpiresIn != nil {
		if *b.ExpiresIn <= 0 {
			return store.Override{}, fmt.Errorf("invalid expires_in %v: must be positive", time.Duration(*b.ExpiresIn))
		}
		o.Expires = now.Add(time.Duration(*b.ExpiresIn))
	}
	return o, nil
}

// maxRateText is the longest rate text a key's own limit keeps.
const maxRateText = 64

// overrideBurst is the burst of a key's own limit: the one given, else
// the zone's, else the n of the rate rounded up.
func (z *Zone) overrideBurst(given *int64, n float64) (int64, error) {
	switch {
	case given != nil:
		return *given, nil
	case z.burstVar.template != "":
		return 0, errors.New("the zone's burst comes with each request: give one")
	case z.plans == nil:
		return z.limit.Burst, nil
	case z.Burst != 0:
		return z.Burst, nil
	case n > maxBurst:
		return 0, fmt.Errorf("%g is too large a default burst: give one", n)
	}
	return int64(math.Ceil(n)), nil
}
