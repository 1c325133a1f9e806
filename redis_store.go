// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/throttle"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(RedisStore{})
}

//go:embed lua/token_bucket.lua
var tokenBucketLua string

//go:embed lua/peek.lua
var peekLua string

// redisScripts run with EVALSHA and are sent again with EVAL on NOSCRIPT,
// so a flushed script cache heals itself.
var redisScripts = rediswire.NewScripts(tokenBucketLua, peekLua)

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

	client      *rediswire.Client
	poolKey     string
	released    bool          // Cleanup gave the client back
	callTimeout time.Duration // Timeout, or its default
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
	// read while the tagged one is absent (see lua/token_bucket.lua).
	counters string
	refunds  bool // its buckets may be given tokens back
	plans    bool // its limit comes with each request: its buckets are scaled
	// The shapes of its demands as the script reads them, the last ones
	// asked for: a zone whose limit is fixed asks for the same each time.
	shape   atomic.Pointer[rediswire.Shape]
	counter atomic.Pointer[rediswire.CounterShape]
	slots   atomic.Pointer[rediswire.SlotShape]
	window  atomic.Pointer[window] // the quota window last sent
	cache   *table[bucket]         // over-limit cache; nil when disabled
	learned learnedOverrides       // the keys' own limits Redis's answers told the cache
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
	counts        *table[counter] // the quota counts Redis last gave (see fromCache); nil without a quota or the cache
	sync          *syncZone       // this instance's copies of its buckets (see sync.go); nil without sync
}

// A window is a quota window and its boundaries as the script reads them.
type window struct {
	w    *quotaWindow
	args *rediswire.Window
}

// RedisTLS configures TLS connections to Redis.
type RedisTLS struct {
	// Accept any server certificate. Only for testing. Default: false.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`

	// A PEM file of the CA certificates to trust instead of the system's.
	// Default: the system's roots.
	CA string `json:"ca,omitempty"`
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

// redisClients holds the Redis clients of every loaded config, one per
// distinct connection setup, so that handlers share connection pools and
// a reload that keeps the setup keeps its connections.
var redisClients = caddy.NewUsagePool()

// Provision expands placeholders, sets defaults and gets the client.
// It does no network I/O: Caddy starts while Redis is down.
func (s *RedisStore) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	rediswire.SetLogger(s.logger)
	repl := caddy.NewReplacer()
	for i, a := range s.Addresses {
		s.Addresses[i] = repl.ReplaceAll(a, "")
	}
	s.URL = repl.ReplaceAll(s.URL, "")
	s.Username = repl.ReplaceAll(s.Username, "")
	s.Password = repl.ReplaceAll(s.Password, "")
	s.Sentinel = repl.ReplaceAll(s.Sentinel, "")
	if len(s.Addresses) == 0 && s.URL == "" {
		s.Addresses = []string{defaultRedisAddress}
	}
	if s.KeyPrefix == "" {
		s.KeyPrefix = defaultKeyPrefix
	}
	s.callTimeout = time.Duration(s.Timeout)
	if s.callTimeout == 0 {
		s.callTimeout = defaultRedisTimeout
	}
	if s.FailMode == "" {
		s.FailMode = "local"
	}
	if err := s.Validate(); err != nil {
		return err
	}
	if s.FailMode == "open" {
		s.logger.Warn("fail_mode open: requests are not limited while Redis is unavailable")
	}

	opts, err := s.options()
	if err != nil {
		return err
	}
	// The pool key is the whole connection setup.
	key, _ := json.Marshal(struct {
		Addrs             []string
		URL, User, Pass   string
		DB                int
		Sentinel          string
		Cluster           bool
		TLS               *RedisTLS
		Timeout, PoolSize int64
	}{s.Addresses, s.URL, s.Username, s.Password, s.DB, s.Sentinel, s.Cluster, s.TLS, int64(s.callTimeout), int64(s.PoolSize)})
	v, _, err := redisClients.LoadOrNew(string(key), func() (caddy.Destructor, error) {
		return rediswire.NewClient(opts, redisScripts)
	})
	if err != nil {
		return err
	}
	s.poolKey = string(key)
	s.client = v.(*rediswire.Client)
	return registerSyncMetrics(ctx)
}

