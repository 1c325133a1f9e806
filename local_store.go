// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"errors"
	"fmt"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
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
// burst are unchanged, and restarts through Caddy's storage (see
// `persist`). Memory is bounded by `max_keys` per zone; a tracked key
// costs about 84 bytes whatever its length.
type LocalStore struct {
	// The most buckets kept per zone. When a zone is full, buckets that
	// have refilled are dropped first, which changes no decision; if none
	// has, the least recently used is evicted (its client gets a full
	// bucket back) and counted: exactly in a zone of up to 1024 keys,
	// among a few sampled in a larger one. A zone first loaded with 4096
	// or more, whose max_keys a reload lowers, keeps up to 4096 until
	// Caddy restarts. Default: 1000000.
	MaxKeys int64 `json:"max_keys,omitempty"`

	// Keep the buckets across restarts, in Caddy's storage (where
	// certificates are kept): they are written when Caddy exits and
	// every persist_interval, and loaded when it starts. Default: true.
	Persist *bool `json:"persist,omitempty"`

	// How often the buckets are written: how much of them a crash can
	// lose. A duration, at least 100ms. Default: 30s.
	PersistInterval caddy.Duration `json:"persist_interval,omitempty"`

	bound    bool                // its engine is made: a store binds one handler's zones
	acquired []any               // the keys of what it acquired in localTables and localSlots
	snaps    *memstore.Snapshots // where the tables are persisted; nil: they are not
}

const defaultMaxKeys = 1_000_000

// localTables holds the tables of every zone of every loaded config, so
// that a reload which keeps a zone keeps its buckets and counters: the
// new config acquires a table before the old one releases it.
var localTables = caddy.NewUsagePool()

// localSlots holds the slot tables of the zones with concurrency, by
// zone name: across a reload, the new config counts the old one's
// requests still running, which give their slots back to the same table.
var localSlots = caddy.NewUsagePool()

// A slotsID names a zone's slot table in localSlots.
type slotsID string

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
		s.PersistInterval = caddy.Duration(memstore.DefaultPersistInterval)
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

func (s *LocalStore) bind(zones []store.ZoneSpec) (store.Store, error) {
	for _, z := range zones {
		if z.Sync != 0 {
			return nil, errSyncNeedsRedis(z.Name)
		}
	}
	e, err := s.engine(zones)
	if err != nil {
		return nil, err
	}
	return e, nil
}

// engine is the store's engine for zones: fail_mode local's, of a store
// that was not provisioned, too.
func (s *LocalStore) engine(zones []store.ZoneSpec) (*memstore.Store, error) {
	if s.bound {
		return nil, errors.New("local store is already in use by another handler")
	}
	s.bound = true
	return memstore.New(zones, pooled{s})
}

// pooled gets the tables of a local store's zones from the pools, shared
// with the other configs that use them (memstore.Tables).
type pooled struct{ s *LocalStore }

func (p pooled) Buckets(id memstore.TableID, most time.Duration) (*memstore.Table[memstore.Bucket], error) {
	return acquireTable[memstore.Bucket](p.s, id, most)
}

func (p pooled) Counters(id memstore.TableID) (*memstore.Table[memstore.Counter], error) {
	return acquireTable[memstore.Counter](p.s, id, 0)
}

func (p pooled) Slots(name string) (*memstore.SlotTable, error) { return p.s.acquireSlots(name) }

// acquireTable gets the table of id, shared with the other configs that
// use it; most is the longest one of its buckets may owe.
func acquireTable[E memstore.Entry](s *LocalStore, id memstore.TableID, most time.Duration) (*memstore.Table[E], error) {
	v, _, err := localTables.LoadOrNew(id, func() (caddy.Destructor, error) {
		t := memstore.NewTable[E](s.MaxKeys, time.Now())
		if s.snaps != nil {
			t.Persist(s.snaps, id, most)
		}
		go t.SweepLoop()
		return t, nil
	})
	if err != nil {
		return nil, err
	}
	s.acquired = append(s.acquired, id)
	t := v.(*memstore.Table[E])
	t.SetMaxKeys(s.MaxKeys)
	// The config that uses the table last says where it is kept; a
	// store that was not provisioned (fail_mode local's fallback)
	// has no say.
	if s.snaps != nil || s.Persist != nil && !*s.Persist {
		t.Rebind(s.snaps)
	}
	return t, nil
}

// acquireSlots gets the slot table of the zone named name.
func (s *LocalStore) acquireSlots(name string) (*memstore.SlotTable, error) {
	v, _, err := localSlots.LoadOrNew(slotsID(name), func() (caddy.Destructor, error) {
		return memstore.NewSlotTable(s.MaxKeys), nil
	})
	if err != nil {
		return nil, err
	}
	s.acquired = append(s.acquired, slotsID(name))
	t := v.(*memstore.SlotTable)
	t.SetMaxKeys(s.MaxKeys)
	return t, nil
}

// Cleanup releases the tables, which stop when no config uses them.
func (s *LocalStore) Cleanup() error {
	var errs []error
	for _, id := range s.acquired {
		pool := localTables
		if _, ok := id.(slotsID); ok {
			pool = localSlots
		}
		if _, err := pool.Delete(id); err != nil {
			errs = append(errs, err)
		}
	}
	s.acquired = nil
	return errors.Join(errs...)
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
			dur, err := durationArg(d, "30s")
			if err != nil {
				return err
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
	_ storeModule           = (*LocalStore)(nil)
)
