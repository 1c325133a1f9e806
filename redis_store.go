// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddy-tokenbucket/ratelimit/lua"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(RedisStore{})
}

// redisScripts run with EVALSHA and are sent again with EVAL on NOSCRIPT,
// so a flushed script cache heals itself.
var redisScripts = rediswire.NewScripts(lua.Decide, lua.Peek)

// RedisStore keeps buckets in Redis, so that any number of Caddy instances
// share one exact limit per key. Each decision is one atomic script call
// that uses Redis's clock.
//
// Buckets live many to a Redis hash: the bucket of a key in a zone is the
// field `<zone>:<shape>:<key>` of the hash `<key_prefix>{<group>}`, where the
// group is one of 16384, chosen by the key alone. So the zones of one
// client share a hash and a slot and are decided in one call even on
// Redis Cluster, and a bucket costs Redis about a fifth of what a key
// of its own would. A hash expires when its last bucket is full again;
// an idle client costs Redis nothing.
//
// When Redis cannot answer within `timeout`, `fail_mode` decides. After
// repeated failures a circuit breaker stops waiting for Redis and probes it
// until it answers again.
type RedisStore struct {
	// Redis addresses (host:port). One address: a standalone server (or
	// a cluster, with `cluster`); several: a cluster, or the sentinels
	// with `sentinel`. Default: `127.0.0.1:6379`. Placeholders such as
	// `{env.REDIS_ADDR}` are expanded.
	Addresses []string `json:"addresses,omitempty"`

	// A `redis://user:password@host:port/db` or `rediss://` (TLS) URL,
	// instead of the addresses, username, password, db and tls fields.
	// Default: none.
	URL string `json:"url,omitempty"`

	// The user name of Redis ACLs. Placeholders such as `{env.REDIS_USER}`
	// are expanded when the config loads. Default: none.
	Username string `json:"username,omitempty"`

	// The password. Placeholders such as `{env.REDIS_PASSWORD}` are
	// expanded when the config loads. Default: none.
	Password string `json:"password,omitempty"`

	// The database number (standalone and sentinel only). Default: 0.
	DB int `json:"db,omitempty"`

	// The master name: the addresses are then Redis Sentinels, and the
	// store follows failovers. Not with cluster. Default: none.
	Sentinel string `json:"sentinel,omitempty"`

	// Use the cluster protocol even with a single seed address (several
	// addresses are a cluster already). Default: false.
	Cluster bool `json:"cluster,omitempty"`

	// Connect with TLS, with these options. Default: no TLS.
	TLS *RedisTLS `json:"tls,omitempty"`

	// Prefix of every key this store writes. Default: `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Hash bucket keys (SHA-256, 128 bits) instead of writing them as they
	// are, so client IPs or API keys are not stored in Redis. Keys longer
	// than 128 bytes are always hashed. Note that hashed IPv4 addresses
	// can still be found by trying them all. Default: false.
	HashKeys bool `json:"hash_keys,omitempty"`

	// The longest a decision may wait for Redis, then fail_mode decides.
	// A duration. Default: `100ms`.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// Connections per Redis node, at most 100000. Default: 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// What to do when Redis fails or does not answer in time: `local`
	// decides with this instance's own in-memory buckets, `open` allows
	// the request, `closed` answers 503 Service Unavailable. Default:
	// `local`.
	FailMode string `json:"fail_mode,omitempty"`

	// Ask Redis about every request. By default, once Redis has found a
	// bucket empty this instance refuses the bucket's requests by itself
	// until tokens can have come back, which is exact (tokens only arrive
	// at the zone's rate) and spares Redis most of a flood. It asks Redis
	// again within a second, or a token's refill when that is shorter, so
	// that a bucket reset through another instance's admin API is seen
	// here within that time; so are the tokens given back on another
	// instance to a client that left while waiting out a zone's delay.
	// Set this where these must take effect everywhere at once. Default:
	// false.
	DisableOverLimitCache bool `json:"disable_over_limit_cache,omitempty"`

	client   *rediswire.Client
	poolKey  string
	released bool // Cleanup let go of the client
	engine   *redisEngine
	logger   *zap.Logger
	// callTimeout is Timeout, or its default.
	callTimeout time.Duration
}

