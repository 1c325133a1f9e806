// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
)

// The Redis store's overrides (the kind is the root's overrides.go). A key's own limit is
// the string `<token ns>:<burst>:<rate>` at `<hash><field>:limit`, in
// its bucket's cluster slot, which the decision script reads with the
// bucket (lua/decide/20_buckets.lua, OVERRIDES); it expires by itself when it
// has an end. The zone's overrides are listed in a sorted set of their
// keys, scored by their end (see rediswire.Keys.Limits), which bounds
// them to max_overrides, instance by instance alike.

// overrideValue is o as the script reads it.
func overrideValue(o store.Override) string {
	return strconv.FormatInt(int64(o.TokenTime), 10) + ":" + strconv.FormatInt(o.Burst, 10) + ":" + o.Rate
}

// parseOverride reads an override's value; ttl is how long it has left
// (negative: no end).
func parseOverride(v string, ttl time.Duration, now time.Time) (store.Override, bool) {
	t, rest, ok1 := strings.Cut(v, ":")
	b, rate, ok2 := strings.Cut(rest, ":")
	token, err1 := strconv.ParseInt(t, 10, 64)
	burst, err2 := strconv.ParseInt(b, 10, 64)
	if !ok1 || !ok2 || err1 != nil || err2 != nil || token <= 0 || burst <= 0 {
		return store.Override{}, false
	}
	o := store.Override{TokenTime: time.Duration(token), Burst: burst, Rate: rate}
	if ttl >= 0 {
		o.Expires = now.Add(ttl)
	}
	return o, true
}

// overridePoll is how long a zone's count of overrides is trusted: a
// decision skips reading its key's own limit only when the zone had none
// when counted less than this before. Set through another instance, an
// override is then read by this instance's calls within this time. (The
// over-limit cache, which may refuse a key without a call for up to
// overLimitTrust, forgets what it learnt meanwhile when the count shows
// the zone's first override.)
const overridePoll = 250 * time.Millisecond

// overrideRefresh is how old a zone's count of overrides is when a
// decision has it read again, in the background: soon enough that the
// count of a zone with requests all the time is never older than
// overridePoll, its decisions then never reading an override that is not
// there.
const overrideRefresh = overridePoll / 2

// countedOverrides is how many keys of a zone have their own limit, as
// Redis said when asked (-1: not known; every decision reads).
type countedOverrides struct {
	n  int64
	at int64 // when it was asked, in nanoseconds of the process's clock (see processStart)
}

// mayOverride reports whether keys of the zone may have their own limit,
// so that a decision must read it: unless Redis said less than
// overridePoll ago that the zone has none. A count older than that is not
// trusted, so that an instance that was idle reads the override set
// meanwhile at its first decision. The count is read again, in the
// background, once it is overrideRefresh old.
func (s *Store) mayOverride(zone int) bool {
	rz := &s.zones[zone]
	if rz.shares != nil {
		return false // SetOverride refuses them: a take of the zone stays plain
	}
	now := time.Since(processStart).Nanoseconds()
	c := rz.overridden.Load()
	if now-c.at > int64(overrideRefresh) {
		if last := rz.overriddenPoll.Load(); now-last > int64(overrideRefresh) && rz.overriddenPoll.CompareAndSwap(last, now) {
			go s.pollOverrides(zone, now)
		}
	}
	return c.n != 0 || now-c.at > int64(overridePoll)
}

// pollOverrides reads how many keys of the zone have their own limit,
// asked at at.
func (s *Store) pollOverrides(zone int, at int64) {
	ctx, cancel := context.WithTimeout(context.Background(), s.opt.CallTimeout)
	defer cancel()
	n, err := s.OverrideCount(ctx, zone)
	if err != nil {
		// Not known: every decision reads. (What the cache learnt
		// stays: fail_mode local starts from it while Redis fails.)
		n = -1
	}
	rz := &s.zones[zone]
	c := &countedOverrides{n: int64(n), at: at}
	var old *countedOverrides
	for {
		if old = rz.overridden.Load(); old.at > at {
			return // a later count is in, or an override was set here since
		}
		if rz.overridden.CompareAndSwap(old, c) {
			break
		}
	}
	if old.n == 0 && n > 0 {
		// What the cache learnt while no override was read may be the
		// zone's limit where a key now has its own; so may what calls in
		// flight, sent without reading it, would teach it.
		rz.overriddenGen.Add(1)
		if rz.cache != nil {
			rz.cache.Clear()
		}
	}
}