// options turns the configuration into go-redis options.
func (s *RedisStore) options() (*redis.UniversalOptions, error) {
	opts := &redis.UniversalOptions{
		Addrs:         s.Addresses,
		Username:      s.Username,
		Password:      s.Password,
		DB:            s.DB,
		MasterName:    s.Sentinel,
		IsClusterMode: s.Cluster,
		PoolSize:      s.PoolSize,
		// Every decision carries a deadline; a failed one is decided by
		// fail_mode, not retried.
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		DialTimeout:           s.callTimeout,
		ReadTimeout:           s.callTimeout,
		WriteTimeout:          s.callTimeout,
		PoolTimeout:           s.callTimeout,
		MaintNotificationsConfig: &maintnotifications.Config{
			Mode: maintnotifications.ModeDisabled,
		},
		// RESP2: the store needs no push messages, and with RESP3
		// go-redis looks for them before every reply it reads.
		Protocol: 2,
	}
	if s.URL != "" {
		u, err := redis.ParseURL(s.URL)
		if err != nil {
			return nil, fmt.Errorf("invalid url: %w", err)
		}
		opts.Addrs = []string{u.Addr}
		opts.Username, opts.Password, opts.DB, opts.TLSConfig = u.Username, u.Password, u.DB, u.TLSConfig
	}
	if s.TLS != nil {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: s.TLS.InsecureSkipVerify}
		if s.TLS.CA != "" {
			pem, err := os.ReadFile(s.TLS.CA)
			if err != nil {
				return nil, fmt.Errorf("tls ca: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("tls ca: no certificates in %s", s.TLS.CA)
			}
		}
		opts.TLSConfig = cfg
	}
	return opts, nil
}

// Validate checks the configuration.
func (s *RedisStore) Validate() error {
	switch {
	case s.URL != "" && (len(s.Addresses) > 0 || s.Username != "" || s.Password != "" || s.DB != 0 || s.TLS != nil):
		return errors.New("url replaces addresses, username, password, db and tls: use one or the other")
	case s.Sentinel != "" && s.Cluster:
		return errors.New("sentinel and cluster exclude each other")
	}
	for _, a := range s.Addresses {
		if a == "" {
			return errors.New("empty address")
		}
	}
	if strings.ContainsAny(s.KeyPrefix, "{}") {
		return fmt.Errorf("invalid key_prefix '%s': '{' and '}' would change the cluster hash tag of the keys", s.KeyPrefix)
	}
	if err := cmp.Or(checkDB(s.DB), checkPoolSize(s.PoolSize)); err != nil {
		return err
	}
	if s.Timeout != 0 {
		if err := checkTimeout(time.Duration(s.Timeout)); err != nil {
			return err
		}
	}
	if s.FailMode != "" {
		return checkFailMode(s.FailMode)
	}
	return nil
}

func checkDB(n int) error       { return checkRange("db", n, 0, math.MaxInt32) }
func checkPoolSize(n int) error { return checkRange("pool_size", n, 0, maxPoolSize) }

// maxPoolSize bounds pool_size far above any real need (the default is
// 10 per CPU), and within what go-redis accepts.
const maxPoolSize = 100_000

func checkTimeout(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("invalid timeout %v: must be positive", d)
	}
	return nil
}

func checkFailMode(s string) error {
	if _, ok := failModes[s]; !ok {
		return fmt.Errorf("invalid fail_mode '%s': expected local, open or closed", s)
	}
	return nil
}

// Cleanup releases the client, which closes when no config uses it.
// Requests of this config may still be running: they keep the client,
// and a closed one gives them an error that fail_mode decides.
func (s *RedisStore) Cleanup() error {
	if s.client == nil || s.released {
		return nil
	}
	s.released = true
	err := s.releaseSync() // with the client: the last reconciliation needs it
	_, cerr := redisClients.Delete(s.poolKey)
	return errors.Join(err, cerr)
}

