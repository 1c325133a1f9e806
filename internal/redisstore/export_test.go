// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

import (
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// What the package's tests share: the stores they make, and what the
// black-box tests (package redisstore_test) read of a store beyond its
// API, which the tests inside the package read directly.

// testTimeout is how long a test's decision may wait for Redis: 5s, not
// the module's default 100ms, as the tests check answers, on a machine
// that other tests load, and not timeouts (those that do set their own).
const testTimeout = 5 * time.Second

// OpenClient is a client of the Redis at addrs (several: a cluster), with
// the options and the scripts the module gives its clients, closed when
// the test ends.
func OpenClient(t testing.TB, addrs ...string) *rediswire.Client {
	t.Helper()
	return OpenClientWith(t, ClientOptions{}, addrs...)
}

// ClientOptions are what a test's client has of its own: the source of
// its decision script ("": the module's), its pool of connections a node
// (0: go-redis's default), its timeout (0: testTimeout).
type ClientOptions struct {
	Decide   string
	PoolSize int
	Timeout  time.Duration
}

// OpenClientWith is OpenClient with options of its own.
func OpenClientWith(t testing.TB, o ClientOptions, addrs ...string) *rediswire.Client {
	t.Helper()
	if o.Decide == "" {
		o.Decide = lua.Decide
	}
	if o.Timeout == 0 {
		o.Timeout = testTimeout
	}
	c, err := rediswire.NewClient(&redis.UniversalOptions{
		Addrs: addrs, ContextTimeoutEnabled: true, MaxRetries: -1, Protocol: 2, PoolSize: o.PoolSize,
		DialTimeout: o.Timeout, ReadTimeout: o.Timeout, WriteTimeout: o.Timeout, PoolTimeout: o.Timeout,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}, rediswire.NewScripts(o.Decide, lua.Peek))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Destruct() })
	return c
}

// Open is New's store of zones on c, with opt: its CallTimeout a second
// and its KeyPrefix the test's name where opt says none. The test's end
// drops it (before c closes: a store's copies reconcile a last time).
func Open(t testing.TB, c *rediswire.Client, zones []store.ZoneSpec, opt Options) *Store {
	t.Helper()
	if opt.CallTimeout == 0 {
		opt.CallTimeout = testTimeout
	}
	if opt.KeyPrefix == "" {
		opt.KeyPrefix = t.Name() + ":"
	}
	s, err := New(c, zones, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Drop(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// Bucket is the spec of a zone of one bucket of limit l.
func Bucket(name string, l gcra.Limit) store.ZoneSpec {
	return store.ZoneSpec{Name: name, Bucket: true, Shape: l, MaxOverrides: store.DefaultMaxOverrides}
}

// syncOwe is how many intervals of refill the shared bucket of a zone
// with sync may owe beyond empty, as the module shapes such a zone's
// limit (its sync.go).
const syncOwe = 32

// SyncLimit is the limit of a zone of rate and burst with sync every
// interval, as the module shapes it.
func SyncLimit(rate float64, burst int64, interval time.Duration) gcra.Limit {
	l := gcra.NewLimit(rate, burst)
	l.Owe = syncOwe * interval
	return l
}

// SyncSpec is the spec of a zone with sync every interval, of limit l
// (the zero limit for a zone whose limit comes with each request).
func SyncSpec(name string, l gcra.Limit, interval time.Duration) store.ZoneSpec {
	z := Bucket(name, l)
	z.Sync = interval
	return z
}

// PerMinute is a limit of a token a minute and burst.
func PerMinute(burst int64) gcra.Limit { return gcra.NewLimit(1.0/60, burst) }

// TakeOf is the demand of a token of key's bucket in zone, of limit l.
func TakeOf(zone int, key string, l gcra.Limit) *store.Demands {
	return &store.Demands{Buckets: []store.BucketDemand{{Zone: zone, Key: store.Key{Text: key}, Limit: l, Cost: l.TokenTime}}}
}

// RunAll decides each of ds by op, in order, in one flight of its own:
// the keys of each share a cluster slot (see oneTag).
func (s *Store) RunAll(op rediswire.Op, ds []*store.Demands) ([]bool, []error) {
	deadline := time.Now().Add(s.opt.CallTimeout)
	calls := make([]*rediswire.Call, len(ds))
	for i, d := range ds {
		calls[i] = rediswire.NewCall(op, deadline)
		if s.opt.Clock != nil {
			calls[i].Clock(s.opt.Clock())
		}
		s.build(calls[i], op, d)
	}
	sent := time.Now()
	replies, errs := s.client.RunAll(calls)
	allowed := make([]bool, len(ds))
	for i, d := range ds {
		allowed[i], errs[i] = s.answered(replies[i], errs[i], sent, op, d)
	}
	return allowed, errs
}

// BucketName is the hash and the field of the bucket of key in a zone.
func (s *Store) BucketName(zone int, key store.Key) (hash, field string) {
	return s.bucketName(zone, key)
}

// ShapeOf is the script's shape of b's bucket, in a take.
func (s *Store) ShapeOf(b *store.BucketDemand) *rediswire.Shape { return s.shapeOf(b, false) }

// BucketLimit is the hash and the field of the bucket of key in a zone,
// and the key of its own limit.
func (s *Store) BucketLimit(zone int, key store.Key) (hash, field, limit string) {
	return s.keys.BucketLimit(s.zones[zone].field, key.String())
}

// WaitFor waits up to d for cond, and fails the test if it never holds.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