// overriddenGen sums the generations of the overrides of d's buckets'
// zones (see zoneState.overriddenGen): it changes when any does.
func (s *Store) overriddenGen(d *store.Demands) uint64 {
	var g uint64
	for i := range d.Buckets {
		g += s.zones[d.Buckets[i].Zone].overriddenGen.Load()
	}
	return g
}

// processStart anchors the monotonic instants of the override polls.
var processStart = time.Now()

// forgetKey makes this instance's over-limit cache forget what it knew
// of key's bucket in a zone: its own limit changed.
func (s *Store) forgetKey(zone int, key store.Key) {
	rz := &s.zones[zone]
	if rz.cache != nil {
		rz.cache.Forget(key)
		rz.learned.forget(rz.cache.Hash(key))
	}
}

// overrideScript sets or removes a key's own limit and its place in the
// zone's list in one step (see lua/override.lua).
var overrideScript = redis.NewScript(lua.Override)

// SetOverride and DeleteOverride change a key's own limit and the zone's
// list of them together: in one script call, atomic, so that no change
// of the key running at once on any instance can leave a limit that is
// not listed (enforced, never counted toward max_overrides, without an
// end), or a listed key without one. On Redis Cluster the two are in
// different slots, which no one call changes together: there the
// changes of one key take turns (lockOverride), and each changes the
// list first when it sets and last when it removes, so that an instance
// that dies halfway leaves at most a key listed without a limit, which
// counts toward max_overrides until the key's limit is set or removed.
func (s *Store) SetOverride(ctx context.Context, now time.Time, zone int, key store.Key, o store.Override) error {
	rz := &s.zones[zone]
	if rz.shares != nil {
		return errShareOwnLimit
	}
	listed := s.keys.Listed(key.String())
	_, _, limitKey := s.keys.BucketLimit(rz.field, key.String())
	keys := []string{s.keys.Limits(rz.field), limitKey}
	if s.client.Cluster {
		unlock, err := s.lockOverride(ctx, limitKey)
		if err != nil {
			return err
		}
		defer unlock()
		keys = keys[:1]
	}
	score, value := "+inf", overrideValue(o)
	var ttl time.Duration // 0: no end
	if !o.Expires.IsZero() {
		score, ttl = strconv.FormatInt(o.Expires.UnixMilli(), 10), max(o.Expires.Sub(now), time.Millisecond)
	}
	defer s.forgetKey(zone, key)
	// Read from now on, until a poll asked after the override was listed
	// counts it.
	rz.overridden.Store(&countedOverrides{n: -1, at: time.Since(processStart).Nanoseconds()})
	set, err := overrideScript.Run(ctx, s.client, keys, "set", listed, now.UnixMilli(), score, value, ttl.Milliseconds(), rz.maxOverrides).Int()
	if err == nil && set == 1 && len(keys) == 1 {
		err = s.client.Set(ctx, limitKey, value, ttl).Err()
	}
	if err == nil && set == 0 {
		return store.ErrTooManyOverrides
	}
	return err
}

func (s *Store) DeleteOverride(ctx context.Context, now time.Time, zone int, key store.Key) (bool, error) {
	rz := &s.zones[zone]
	listed := s.keys.Listed(key.String())
	_, _, limitKey := s.keys.BucketLimit(rz.field, key.String())
	keys := []string{s.keys.Limits(rz.field), limitKey}
	defer s.forgetKey(zone, key)
	if !s.client.Cluster {
		n, err := overrideScript.Run(ctx, s.client, keys, "del", listed, now.UnixMilli()).Int()
		return n > 0, err
	}
	unlock, err := s.lockOverride(ctx, limitKey)
	if err != nil {
		return false, err
	}
	defer unlock()
	n, err := s.client.Del(ctx, limitKey).Result()
	if err != nil {
		return false, err
	}
	return n > 0, overrideScript.Run(ctx, s.client, keys[:1], "del", listed, now.UnixMilli()).Err()
}