func (s *RedisStore) bind(zones []zoneSpec) error {
	s.flights = &flights{m: make(map[flightKey]flight)}
	s.keys = rediswire.Keys{Prefix: s.KeyPrefix, Hash: s.HashKeys}
	s.shapes, s.keyErrors, s.repairs = new(shapeCache), new(throttle.Throttle), new(throttle.Throttle)
	var id [9]byte
	_, _ = rand.Read(id[:])
	s.leaseIDs = base64.RawURLEncoding.EncodeToString(id[:]) + ":"
	s.zones = make([]redisZone, len(zones))
	for i, z := range zones {
		rz := &s.zones[i]
		rz.name, rz.keys, rz.refunds, rz.maxOverrides = z.name, rediswire.ZoneField(z.name), z.refunds, z.maxOverrides
		// A bucket's state is its zone's name and shape, as a local
		// table's is (tableID).
		rz.field = bucketField(z.name, z.shape)
		if z.quota != "" {
			rz.counters = rediswire.CounterZone(z.name, z.quota)
		}
		// Not known yet, and asked at the first decision.
		rz.overridden.Store(&countedOverrides{n: -1, at: math.MinInt64 / 2})
		rz.overriddenPoll.Store(math.MinInt64 / 2)
		rz.plans = z.bucket && z.shape.burst == 0
		if !s.DisableOverLimitCache {
			rz.cache = newBuckets(overLimitCacheKeys, time.Now())
			if z.quota != "" {
				rz.counts = newCounters(overLimitCacheKeys, time.Now())
			}
		}
	}
	return s.bindSync(zones)
}

func (s *RedisStore) failMode() failMode { return failModes[s.FailMode] }

// known is what the over-limit cache knows of b's bucket. When the
// request gave up waiting for the calls in flight for its bucket
// (errNoAnswer), those calls may yet take their tokens: they count too.
func (s *RedisStore) known(now time.Time, b *bucketDemand, err error) time.Duration {
	t := s.zones[b.zone].cache
	if t == nil {
		return 0
	}
	debt := b.limit.debt(bucketAt(t, b.key), t.instant(now))
	if errors.Is(err, errNoAnswer) {
		debt += time.Duration(s.flights.calls(flightKey{b.zone, t.hash(b.key)})) * b.cost
	}
	return debt
}

// take decides d: from this instance's copies, for zones with sync (see
// takeSync), else in Redis.
func (s *RedisStore) take(ctx context.Context, now time.Time, d *demands) (bool, error) {
	if len(s.syncIDs) > 0 && s.synced(d) {
		return s.takeSync(ctx, now, d)
	}
	return s.takeExact(ctx, now, d)
}

