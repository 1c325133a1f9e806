// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(LocalStore{})
}

// LocalStore keeps buckets in this process's memory. It is the default
// store: one Caddy instance needs nothing else.
//
// Buckets survive config reloads for every zone whose name, rate and
// burst are unchanged. Memory is bounded by `max_keys` per zone; a
// tracked key costs about 56 bytes whatever its length.
type LocalStore struct {
	// The most buckets kept per zone. When a zone is full, buckets that
	// have refilled are dropped first, which changes no decision; if none
	// has, the least recently used among a few sampled is evicted (its
	// client gets a full bucket back) and counted. Default: 1000000.
	MaxKeys int64 `json:"max_keys,omitempty"`

	// Keep the buckets across restarts, in Caddy's storage (where
	// certificates are kept): they are written when Caddy exits and
	// every persist_interval, and loaded when it starts. Default: true.
	Persist *bool `json:"persist,omitempty"`

	// How often the buckets are written: how much of them a crash can
	// lose. At least 100ms. Default: 30s.
	PersistInterval caddy.Duration `json:"persist_interval,omitempty"`

	tables   []*table // by zone index
	quotas   []*table // by zone index: the calendar quotas' counters; nil for a zone without
	acquired []tableID
	snaps    *snapshots // where the tables are persisted; nil: they are not
}

const defaultMaxKeys = 1_000_000

// localTables holds the bucket tables of every zone of every loaded
// config, so that a reload which keeps a zone keeps its buckets: the new
// config acquires the table before the old one releases it.
var localTables = caddy.NewUsagePool()

// tableID is what a zone's buckets are shared by. A zone whose rate or
// burst changes starts with fresh buckets.
type tableID struct {
	name      string
	tokenTime time.Duration
	burst     int64
	// quota, for the table of a zone's calendar quota counters, is its
	// period and time zone (see Zone.quotaID): its limit may change.
	quota string
}

// CaddyModule returns the Caddy module information.
func (LocalStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.local",
		New: func() caddy.Module { return new(LocalStore) },
	}
}

// Provision sets defaults, and finds where the buckets are persisted.
func (s *LocalStore) Provision(ctx caddy.Context) error {
	if s.MaxKeys == 0 {
		s.MaxKeys = defaultMaxKeys
	}
	if s.PersistInterval == 0 {
		s.PersistInterval = caddy.Duration(defaultPersistInterval)
	}
	if err := s.Validate(); err != nil {
		return err
	}
	if s.Persist == nil || *s.Persist {
		s.snaps = openSnapshots(ctx, time.Duration(s.PersistInterval))
	}
	return nil
}

// Validate checks the configuration.
func (s *LocalStore) Validate() error {
	if s.MaxKeys != 0 {
		if err := checkMin("max_keys", s.MaxKeys, 1); err != nil {
			return err
		}
	}
	if s.PersistInterval != 0 {
		return checkPersistInterval(time.Duration(s.PersistInterval))
	}
	return nil
}

func checkPersistInterval(d time.Duration) error {
	if d < minPersistInterval {
		return fmt.Errorf("invalid persist_interval %v: must be at least %v", d, minPersistInterval)
	}
	return nil
}

func (s *LocalStore) bind(zones []*Zone) error {
	if len(s.tables) > 0 {
		return errors.New("local store is already in use by another handler")
	}
	for _, z := range zones {
		t, err := s.acquire(tableID{name: z.Name, tokenTime: z.limit.tokenTime, burst: z.limit.burst})
		if err != nil {
			return err
		}
		s.tables = append(s.tables, t)
		var qt *table
		if z.quota != nil {
			if qt, err = s.acquire(tableID{name: z.Name, quota: z.quotaID()}); err != nil {
				return err
			}
		}
		s.quotas = append(s.quotas, qt)
	}
	return nil
}

// acquire gets the table of id, shared with the other configs that use
// it.
func (s *LocalStore) acquire(id tableID) (*table, error) {
	v, _, err := localTables.LoadOrNew(id, func() (caddy.Destructor, error) {
		t := newTable(s.MaxKeys, time.Now())
		go t.sweepLoop()
		if s.snaps != nil {
			t.key = s.snaps.key
			t.persist(s.snaps, id)
		}
		return t, nil
	})
	if err != nil {
		return nil, err
	}
	s.acquired = append(s.acquired, id)
	t := v.(*table)
	t.maxKeys.Store(s.MaxKeys)
	// The config that uses the table last says where it is kept; a
	// store that was not provisioned (fail_mode local's fallback)
	// has no say.
	if s.snaps != nil || s.Persist != nil && !*s.Persist {
		t.rebind(s.snaps)
	}
	return t, nil
}