// overrideLockLease is how long a change of a key's own limit on Redis
// Cluster holds the key's lock at most: longer than the admin API gives
// a change, so that a change never loses its lock before it ends, and
// short enough that one from an instance that died holds up the key's
// next change for no more than that.
const overrideLockLease = 10 * time.Second

// lockOverride waits, until ctx ends, for the lock of the key whose own
// limit is at limitKey (`<limitKey>:lock`, in its slot), and returns
// what gives it back.
func (s *Store) lockOverride(ctx context.Context, limitKey string) (unlock func(), err error) {
	lock, token := limitKey+":lock", strconv.FormatUint(rand.Uint64(), 36)
	for {
		ok, err := s.client.SetNX(ctx, lock, token, overrideLockLease).Result()
		if err != nil {
			return nil, err
		}
		if ok {
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return func() {
		// Only while it is still this change's: a lock whose lease ran
		// out may be another change's now.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opt.CallTimeout)
		defer cancel()
		_ = s.client.Watch(ctx, func(tx *redis.Tx) error {
			if tx.Get(ctx, lock).Val() != token {
				return nil
			}
			_, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error { return p.Del(ctx, lock).Err() })
			return err
		}, lock)
	}, nil
}

func (s *Store) Override(ctx context.Context, zone int, key store.Key) (store.Override, bool, error) {
	_, _, limitKey := s.keys.BucketLimit(s.zones[zone].field, key.String())
	return s.readOverride(ctx, limitKey)
}

// readOverride reads the override at limitKey.
func (s *Store) readOverride(ctx context.Context, limitKey string) (store.Override, bool, error) {
	var get *redis.StringCmd
	var ttl *redis.DurationCmd
	now := time.Now()
	if _, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		get, ttl = p.Get(ctx, limitKey), p.PTTL(ctx, limitKey)
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return store.Override{}, false, err
	}
	if get.Err() != nil {
		return store.Override{}, false, nil
	}
	o, ok := parseOverride(get.Val(), ttl.Val(), now)
	return o, ok, nil
}

func (s *Store) Overrides(ctx context.Context, zone int) ([]store.KeyOverride, error) {
	rz := &s.zones[zone]
	now := time.Now()
	keys, err := s.client.ZRangeByScore(ctx, s.keys.Limits(rz.field), &redis.ZRangeBy{
		Min: "(" + strconv.FormatInt(now.UnixMilli(), 10), Max: "+inf"}).Result()
	if err != nil {
		return nil, err
	}
	out := []store.KeyOverride{}
	const batch = 512
	for len(keys) > 0 {
		part := keys[:min(batch, len(keys))]
		keys = keys[len(part):]
		gets, ttls := make([]*redis.StringCmd, len(part)), make([]*redis.DurationCmd, len(part))
		if _, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, listed := range part {
				limitKey := s.keys.ListedLimit(rz.field, listed)
				gets[i], ttls[i] = p.Get(ctx, limitKey), p.PTTL(ctx, limitKey)
			}
			return nil
		}); err != nil && !errors.Is(err, redis.Nil) {
			return nil, err
		}
		for i, listed := range part {
			if o, ok := parseOverride(gets[i].Val(), ttls[i].Val(), now); ok && gets[i].Err() == nil {
				out = append(out, store.KeyOverride{Key: listed, Override: o})
			}
		}
	}
	return out, nil
}

func (s *Store) OverrideCount(ctx context.Context, zone int) (int, error) {
	if !s.client.Up() {
		return 0, rediswire.ErrDown
	}
	n, err := s.client.ZCount(ctx, s.keys.Limits(s.zones[zone].field), "("+strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
	return int(n), err
}