// takeExact decides d in one call where their keys share a cluster slot.
// Each slot taken is a lease (see lua/token_bucket.lua): a member of a
// sorted set whose score is the instant, on Redis's clock, when it ends.
// A lease is not renewed: a request that runs longer than its zone's
// lease loses its slot then, so that a slot held by an instance that died
// comes back after the lease however it died, with no timers or writes
// for the requests in flight. Demands the over-limit cache can refuse
// are refused without asking Redis.
func (s *RedisStore) takeExact(ctx context.Context, now time.Time, d *demands) (bool, error) {
	if len(d.slots) > 0 {
		id := s.leaseIDs + strconv.FormatUint(leaseSeq.Add(1), 36)
		for i := range d.slots {
			d.slots[i].claim = id
		}
	}
	// One timeout for the whole decision: a request that waits for the
	// calls in flight for its buckets has that much less for its own.
	budget := s.callTimeout
	var flight flightKey
	cached := !s.DisableOverLimitCache && len(d.buckets)+len(d.counters) > 0
	if cached {
		arrived := now
		var denied bool
		var err error
		if now, flight, denied, err = s.fromCache(ctx, now, d); denied || err != nil {
			return false, err
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

// leaseSeq numbers the leases this process takes.
var leaseSeq atomic.Uint64

// ask has Redis decide d within budget, and tells the breaker what the
// call said of Redis.
func (s *RedisStore) ask(ctx context.Context, budget time.Duration, d *demands) (bool, error) {
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
		for i := range d.slots {
			d.slots[i].held, d.slots[i].free = false, 0
		}
	}
	return allowed, err
}

// decide asks Redis. Demands whose keys share a hash tag go in one atomic
// call. On a cluster, keys in different slots are taken one at a time,
// and when one refuses, the buckets and counters already charged get
// their tokens back, and the slots already taken are given back.
func (s *RedisStore) decide(ctx context.Context, deadline time.Time, d *demands) (bool, error) {
	if !s.client.Cluster || oneTag(d) {
		return s.run(ctx, deadline, rediswire.Take, d)
	}
	var one demands
	for i := range d.buckets {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, d.buckets[i:i+1], nil, nil)); !ok || err != nil {
			notAsked(d.buckets[i+1:], d.counters)
			return false, s.undo(ctx, deadline, err, d.buckets[:i], nil, nil, d.slots)
		}
	}
	for i := range d.counters {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, d.counters[i:i+1], nil)); !ok || err != nil {
			notAsked(nil, d.counters[i+1:])
			return false, s.undo(ctx, deadline, err, d.buckets, d.counters[:i], nil, d.slots)
		}
	}
	for i := range d.slots {
		if ok, err := s.run(ctx, deadline, rediswire.Take, part(&one, nil, nil, d.slots[i:i+1])); !ok || err != nil {
			return false, s.undo(ctx, deadline, err, d.buckets, d.counters, d.slots[:i], d.slots[i+1:])
		}
	}
	return true, nil
}

// notAsked answers the buckets and counters that a refusal before them
// left unasked: they refused nothing.
func notAsked(b []bucketDemand, c []counterDemand) {
	for i := range b {
		b[i].ok, b[i].debt = true, 0
	}
	for i := range c {
		c[i].ok, c[i].used, c[i].left = true, 0, 0
	}
}

// part is one as the demands of the given parts.
func part(one *demands, b []bucketDemand, c []counterDemand, sl []slotDemand) *demands {
	one.buckets, one.counters, one.slots = b, c, sl
	return one
}

// undo gives back what the demands taken one call each took, after the
// call of another failed with err (or refused: err nil): the tokens of
// b and c, the slots of taken; the slots not asked are left unheld.
func (s *RedisStore) undo(ctx context.Context, deadline time.Time, err error, b []bucketDemand, c []counterDemand, taken, notAsked []slotDemand) error {
	if len(b)+len(c) > 0 {
		backB, backC := slices.Clone(b), slices.Clone(c)
		for i := range backB {
			backB[i].cost = -backB[i].cost
		}
		for i := range backC {
			backC[i].cost = -backC[i].cost
		}
		if rerr := s.adjustApart(ctx, backB, backC); rerr != nil {
			err = errors.Join(err, fmt.Errorf("refund: %w", rerr))
		}
		// Each now owes what its refund left.
		for i := range b {
			b[i].debt = backB[i].debt
		}
		for i := range c {
			c[i].used, c[i].left = backC[i].used, backC[i].left
		}
	}
	if len(taken) > 0 {
		if rerr := s.release(ctx, taken); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release: %w", rerr))
		}
		for i := range taken {
			taken[i].held, taken[i].free = false, taken[i].free+1
		}
	}
	for i := range notAsked {
		notAsked[i].held, notAsked[i].free = false, 0
	}
	return err
}

// adjust charges the demands' costs, in one call where their keys share
// a slot, and makes this instance's over-limit cache forget them (other
// instances' caches do not deny a zone whose buckets get tokens back,
// but for a ban, which a refund never shortens).
func (s *RedisStore) adjust(ctx context.Context, _ time.Time, d *demands) error {
	for i := range d.buckets {
		if t := s.zones[d.buckets[i].zone].cache; t != nil {
			t.forget(d.buckets[i].key)
		}
	}
	for i := range d.counters {
		if t := s.zones[d.counters[i].zone].counts; t != nil {
			t.forget(d.counters[i].key)
		}
	}
	if !s.client.Up() {
		return rediswire.ErrDown
	}
	if !s.client.Cluster || oneTag(d) {
		return s.adjustEach(ctx, d)
	}
	return s.adjustApart(ctx, d.buckets, d.counters)
}