// Cleanup releases the tables, which stop when no config uses them.
func (s *LocalStore) Cleanup() error {
	var errs []error
	for _, id := range s.acquired {
		if _, err := localTables.Delete(id); err != nil {
			errs = append(errs, err)
		}
	}
	s.acquired = nil
	return errors.Join(errs...)
}

func (s *LocalStore) take(_ context.Context, now time.Time, reqs []request) (bool, error) {
	var buf [4]charge
	cs := buf[:0]
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			t := s.quotas[q.zone.index]
			n := t.instant(now)
			cs = append(cs, charge{
				t:      t,
				h:      t.hash(q.key),
				now:    n,
				req:    i,
				quota:  q.zone.quota,
				units:  q.zone.Cost,
				fullAt: n + q.win.end.Sub(now), // should a new window start
			})
			continue
		}
		t := s.tables[q.zone.index]
		p := q.plan()
		cs = append(cs, charge{
			l:    q.limit(),
			cost: p.costTime,
			t:    t,
			h:    t.hash(q.key),
			now:  t.instant(now),
			req:  i,
		})
	}
	allowed := takeAll(cs)
	for i := range cs {
		c := &cs[i]
		reqs[c.req].ok = c.ok
		reqs[c.req].ban = c.ban
		reqs[c.req].debt = c.debt
		reqs[c.req].used = c.used
	}
	return allowed, nil
}

// owe makes q's bucket owe debt at least, at now.
func (s *LocalStore) owe(now time.Time, q *request, debt time.Duration) {
	if debt > 0 && q.win == nil {
		t := s.tables[q.zone.index]
		n := t.instant(now)
		t.raise(q.key, n+debt, n)
	}
}

func (s *LocalStore) refund(_ context.Context, now time.Time, reqs []request) error {
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			t := s.quotas[q.zone.index]
			t.uncount(q.key, q.zone.Cost, t.instant(now))
			continue
		}
		t := s.tables[q.zone.index]
		p := q.plan()
		t.refund(q.key, p.limit, p.costTime, t.instant(now))
	}
	return nil
}

func (s *LocalStore) peek(_ context.Context, now time.Time, q *request) error {
	if q.win != nil {
		t := s.quotas[q.zone.index]
		n := t.instant(now)
		used, endAt := t.count(q.key, n)
		q.used, q.debt = used, max(endAt-n, 0)
		return nil
	}
	t := s.tables[q.zone.index]
	q.debt = q.plan().limit.debt(t.get(q.key), t.instant(now))
	return nil
}

func (s *LocalStore) reset(_ context.Context, q *request) (bool, error) {
	t := s.tables[q.zone.index]
	if q.win != nil {
		t = s.quotas[q.zone.index]
	}
	return t.forget(q.key) > t.instant(time.Now()), nil
}

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	store local {
//		max_keys         <n>
//		persist          on|off
//		persist_interval <duration>
//	}
func (s *LocalStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume store name
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "max_keys":
			if s.MaxKeys != 0 {
				return d.Err("max_keys already specified")
			}
			n, err := intArg[int64](d)
			if err != nil {
				return err
			}
			if err := checkMin("max_keys", n, 1); err != nil {
				return d.WrapErr(err)
			}
			s.MaxKeys = n
		case "persist":
			if s.Persist != nil {
				return d.Err("persist already specified")
			}
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			if v != "on" && v != "off" {
				return d.Errf("invalid persist '%s': expected on or off", v)
			}
			on := v == "on"
			s.Persist = &on
		case "persist_interval":
			if s.PersistInterval != 0 {
				return d.Err("persist_interval already specified")
			}
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return d.Errf("invalid persist_interval '%s': expected a duration such as 30s", v)
			}
			if err := checkPersistInterval(dur); err != nil {
				return d.WrapErr(err)
			}
			s.PersistInterval = caddy.Duration(dur)
		default:
			return d.Errf("unrecognized store local subdirective '%s'", d.Val())
		}
	}
	if s.Persist != nil && !*s.Persist && s.PersistInterval != 0 {
		return d.Err("persist_interval set with persist off: remove one of them")
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner     = (*LocalStore)(nil)
	_ caddy.Validator       = (*LocalStore)(nil)
	_ caddy.CleanerUpper    = (*LocalStore)(nil)
	_ caddyfile.Unmarshaler = (*LocalStore)(nil)
	_ store                 = (*LocalStore)(nil)
)