// A redisEngine decides the demands of a handler's zones in Redis, one
// script call a flight: the Redis store's engine. It knows nothing of
// Caddy: its module gives it the client, the pools it shares across
// reloads, and its config.
type redisEngine struct {
	FailMode              string // local, open or closed
	DisableOverLimitCache bool
	KeyPrefix             string
	HashKeys              bool

	client *rediswire.Client
	// release gives the client back to its pool, when the last user lets
	// go of the engine; syncPool holds the copies of the zones with sync
	// across reloads.
	release  func() error
	syncPool syncPool
	// setup names the client's connection setup, for the copies' pool.
	setup string
	// users counts what keeps the client from the pool's Delete: the
	// config until its Cleanup, and each request that holds the store
	// (see store.Holder). The last to let go gives it back.
	users       atomic.Int64
	callTimeout time.Duration
	keys        rediswire.Keys
	zones       []redisZone        // by zone index
	shapes      *shapeCache        // the shapes of limits that come with requests (plans)
	leaseIDs    string             // what this store's lease IDs start with: unique among instances
	flights     *flights           // calls in flight for the buckets in the over-limit cache
	syncIDs     []syncID           // the copies of the zones with sync it holds (sync.go)
	keyErrors   *throttle.Throttle // errors that Redis answered for one call's keys
	repairs     *throttle.Throttle // keys of another type that the script overwrote
	logger      *zap.Logger

	// testClock, when set, replaces Redis's clock, so that tests can
	// replay a table of instants. Never set outside tests.
	testClock func() time.Time
}

// A redisZone is what the store keeps for one zone.
type redisZone struct {
	name  string
	field string // how its buckets' fields start: the name and a tag of the shape (rediswire.BucketField)
	keys  string // how its slots' keys start after the hash: the name (rediswire.ZoneField)
	// counters is how its quota counters' keys start after the hash: the
	// name and a tag of the quota's window (rediswire.CounterZone). Keys
	// start with keys alone in builds before the tag: such a counter is
	// read while the tagged one is absent (see lua/decide/50_counters.lua).
	counters string
	refunds  bool // its buckets may be given tokens back
	plans    bool // its limit comes with each request: its buckets are scaled
	// The shapes of its demands as the script reads them, the last ones
	// asked for: a zone whose limit is fixed asks for the same each time.
	shape   atomic.Pointer[rediswire.Shape]
	counter atomic.Pointer[rediswire.CounterShape]
	slots   atomic.Pointer[rediswire.SlotShape]
	window  atomic.Pointer[window]           // the quota window last sent
	cache   *memstore.Table[memstore.Bucket] // over-limit cache; nil when disabled
	learned learnedOverrides                 // the keys' own limits Redis's answers told the cache
	// maxOverrides is the most keys with their own limit (max_overrides).
	maxOverrides int64
	// overridden is how many keys of the zone have their own limit, as
	// Redis said when last asked; polled lest it is stale (see
	// mayOverride).
	overridden     atomic.Pointer[countedOverrides]
	overriddenPoll atomic.Int64 // when it was last polled, in nanoseconds of the process's clock
	// overriddenGen counts the times the zone's first override was
	// found: a call sent before then, without reading overrides, teaches
	// the over-limit cache nothing.
	overriddenGen atomic.Uint64
	counts        *memstore.Table[memstore.Counter] // the quota counts Redis last gave (see fromCache); nil without a quota or the cache
	sync          *syncZone                         // this instance's copies of its buckets (see sync.go); nil without sync
}

const (
	// overLimitCacheKeys bounds the over-limit cache of each zone. It
	// holds only the keys that recently ran out of tokens, and losing an
	// entry only costs a call to Redis.
	overLimitCacheKeys = 100_000

	defaultRedisAddress = "127.0.0.1:6379"
	defaultKeyPrefix    = "rl:"
	defaultRedisTimeout = 100 * time.Millisecond
)