// adjustApart adjusts each bucket and counter in a call of its own: their
// keys are in different cluster slots.
func (s *RedisStore) adjustApart(ctx context.Context, b []bucketDemand, c []counterDemand) error {
	var errs []error
	var one demands
	for i := range b {
		if err := s.adjustEach(ctx, part(&one, b[i:i+1], nil, nil)); err != nil {
			errs = append(errs, err)
		}
	}
	for i := range c {
		if err := s.adjustEach(ctx, part(&one, nil, c[i:i+1], nil)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// adjustEach sends one adjustment call for d. The client may have gone:
// the adjustment is made all the same.
func (s *RedisStore) adjustEach(ctx context.Context, d *demands) error {
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	_, err := s.run(ctx, deadline, rediswire.Adjust, d)
	return err
}

func (s *RedisStore) peek(ctx context.Context, _ time.Time, d *demands) error {
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
func (s *RedisStore) reset(ctx context.Context, d *demands) (bool, error) {
	if len(s.syncIDs) > 0 {
		s.forgetSync(d)
	}
	ctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	found := false
	for i := range d.buckets {
		b := &d.buckets[i]
		if t := s.zones[b.zone].cache; t != nil {
			t.forget(b.key)
		}
		hash, field := s.bucketName(b.zone, b.key)
		n, err := s.client.HDel(ctx, hash, field).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	for i := range d.counters {
		c := &d.counters[i]
		if t := s.zones[c.zone].counts; t != nil {
			t.forget(c.key)
		}
		// The untagged key too: it would be read in the tagged one's place.
		counter, untagged := s.counterKeys(c.zone, c.key)
		n, err := s.client.Del(ctx, counter, untagged).Result()
		if err != nil {
			return found, err
		}
		found = found || n > 0
	}
	return found, nil
}

func (s *RedisStore) stats(zone int) zoneStats {
	return zoneStats{overLimitCache: !s.DisableOverLimitCache, client: s.client, unavailable: !s.client.Up()}
}

// oneTag reports whether all of d's keys share one hash tag, so one
// cluster slot.
func oneTag(d *demands) bool {
	var first bucketKey
	switch {
	case len(d.buckets) > 0:
		first = d.buckets[0].key
	case len(d.counters) > 0:
		first = d.counters[0].key
	case len(d.slots) > 0:
		first = d.slots[0].key
	}
	for i := range d.buckets {
		if d.buckets[i].key != first {
			return false
		}
	}
	for i := range d.counters {
		if d.counters[i].key != first {
			return false
		}
	}
	for i := range d.slots {
		if d.slots[i].key != first {
			return false
		}
	}
	return true
}

// release gives back the slots that take took, in one call where their
// keys share a cluster slot. A slot whose release fails comes back when
// its lease ends.
func (s *RedisStore) release(ctx context.Context, slots []slotDemand) error {
	if !s.client.Up() {
		return rediswire.ErrDown // the leases will end
	}
	held := 0
	for i := range slots {
		if slots[i].held {
			held++
		}
	}
	if held == 0 {
		return nil
	}
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if held == len(slots) && (!s.client.Cluster || oneTag(&demands{slots: slots})) {
		return s.releaseCall(ctx, deadline, slots)
	}
	var errs []error
	for i := range slots {
		if slots[i].held {
			if err := s.releaseCall(ctx, deadline, slots[i:i+1]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// releaseCall gives back the slots in one call.
func (s *RedisStore) releaseCall(ctx context.Context, deadline time.Time, slots []slotDemand) error {
	c := rediswire.NewCall(rediswire.Release, deadline)
	for i := range slots {
		c.Slot(s.slotKey(slots[i].zone, slots[i].key), slots[i].claim, nil)
	}
	_, err := s.client.Run(ctx, c)
	return err
}

// run calls the script for d, and sets d's answers: the buckets' debts
// and bans, the counters' counts and the slots' held, free and full,
// after the call.
func (s *RedisStore) run(ctx context.Context, deadline time.Time, op rediswire.Op, d *demands) (bool, error) {
	c := rediswire.NewCall(op, deadline)
	if s.testClock != nil {
		c.Clock(s.testClock())
	}
	s.build(c, op, d)
	sent := time.Now()
	r, err := s.client.Run(ctx, c)
	return s.answered(r, err, sent, op, d)
}

// runAll decides each of ds by op, in order, in one flight of its own:
// the keys of each share a cluster slot (see oneTag).
func (s *RedisStore) runAll(op rediswire.Op, ds []*demands) ([]bool, []error) {
	deadline := time.Now().Add(s.callTimeout)
	calls := make([]*rediswire.Call, len(ds))
	for i, d := range ds {
		calls[i] = rediswire.NewCall(op, deadline)
		if s.testClock != nil {
			calls[i].Clock(s.testClock())
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

// answered sets d's answers from r, the reply of its call of op sent at
// sent, or returns err.
func (s *RedisStore) answered(r rediswire.Reply, err error, sent time.Time, op rediswire.Op, d *demands) (bool, error) {
	if err != nil {
		return false, err
	}
	d.at = s.client.DecidedAt(r, sent)
	if n := r.Repaired(); n > 0 && op != rediswire.Peek {
		s.repairs.Warn(s.logger, "redis store: keys under key_prefix held another type: overwritten",
			fmt.Errorf("%d in a call of zone %s", n, s.zones[callZone(d)].name))
	}
	read(r, op, d)
	return r.Allowed(), nil
}

// build adds d's demands to the call.
func (s *RedisStore) build(c *rediswire.Call, op rediswire.Op, d *demands) {
	for i := range d.buckets {
		// The script applies the key's own limit itself: it is sent the
		// limit that an override replaces, and the cost in its tokens.
		b := &d.buckets[i]
		var hash, field, limit string
		if s.mayOverride(b.zone) {
			hash, field, limit = s.keys.BucketLimit(s.zones[b.zone].field, b.key.String())
		} else {
			hash, field = s.keys.Bucket(s.zones[b.zone].field, b.key.String())
			limit = hash // the script reads no override
		}
		if op == rediswire.Adjust {
			c.AdjustBucket(hash, field, limit, s.shapeOf(b, true), b.baseCost())
		} else {
			c.Bucket(hash, field, limit, s.shapeOf(b, false), !b.limit.noDelay)
		}
	}
	for i := range d.counters {
		k := &d.counters[i]
		rz := &s.zones[k.zone]
		counter, untagged := s.counterKeys(k.zone, k.key)
		if op == rediswire.Adjust {
			c.AdjustCounter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.window), k.cost)
		} else {
			c.Counter(counter, untagged, s.counterShape(rz, k), s.windowOf(rz, k.window))
		}
	}
	for i := range d.slots {
		q := &d.slots[i]
		c.Slot(s.slotKey(q.zone, q.key), q.claim, s.slotShape(&s.zones[q.zone], q))
	}
}

// callZone is the zone of a call's first demand.
func callZone(d *demands) int {
	switch {
	case len(d.buckets) > 0:
		return d.buckets[0].zone
	case len(d.counters) > 0:
		return d.counters[0].zone
	}
	return d.slots[0].zone
}

// read sets d's answers from the reply of its call.
func read(r rediswire.Reply, op rediswire.Op, d *demands) {
	allowed := r.Allowed()
	others := true // every bucket and counter had what the request takes
	for i := range d.buckets {
		b := &d.buckets[i]
		b.debt, b.ban = r.Bucket(i)
		if token, burst := r.Override(i); token > 0 {
			b.setOwnLimit(token, burst)
		} else {
			b.clearOwnLimit()
		}
		b.ok = allowed || b.wait() == 0
		others = others && b.ok
	}
	for j := range d.counters {
		c := &d.counters[j]
		used, left := r.Counter(j)
		c.used, c.left = used, 0
		if used > 0 {
			c.left = left
		}
		c.ok = allowed || used+c.cost <= c.limit
		others = others && c.ok
	}
	for j := range d.slots {
		q := &d.slots[j]
		q.held, q.free = r.Slot(j)
		q.full = op == rediswire.Take && !q.held && others && q.free == 0
	}
}

// shapeOf is the script's shape of b's bucket: its zone's last one when
// the limit is the same, else one from the store's cache. An adjustment
// takes any shape of its bucket's limit: its cost travels on its own.
func (s *RedisStore) shapeOf(b *bucketDemand, adjust bool) *rediswire.Shape {
	rz := &s.zones[b.zone]
	l, cost := b.limit, b.cost
	if b.overridden {
		l, cost = b.base(), b.baseCost()
	}
	if last := rz.shape.Load(); last != nil && last.Full == l.burstTime && (adjust || last.Cost == cost) && last.Token == l.tokenTime &&
		last.Ban == l.ban && last.Beyond == l.delay+l.owe && last.Reserve == l.delay && last.Scaled == rz.plans {
		return last
	}
	if adjust {
		cost = l.tokenTime
	}
	shape := s.shapes.get(shapeKey{l.burstTime, l.tokenTime, cost, l.ban, l.delay + l.owe, l.delay, rz.plans})
	if !adjust {
		rz.shape.Store(shape)
	}
	return shape
}

// counterShape is the script's shape of k's counter.
func (s *RedisStore) counterShape(rz *redisZone, k *counterDemand) *rediswire.CounterShape {
	cost := max(k.cost, -k.cost)
	if last := rz.counter.Load(); last != nil && last.Limit == k.limit && last.Cost == cost {
		return last
	}
	shape := rediswire.NewCounterShape(k.limit, cost)
	rz.counter.Store(shape)
	return shape
}

// slotShape is the script's shape of q's slots.
func (s *RedisStore) slotShape(rz *redisZone, q *slotDemand) *rediswire.SlotShape {
	if last := rz.slots.Load(); last != nil && last.Limit == q.limit && last.Lease == q.lease && last.Soft == q.soft {
		return last
	}
	shape := rediswire.NewSlotShape(q.limit, q.lease, q.soft)
	rz.slots.Store(shape)
	return shape
}

// windowOf is the script's view of the quota window w, made once per
// window.
func (s *RedisStore) windowOf(rz *redisZone, w *quotaWindow) *rediswire.Window {
	if last := rz.window.Load(); last != nil && last.w == w {
		return last.args
	}
	args := rediswire.NewWindow(w.prev, w.start, w.end, w.next)
	rz.window.Store(&window{w, args})
	return args
}

// bucketField is how the fields of the buckets of a zone of shape l start
// (the zero limit for a zone whose limit comes with each request).
func bucketField(name string, l limit) string {
	return rediswire.BucketField(name, strconv.FormatInt(int64(l.tokenTime), 10)+"/"+strconv.FormatInt(l.burst, 10))
}

// bucketName is the hash and the field of the bucket of key in a zone.
func (s *RedisStore) bucketName(zone int, key bucketKey) (hash, field string) {
	return s.keys.Bucket(s.zones[zone].field, key.String())
}

// counterKeys are the key of the quota counter of key in a zone, and the
// key that builds before rediswire.CounterZone gave it.
func (s *RedisStore) counterKeys(zone int, key bucketKey) (counter, untagged string) {
	k := key.String()
	return s.keys.Counter(s.zones[zone].counters, k), s.keys.Counter(s.zones[zone].keys, k)
}

// slotKey is the key of the sorted set of the slots of key in a zone.
func (s *RedisStore) slotKey(zone int, key bucketKey) string {
	return s.keys.Slots(s.zones[zone].keys, key.String())
}

// A shapeCache keeps the shapes of the limits that requests bring
// (plans), each made once: at most maxShapes of them, beyond which a
// shape is made per call.
type shapeCache struct {
	m  atomic.Pointer[map[shapeKey]*rediswire.Shape]
	mu sync.Mutex
}

type shapeKey struct {
	full, token, cost, ban, beyond, reserve time.Duration
	scaled                                  bool
}

const maxShapes = 4096

func (c *shapeCache) get(k shapeKey) *rediswire.Shape {
	if m := c.m.Load(); m != nil {
		if s := (*m)[k]; s != nil {
			return s
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var m map[shapeKey]*rediswire.Shape
	if p := c.m.Load(); p != nil {
		m = *p
	}
	if s := m[k]; s != nil {
		return s
	}
	s := rediswire.NewShape(k.full, k.token, k.cost, k.ban, k.beyond, k.reserve, k.scaled)
	if len(m) < maxShapes {
		next := make(map[shapeKey]*rediswire.Shape, len(m)+1)
		maps.Copy(next, m)
		next[k] = s
		c.m.Store(&next)
	}
	return s
}

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	store redis {
//		address   <host:port>...
//		url       <redis[s]://...>
//		username  <user>
//		password  <password>
//		db        <n>
//		sentinel  <master_name>
//		cluster
//		tls [insecure_skip_verify] [ca <file>]
//		key_prefix <prefix>
//		hash_keys
//		timeout   <duration>
//		pool_size <n>
//		fail_mode local|open|closed
//		disable_over_limit_cache
//	}
func (s *RedisStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume store name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("store redis: %s already specified", sub)
		}
		seen[sub] = true
		var err error
		switch sub {
		case "address":
			if s.Addresses = d.RemainingArgs(); len(s.Addresses) == 0 {
				return d.ArgErr()
			}
		case "url":
			if !d.AllArgs(&s.URL) {
				return d.ArgErr()
			}
		case "username":
			if !d.AllArgs(&s.Username) {
				return d.ArgErr()
			}
		case "password":
			if !d.AllArgs(&s.Password) {
				return d.ArgErr()
			}
		case "db":
			if s.DB, err = intArg[int](d); err != nil {
				return err
			}
			err = checkDB(s.DB)
		case "pool_size":
			if s.PoolSize, err = intArg[int](d); err != nil {
				return err
			}
			err = checkPoolSize(s.PoolSize)
		case "sentinel":
			if !d.AllArgs(&s.Sentinel) {
				return d.ArgErr()
			}
		case "cluster":
			if err := flag(d, &s.Cluster); err != nil {
				return err
			}
		case "hash_keys":
			if err := flag(d, &s.HashKeys); err != nil {
				return err
			}
		case "disable_over_limit_cache":
			if err := flag(d, &s.DisableOverLimitCache); err != nil {
				return err
			}
		case "tls":
			if err := s.unmarshalTLS(d); err != nil {
				return err
			}
		case "key_prefix":
			if !d.AllArgs(&s.KeyPrefix) {
				return d.ArgErr()
			}
		case "timeout":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			t, perr := caddy.ParseDuration(v)
			if perr != nil {
				return d.Errf("invalid timeout '%s': expected a duration such as 100ms", v)
			}
			s.Timeout, err = caddy.Duration(t), checkTimeout(t)
		case "fail_mode":
			if !d.AllArgs(&s.FailMode) {
				return d.ArgErr()
			}
			err = checkFailMode(s.FailMode)
		default:
			return d.Errf("unrecognized store redis subdirective '%s'", sub)
		}
		if err != nil {
			return d.WrapErr(err)
		}
	}
	if err := s.Validate(); err != nil {
		return d.Errf("store redis: %v", err)
	}
	return nil
}

// unmarshalTLS reads `tls [insecure_skip_verify] [ca <file>]`.
func (s *RedisStore) unmarshalTLS(d *caddyfile.Dispenser) error {
	s.TLS = new(RedisTLS)
	for d.NextArg() {
		switch d.Val() {
		case "insecure_skip_verify":
			s.TLS.InsecureSkipVerify = true
		case "ca":
			if !d.NextArg() {
				return d.Err("tls ca needs a file")
			}
			s.TLS.CA = d.Val()
		default:
			return d.Errf("unrecognized tls option '%s': expected insecure_skip_verify or ca <file>", d.Val())
		}
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddy.Validator       = (*RedisStore)(nil)
	_ caddy.CleanerUpper    = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
	_ store                 = (*RedisStore)(nil)
	_ fallible              = (*RedisStore)(nil)
)
