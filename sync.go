// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Zones with sync (docs/sync.md): the Redis store decides a zone's
// requests in this instance, from its own copy of each key's shared
// bucket, and reconciles the copies with Redis every interval, many keys
// in one script call (a flight of adjustments): what this instance spent
// goes up, and the shared bucket, with what the other instances spent,
// comes back.
//
// Three rules keep the instances together close to one exact bucket:
//
//   - A key this instance has no fresh copy of (Redis has not answered
//     for it within two intervals) is decided by Redis, exactly: a key
//     flooded everywhere from its first request gets no fresh burst in
//     each instance.
//   - A copy refuses when it lacks the tokens: the other instances only
//     take from the shared bucket, so it holds fewer still.
//   - A copy allows by itself only within an allowance: between two of
//     Redis's answers, this instance spends by itself at most what the
//     shared bucket refills meanwhile, and one interval's refill more
//     (the allowance is a bucket of one interval, refilled at the
//     zone's rate). A request beyond it, while the copy has the tokens,
//     is decided by Redis. So what the others spend unknown to this
//     instance is bounded, and the copies cannot each spend the bucket's
//     burst.
//
// What the instances spend together beyond the shared bucket is charged
// to it all the same, as a debt (the zone's limit may owe syncOwe beyond
// empty): every copy then refuses until it is paid back, so the excess
// does not add up interval after interval. It is at most about one
// interval's refill per other instance: with N instances, over any span,
// at most (N - 1) x rate x interval more than an exact zone allows.

const (
	minSync, maxSync = time.Millisecond, time.Minute

	// syncOwe is how many intervals of refill the shared bucket of a zone
	// with sync may owe beyond empty: what the instances spent together
	// beyond it before their copies knew, which the bound counts on being
	// charged. About one interval an instance: room for 32 of them.
	syncOwe = 32
)

func checkSyncInterval(d time.Duration) error {
	if d < minSync || d > maxSync {
		return fmt.Errorf("invalid sync %v: must be 1ms to 1m", d)
	}
	return nil
}

// checkSync checks a zone's sync, and what it cannot go with: what takes
// or gives back tokens that only Redis can account for exactly.
func (z *Zone) checkSync() error {
	if z.Sync == 0 {
		return nil
	}
	if err := checkSyncInterval(time.Duration(z.Sync)); err != nil {
		return err
	}
	switch {
	case !z.hasRate():
		return errors.New("sync needs a rate: it shares the zone's token buckets")
	case z.Ban != 0:
		return errors.New("sync cannot go with ban: a ban starts once, in Redis, for every instance")
	case z.Delay != 0:
		return errors.New("sync cannot go with delay: a waiting request holds tokens that only Redis can reserve for every instance")
	case z.Count != nil:
		return errors.New("sync cannot go with count: tokens given back after the response would not reach the other instances' copies")
	case z.Usage != nil:
		return errors.New("sync cannot go with usage: a response's usage is charged to the shared bucket, not to this instance's copy")
	case z.Quota != 0:
		return errors.New("sync cannot go with quota: a calendar quota is counted exactly, in Redis")
	case z.Concurrency != 0:
		return errors.New("sync cannot go with concurrency: its slots are leases that Redis holds for every instance")
	}
	return nil
}

// checkSyncStore checks that the zones with sync have the Redis store:
// the local store is one instance's, exact already.
func (h *Handler) checkSyncStore() error {
	var store struct {
		Backend string `json:"backend"`
	}
	if h.StoreRaw != nil {
		_ = json.Unmarshal(h.StoreRaw, &store) // a bad store fails when it loads
	}
	_, redis := h.store.(*RedisStore) // once provisioned, StoreRaw is gone
	redis = redis || store.Backend == "redis"
	for _, z := range h.Zones {
		if z != nil && z.Sync != 0 && !redis {
			return fmt.Errorf("zone %s: sync needs the Redis store (store redis { ... }): it shares a limit between instances", z.Name)
		}
	}
	return nil
}

// withSyncDebt is l of a zone that syncs every interval: its bucket may
// owe syncOwe intervals beyond empty.
func withSyncDebt(l limit, interval time.Duration) (limit, error) {
	l.owe = syncOwe * interval
	if l.burstTime+l.owe > maxBurstTime {
		return limit{}, fmt.Errorf("invalid sync %v: the burst and %d intervals must refill within 100 years", interval, syncOwe)
	}
	return l, nil
}