// CaddyModule returns the Caddy module information.
func (RedisStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.redis",
		New: func() caddy.Module { return new(RedisStore) },
	}
}

// Cleanup lets go of the client. Requests of this config may still be
// running, a long stream or a request waiting on its upstream: the
// client goes back to the pool when the last of them ends (see done),
// and closes when no config uses it either, so that they settle and
// give their slots back through it, as they would without the reload.
func (s *RedisStore) Cleanup() error {
	if s.client == nil || s.released {
		return nil
	}
	s.released = true
	if s.engine == nil { // never bound
		_, err := redisClients.Delete(s.poolKey)
		return err
	}
	return s.engine.drop()
}

// Hold keeps the client for a request, unless the store let go of it
// already.
func (s *redisEngine) Hold() bool {
	for {
		n := s.users.Load()
		if n == 0 {
			return false
		}
		if s.users.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// Done ends a request's hold.
func (s *redisEngine) Done() {
	if err := s.drop(); err != nil {
		s.logger.Error("rate limit: redis client not given back", zap.Error(err))
	}
}

// drop drops one user of the client; the last gives it back to the pool.
func (s *redisEngine) drop() error {
	if s.users.Add(-1) != 0 {
		return nil
	}
	// The copies of sync zones go with the last user, before the client:
	// their last reconciliation needs it.
	err := s.releaseSync()
	return errors.Join(err, s.release())
}

// bind makes the store's engine for zones.
func (s *RedisStore) bind(zones []store.ZoneSpec) (store.Store, error) {
	e := &redisEngine{
		FailMode: s.FailMode, DisableOverLimitCache: s.DisableOverLimitCache, KeyPrefix: s.KeyPrefix, HashKeys: s.HashKeys,
		client: s.client, setup: s.poolKey, syncPool: syncPooled{}, callTimeout: s.callTimeout, logger: s.logger,
		release: func() error {
			_, err := redisClients.Delete(s.poolKey)
			return err
		},
	}
	e.users.Store(1) // the config's, until its Cleanup
	if err := e.bind(zones); err != nil {
		return nil, err
	}
	s.engine = e
	return e, nil
}

func (s *redisEngine) bind(zones []store.ZoneSpec) error {
	s.flights = &flights{m: make(map[flightKey]flight)}
	s.keys = rediswire.Keys{Prefix: s.KeyPrefix, Hash: s.HashKeys}
	s.shapes, s.keyErrors, s.repairs = new(shapeCache), new(throttle.Throttle), new(throttle.Throttle)
	var id [9]byte
	_, _ = rand.Read(id[:])
	s.leaseIDs = base64.RawURLEncoding.EncodeToString(id[:]) + ":"
	s.zones = make([]redisZone, len(zones))
	for i, z := range zones {
		rz := &s.zones[i]
		rz.name, rz.keys, rz.refunds, rz.maxOverrides = z.Name, rediswire.ZoneField(z.Name), z.Refunds, z.MaxOverrides
		// A bucket's state is its zone's name and shape, as a local
		// table's is (tableID).
		rz.field = bucketField(z.Name, z.Shape)
		if z.Quota != "" {
			rz.counters = rediswire.CounterZone(z.Name, z.Quota)
		}
		// Not known yet, and asked at the first decision.
		rz.overridden.Store(&countedOverrides{n: -1, at: math.MinInt64 / 2})
		rz.overriddenPoll.Store(math.MinInt64 / 2)
		rz.plans = z.Bucket && z.Shape.Burst == 0
		if !s.DisableOverLimitCache {
			rz.cache = memstore.NewBuckets(overLimitCacheKeys, time.Now())
			if z.Quota != "" {
				rz.counts = memstore.NewCounters(overLimitCacheKeys, time.Now())
			}
		}
		// A store whose zones ask Redis something asks it at load
		// whether it runs scripts, so that a refusal is said then rather
		// than at the first request; one whose zones ask nothing (an
		// adaptive limit alone) never calls Redis.
		if z.Bucket || z.Quota != "" || z.Slots {
			s.client.Check(s.logger, s.FailMode, s.callTimeout)
		}
	}
	return s.bindSync(zones)
}

func (s *redisEngine) FailureMode() store.FailMode { return store.FailModes[s.FailMode] }

// known is what the over-limit cache knows of b's bucket. When the
// request gave up waiting for the calls in flight for its bucket
// (errNoAnswer), those calls may yet take their tokens: they count too.
func (s *redisEngine) Known(now time.Time, b *store.BucketDemand, err error) time.Duration {
	t := s.zones[b.Zone].cache
	if t == nil {
		return 0
	}
	debt := b.Limit.Debt(memstore.BucketAt(t, b.Key), t.Instant(now))
	if errors.Is(err, errNoAnswer) && b.Cost > 0 {
		// No more than the bucket may owe, which a take clamps it to
		// anyway: the calls' costs could pass a time.Duration.
		n, most := s.flights.calls(flightKey{b.Zone, t.Hash(b.Key)}), b.Limit.Most()
		if n > int64((most-debt)/b.Cost) {
			return most
		}
		debt += time.Duration(n) * b.Cost
	}
	return debt
}

// take decides d: from this instance's copies, for zones with sync (see
// takeSync), else in Redis.
func (s *redisEngine) Take(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	if len(s.syncIDs) > 0 && s.synced(d) {
		return s.takeSync(ctx, now, d)
	}
	return s.takeExact(ctx, now, d)
}

// takeExact decides d in one call where their keys share a cluster slot.
// Each slot taken is a lease (see lua/decide/60_slots.lua): a member of a
// sorted set whose score is the instant, on Redis's clock, when it ends.
// A lease is not renewed: a request that runs longer than its zone's
// lease loses its slot then, so that a slot held by an instance that died
// comes back after the lease however it died, with no timers or writes
// for the requests in flight. Demands the over-limit cache can refuse
// are refused without asking Redis.
func (s *redisEngine) takeExact(ctx context.Context, now time.Time, d *store.Demands) (bool, error) {
	if len(d.Slots) > 0 {
		id := s.leaseIDs + strconv.FormatUint(leaseSeq.Add(1), 36)
		for i := range d.Slots {
			d.Slots[i].Claim = id
		}
	}
	// One timeout for the whole decision: a request that waits for the
	// calls in flight for its buckets has that much less for its own.
	budget := s.callTimeout
	var flight flightKey
	cached := !s.DisableOverLimitCache && len(d.Buckets)+len(d.Counters) > 0
	if cached {
		arrived := now
		var decided, allowed bool
		var err error
		if now, flight, decided, allowed, err = s.fromCache(ctx, now, d); decided || err != nil {
			return allowed && err == nil, err
		}
		defer s.flights.land(flight)
		budget -= now.Sub(arrived)
	}
	gen := s.overriddenGen(d)
	allowed, err := s.ask(ctx, budget, d)
	if err == nil && cached && s.overriddenGen(d) == gen {
		s.remember(now, d, flight)
	}
	return allowed, err
}

// ask has Redis decide d within budget, and tells the breaker what the
// call said of Redis.
func (s *redisEngine) ask(ctx context.Context, budget time.Duration, d *store.Demands) (bool, error) {
	waited := budget < s.callTimeout
	if !s.client.Up() {
		return false, rediswire.ErrDown
	}
	// The pipeline times the call; a request that waited for others'
	// calls brings a timer of its own (see the pipeline's run).
	deadline := time.Now().Add(budget)
	call := ctx
	if waited {
		var cancel context.CancelFunc
		call, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	sent := deadline.Add(-budget)
	allowed, err := s.decide(call, deadline, d)
	late := !time.Now().Before(deadline)
	if err == nil {
		s.client.NoteRTT(time.Since(sent))
	}
	switch kind := rediswire.Classify(err); {
	case err == nil || kind == rediswire.Answered:
		s.client.Answered(s.logger)
		if err != nil {
			s.keyErrors.Warn(s.logger, "redis refused one decision: fail_mode decides that request", err)
		}
	case ctx.Err() != nil || kind == rediswire.Unknown || waited && late:
		// The client went away, a reload closed this config's
		// connections, the pool had no connection free, or a call that
		// had only what was left of the timeout ran out of it: nothing
		// is known of Redis.
	default:
		s.client.Failed(s.logger, s.FailMode, err)
	}
	if err != nil {
		for i := range d.Slots {
			d.Slots[i].Held, d.Slots[i].Free = false, 0
		}
	}
	return allowed, err
}

// adjust charges the demands' costs, in one call where their keys share
// a slot, and makes this instance's over-limit cache forget them (other
// instances' caches do not deny a zone whose buckets get tokens back,
// but for a ban, which a refund never shortens).
func (s *redisEngine) Adjust(ctx context.Context, _ time.Time, d *store.Demands) error {
	for i := range d.Buckets {
		if t := s.zones[d.Buckets[i].Zone].cache; t != nil {
			t.Forget(d.Buckets[i].Key)
		}
	}
	for i := range d.Counters {
		if t := s.zones[d.Counters[i].Zone].counts; t != nil {
			t.Forget(d.Counters[i].Key)
		}
	}
	if !s.client.Up() {
		return rediswire.ErrDown
	}
	if !s.client.Cluster || oneTag(d) {
		return s.adjustEach(ctx, d)
	}
	return s.adjustApart(ctx, d.Buckets, d.Counters)
}

func (s *redisEngine) Peek(ctx context.Context, _ time.Time, d *store.Demands) error {
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	_, err := s.run(ctx, deadline, rediswire.Peek, d)
	if err == nil && len(s.syncIDs) > 0 {
		s.peekSync(d)
	}
	return err
}

// reset deletes the buckets and counters, and what this instance's
// over-limit cache and copies knew of them. Other instances' caches
// learn it when their entry runs out, until then they may still deny
// those keys; their copies, at their next reconciliation.
func (s *redisEngine) Reset(ctx context.Context, d *store.Demands) (bool, error) {
	if len(s.syncIDs) > 0 {
		s.forgetSync(d)
	}
	ctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	found := false
	for i := range d.Buckets {
		b := &d.Buckets[i]
		if t := s.zones[b.Zone].cache; t != nil {
			t.Forget(b.Key)
		}
		hash, field := s.bucketName(b.Zone, b.Key)
		n, err := s.client.HDel(ctx, hash, field).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	for i := range d.Counters {
		c := &d.Counters[i]
		if t := s.zones[c.Zone].counts; t != nil {
			t.Forget(c.Key)
		}
		// The untagged key too: it would be read in the tagged one's place.
		counter, untagged := s.counterKeys(c.Zone, c.Key)
		n, err := s.client.Del(ctx, counter, untagged).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	return found, nil
}

func (s *redisEngine) Stats(zone int) store.ZoneStats {
	st := store.ZoneStats{OverLimitCache: !s.DisableOverLimitCache, Client: s.client, Unavailable: !s.client.Up()}
	if sz := s.zones[zone].sync; sz != nil {
		st.SyncCopies = sz
		st.SyncCalls, st.SyncFailed, st.SyncKeys, st.SyncHeld = sz.calls.Load(), sz.failed.Load(), sz.keys.Load(), sz.size.Load()
	}
	return st
}

// Interface guards
var (
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddy.Validator       = (*RedisStore)(nil)
	_ caddy.CleanerUpper    = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
	_ storeModule           = (*RedisStore)(nil)
	_ store.Store           = (*redisEngine)(nil)
	_ store.Fallible        = (*redisEngine)(nil)
	_ store.Holder          = (*redisEngine)(nil)
)
