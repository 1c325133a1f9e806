// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package redisstore

// The upkeep of zones with share (share.go): the sweep that returns the
// shares keys no longer use, the shares made and returned with the
// store, what the store reports of them, and the shared state of a key.

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/redis/go-redis/v9"
)

// now is the store's clock: Redis's replaced, in tests, else this
// process's.
func (s *Store) now() time.Time {
	if s.opt.Clock != nil {
		return s.opt.Clock()
	}
	return time.Now()
}

// sweep returns the shares that keys no longer use (idleFor), forgets
// the keys idle for two ttls, and counts the shares that ended here
// unreturned. The store's last user stops it (see releaseShares), which
// returns every share left.
func (s *Store) sweep(sz *shareZone) {
	defer close(sz.done)
	tick := time.NewTicker(max(sz.ttl/4, 5*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-sz.stop:
			s.returnShares(sz, true)
			return
		case <-tick.C:
			s.returnShares(sz, false)
		}
	}
}

// returnShares returns the shares of keys idle for half a ttl (all, with
// every), in one flight.
func (s *Store) returnShares(sz *shareZone, every bool) {
	now := s.now()
	var calls []*rediswire.Call
	deadline := time.Now().Add(s.opt.CallTimeout)
	for i := range sz.shards {
		sh := &sz.shards[i]
		sh.mu.Lock()
		for h, e := range sh.m {
			if e.holder != "" && !now.Before(e.until) && !e.asking {
				if e.granted > e.spent {
					sz.writeOffs.Add(1)
				}
				e.holder = ""
			}
			if e.holder != "" && !e.asking && e.held == 0 && (every || idleFor(sz.ttl, now, e)) {
				call := rediswire.NewCall(rediswire.Share, deadline)
				if s.opt.Clock != nil {
					call.Clock(s.opt.Clock())
				}
				hash, field := s.bucketName(sz.zone, e.key)
				call.Share(hash, field, s.zones[sz.zone].shape.Load(), 0, e.holder, e.granted, e.spent, 0, 0, true)
				calls = append(calls, call)
				e.holder = ""
			}
			if e.holder == "" && now.Sub(e.used) >= 2*sz.ttl && !now.Before(e.full) && !e.asking {
				delete(sh.m, h)
				sz.size.Add(-1)
			}
		}
		sh.mu.Unlock()
	}
	if len(calls) == 0 {
		return
	}
	_, errs := s.client.RunAll(calls)
	for _, err := range errs {
		if err == nil {
			sz.returns.Add(1)
		}
	}
}

// idleFor says whether e's share is returned for want of use: half a ttl
// after the key's last request, or a quarter when the share ends here
// within half a ttl, so that a key whose last request came before its
// share's renewal was due returns it a tick or more before it ends, not
// writes it off.
func idleFor(ttl time.Duration, now time.Time, e *shareOf) bool {
	idle := now.Sub(e.used)
	return idle >= ttl/2 || idle >= ttl/4 && e.until.Sub(now) <= ttl/2
}

// bindShares makes the shares of the zones with share, and starts their
// sweeps.
func (s *Store) bindShares(zones []store.ZoneSpec) {
	for i, z := range zones {
		if z.Share > 0 {
			sz := newShareZone(i, z.Share)
			s.zones[i].shares, s.shares = sz, true
			go s.sweep(sz)
		}
	}
}

// releaseShares stops the sweeps, which return every share left.
func (s *Store) releaseShares() {
	for i := range s.zones {
		if sz := s.zones[i].shares; sz != nil {
			close(sz.stop)
			<-sz.done
		}
	}
}

// stats reports what sz did (see store.ZoneStats).
func (sz *shareZone) stats(st *store.ZoneStats) {
	st.Shares = sz
	st.ShareGrants, st.ShareReturns, st.ShareWriteOffs = sz.grants.Load(), sz.returns.Load(), sz.writeOffs.Load()
	st.ShareHere, st.ShareRedis, st.ShareKeys = sz.here.Load(), sz.exact.Load(), sz.size.Load()
}

// ShareState is what Redis keeps of the shares of key's bucket in a zone
// with share, and this instance's share of it.
func (s *Store) ShareState(ctx context.Context, zone int, key store.Key) (store.ShareState, error) {
	var st store.ShareState
	sz := s.zones[zone].shares
	if sz == nil {
		return st, nil
	}
	now := s.now()
	sh, e := sz.lock(key, false)
	if e != nil && e.left(now) > 0 {
		st.Here, st.EndsIn = e.left(now), e.until.Sub(now)
	}
	sh.mu.Unlock()
	hash, field := s.bucketName(zone, key)
	ctx, cancel := context.WithTimeout(ctx, s.opt.CallTimeout)
	defer cancel()
	var clock *redis.TimeCmd
	var holders *redis.StringCmd
	if _, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		clock, holders = p.Time(ctx), p.HGet(ctx, hash, field+"#")
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return st, err
	}
	at := clock.Val()
	if s.opt.Clock != nil {
		at = s.opt.Clock()
	}
	st.Out, st.Holders = outOf(holders.Val(), at.Sub(shareEpoch).Nanoseconds())
	return st, nil
}

// shareEpoch is where the script's instants count from.
var shareEpoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// outOf reads a bucket's holders field (lua/decide/65_share.lua): the
// tokens out in the shares that end after now (nanoseconds since
// shareEpoch), and how many.
func outOf(v string, now int64) (out time.Duration, n int) {
	_, list, ok := strings.Cut(v, ":")
	if !ok {
		return 0, 0
	}
	for rec := range strings.SplitSeq(list, ";") {
		f := strings.Split(rec, "|")
		if len(f) != 4 {
			continue
		}
		g, err1 := strconv.ParseInt(f[1], 10, 64)
		sp, err2 := strconv.ParseInt(f[2], 10, 64)
		until, err3 := strconv.ParseInt(f[3], 10, 64)
		if err1 == nil && err2 == nil && err3 == nil && until > now {
			out += time.Duration(g - sp)
			n++
		}
	}
	return out, n
}
