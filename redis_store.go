// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(RedisStore{})
	redis.SetLogger(goRedisLog)
}

// goRedisLog takes go-redis's own log lines (a failed dial, a pool
// problem), which it would write to stderr outside Caddy's logs, to the
// last provisioned Redis store's logger, at DEBUG and at most one a
// second: during an outage they come once per connection attempt.
var goRedisLog = new(redisLogger)

type redisLogger struct {
	logger atomic.Pointer[zap.Logger]
	lines  throttle
}

func (l *redisLogger) Printf(_ context.Context, format string, v ...any) {
	logger := l.logger.Load()
	if logger == nil {
		logger = caddy.Log()
	}
	c := logger.Check(zapcore.DebugLevel, "go-redis")
	if c == nil {
		return
	}
	if _, ok := l.lines.allow(time.Second); ok {
		c.Write(zap.String("message", fmt.Sprintf(format, v...)))
	}
}

//go:embed lua/token_bucket.lua
var tokenBucketLua string

// tokenBucketScript runs with EVALSHA and falls back to EVAL on NOSCRIPT
// (see (*redis.Script).Run), so a flushed script cache heals itself.
var tokenBucketScript = redis.NewScript(tokenBucketLua)

// RedisStore keeps buckets in Redis, so that any number of Caddy instances
// share one exact limit per key. Each decision is one atomic script call
// that uses Redis's clock.
//
// Buckets live many to a Redis hash: the bucket of a key in a zone is the
// field `<zone>:<key>` of the hash `<key_prefix>{<group>}`, where the
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

	// A `redis://` or `rediss://` URL, instead of the addresses, username,
	// password, db and tls fields.
	URL string `json:"url,omitempty"`

	// Credentials. `{env.REDIS_PASSWORD}` is expanded at load.
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`

	// The database number (standalone and sentinel only).
	DB int `json:"db,omitempty"`

	// The master name: the addresses are Redis Sentinels.
	Sentinel string `json:"sentinel,omitempty"`

	// Use the cluster protocol even with a single seed address.
	Cluster bool `json:"cluster,omitempty"`

	// Connect with TLS.
	TLS *RedisTLS `json:"tls,omitempty"`

	// Prefix of every key this store writes. Default: `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Hash bucket keys (SHA-256, 128 bits) instead of writing them as they
	// are, so client IPs or API keys are not stored in Redis. Keys longer
	// than 128 bytes are always hashed. Note that hashed IPv4 addresses
	// can still be found by trying them all.
	HashKeys bool `json:"hash_keys,omitempty"`

	// The longest a decision may wait for Redis. Default: `100ms`.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// Connections per Redis node. Default: 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// What to do when Redis fails or does not answer in time: `local`
	// decides with this instance's own in-memory buckets, `open` allows
	// the request, `closed` answers 503 Service Unavailable. Default:
	// `local`.
	FailMode string `json:"fail_mode,omitempty"`

	// Ask Redis about every request. By default, once Redis has found a
	// bucket empty this instance denies the bucket's requests by itself
	// until tokens can have come back, which is exact (tokens only arrive
	// at the zone's rate) and spares Redis most of a flood; but a bucket
	// reset through another instance's admin API is seen here only when
	// the cached entry runs out; so are the tokens given back on another
	// instance by a client that left while waiting out a zone's delay.
	// Set this where these must take effect everywhere at once.
	DisableOverLimitCache bool `json:"disable_over_limit_cache,omitempty"`

	client      *redisClient
	poolKey     string
	released    bool          // Cleanup gave the client back
	callTimeout time.Duration // Timeout, or its default
	zones       []*Zone
	fields      []string  // per zone: the start of its buckets' fields, the name and ":"
	shapes      [][5]any  // per zone: the script's burst, cost, ban and delay times (and the delay negated, for noDelay), in µs, formatted and boxed once (burst and cost from the request's plan where the limit depends on the request)
	slotShapes  [][3]any  // per zone with concurrency: the script's limit, lease (µs) and dry-run flag
	leaseIDs    string    // what this store's lease IDs start with: unique among instances
	quotaArgs   [][2]any  // per zone: the script's quota limit and cost, formatted and boxed once
	cache       []*table  // per zone: over-limit cache; nil when disabled
	quotaCache  []*table  // per zone: the quota counts Redis last gave (see fromCache); nil without a quota
	flights     *flights  // calls in flight for the buckets in cache
	keyErrors   *throttle // errors that Redis answered for one call's keys
	repairs     *throttle // keys of another type that the script overwrote
	logger      *zap.Logger

	// testClock, when set, replaces Redis's clock, so that tests can
	// replay a table of instants. Never set outside tests.
	testClock func() time.Time
}

// RedisTLS configures TLS connections to Redis.
type RedisTLS struct {
	// Accept any server certificate. Only for testing.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`

	// A PEM file of the CA certificates to trust instead of the system's.
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
	hashKeysLongerThan  = 128
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

// redisClient is a pooled client with the health of its Redis.
type redisClient struct {
	redis.UniversalClient
	cluster bool
	pipe    *pipeline
	breaker breaker
	// Each outage is logged when it starts and when it ends, at most one
	// start every outageLogPeriod, so that a Redis that half works (the
	// breaker opening and closing again) does not flood the log.
	outageLogs throttle
	outageSaid atomic.Bool  // its start was logged, its end not yet
	rtt        atomic.Int64 // a moving average of the calls' round trips, in nanoseconds
}

// noteRTT adds a call's round trip to the moving average.
func (c *redisClient) noteRTT(d time.Duration) {
	old := c.rtt.Load()
	c.rtt.Store(old + (int64(d)-old)/8)
}

const outageLogPeriod = 10 * time.Second

// logOutage logs that Redis went away, unless an outage was logged less
// than outageLogPeriod ago; a probe that fails tries again.
func (c *redisClient) logOutage(logger *zap.Logger, failMode string, err error) {
	if c.outageSaid.Load() {
		return
	}
	if _, ok := c.outageLogs.allow(outageLogPeriod); ok && c.outageSaid.CompareAndSwap(false, true) {
		logger.Error("redis store unavailable: deciding by fail_mode until it answers again",
			zap.String("fail_mode", failMode), zap.Error(err))
	}
}

// logRecovery logs that Redis answers again, if its going was logged.
func (c *redisClient) logRecovery(logger *zap.Logger) {
	if c.outageSaid.CompareAndSwap(true, false) {
		logger.Info("redis store available again")
	}
}

// Destruct closes the client when no config uses it any more.
func (c *redisClient) Destruct() error { return c.Close() }

// makeRedisClient makes a client. go-redis panics on some options it
// refuses; the pool entry being made must not be left locked by a panic,
// so that becomes an error.
func makeRedisClient(opts *redis.UniversalOptions) (c *redisClient, err error) {
	defer func() {
		if r := recover(); r != nil {
			c, err = nil, fmt.Errorf("redis client: %v", r)
		}
	}()
	uc := redis.NewUniversalClient(opts)
	_, cluster := uc.(*redis.ClusterClient)
	poolSize := cmp.Or(opts.PoolSize, 10*runtime.GOMAXPROCS(0)) // go-redis's default
	pipe := &pipeline{client: uc, maxFlights: maxFlights(poolSize)}
	return &redisClient{UniversalClient: uc, cluster: cluster, pipe: pipe}, nil
}

// Provision expands placeholders, sets defaults and gets the client.
// It does no network I/O: Caddy starts while Redis is down.
func (s *RedisStore) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	goRedisLog.logger.Store(s.logger)
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
		return makeRedisClient(opts)
	})
	if err != nil {
		return err
	}
	s.poolKey = string(key)
	s.client = v.(*redisClient)
	return nil
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
	_, err := redisClients.Delete(s.poolKey)
	return err
}

func (s *RedisStore) bind(zones []*Zone) error {
	s.zones = zones
	s.flights = &flights{m: make(map[flightKey]flight)}
	s.keyErrors, s.repairs = new(throttle), new(throttle)
	var id [9]byte
	_, _ = rand.Read(id[:])
	s.leaseIDs = base64.RawURLEncoding.EncodeToString(id[:]) + ":"
	for _, z := range zones {
		// A `:` in a zone name would make its fields another zone's.
		s.fields = append(s.fields, escapeTag(z.Name, "%:")+":")
		s.shapes = append(s.shapes, [5]any{micros(z.limit.burstTime), micros(z.costTime), micros(z.limit.ban),
			micros(z.limit.delay), micros(-z.limit.delay)})
		dry := "0"
		if z.inDryRun {
			dry = "1"
		}
		s.slotShapes = append(s.slotShapes, [3]any{strconv.FormatInt(z.Concurrency, 10), micros(time.Duration(z.Lease)), dry})
		var qa [2]any
		if z.quota != nil {
			qa = [2]any{strconv.FormatInt(z.quota.limit, 10), strconv.FormatInt(z.Cost, 10)}
		}
		s.quotaArgs = append(s.quotaArgs, qa)
		if !s.DisableOverLimitCache {
			s.cache = append(s.cache, newTable(overLimitCacheKeys, time.Now()))
			var qt *table
			if z.quota != nil {
				qt = newTable(overLimitCacheKeys, time.Now())
			}
			s.quotaCache = append(s.quotaCache, qt)
		}
	}
	return nil
}

func (s *RedisStore) failMode() failMode { return failModes[s.FailMode] }

// known is what the over-limit cache knows of q's bucket. When the
// request gave up waiting for the calls in flight for its bucket
// (errNoAnswer), those calls may yet take their tokens: they count too.
func (s *RedisStore) known(now time.Time, q *request, err error) time.Duration {
	if s.cache == nil || q.win != nil {
		return 0
	}
	t, p := s.cache[q.zone.index], q.plan()
	debt := p.limit.debt(t.get(q.key), t.instant(now))
	if errors.Is(err, errNoAnswer) {
		debt += time.Duration(s.flights.calls(flightKey{q.zone.index, t.hash(q.key)})) * p.costTime
	}
	return debt
}

// errRedisDown is returned while the circuit breaker is open.
var errRedisDown = errors.New("redis is unavailable")

func (s *RedisStore) take(ctx context.Context, now time.Time, reqs []request) (bool, error) {
	return s.takeWithSlots(ctx, now, reqs, nil)
}

// takeWithSlots decides the buckets of reqs and the slots together, in
// one call where their keys share a slot. Each slot taken is a lease
// (see lua/token_bucket.lua): a member of a sorted set whose score is the
// instant, on Redis's clock, when it ends. A lease is not renewed: a
// request that runs longer than its zone's lease loses its slot then, so
// that a slot held by an instance that died comes back after the lease
// however it died, with no timers or writes for the requests in flight.
func (s *RedisStore) takeWithSlots(ctx context.Context, now time.Time, reqs []request, slots []slot) (bool, error) {
	if len(slots) > 0 {
		id := s.leaseIDs + strconv.FormatUint(leaseSeq.Add(1), 36)
		for i := range slots {
			slots[i].lease, slots[i].full, slots[i].free = id, false, 0
		}
		allowed, err := s.takeAll(ctx, now, reqs, slots)
		for i := range slots {
			if err != nil || slots[i].free < 0 {
				slots[i].lease, slots[i].free = "", 0
			}
		}
		return allowed, err
	}
	return s.takeAll(ctx, now, reqs, nil)
}

func (s *RedisStore) takeAll(ctx context.Context, now time.Time, reqs []request, slots []slot) (bool, error) {
	// One timeout for the whole decision: a request that waits for the
	// calls in flight for its buckets has that much less for its own.
	budget := s.callTimeout
	var flight flightKey
	cached := s.cache != nil && len(reqs) > 0
	if cached {
		arrived := now
		var denied bool
		var err error
		if now, flight, denied, err = s.fromCache(ctx, now, reqs); denied || err != nil {
			for i := range slots {
				slots[i].free = -1 // not asked
			}
			return false, err
		}
		defer s.flights.land(flight)
		budget -= now.Sub(arrived)
	}
	waited := budget < s.callTimeout
	b := &s.client.breaker
	ok, probe := b.allow(now)
	if !ok {
		return false, errRedisDown
	}
	// The pipeline times the call; a request that waited for others'
	// calls brings a timer of its own (see (*pipeline).run).
	deadline := time.Now().Add(budget)
	call := ctx
	if waited {
		var cancel context.CancelFunc
		call, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	sent := deadline.Add(-budget)
	allowed, err := s.decide(call, deadline, reqs, slots)
	late := !time.Now().Before(deadline)
	if err == nil {
		s.client.noteRTT(time.Since(sent))
	}
	switch kind := classify(err); {
	case err == nil || kind == errAnswered:
		if b.success(probe) {
			s.client.logRecovery(s.logger)
		}
		if err != nil {
			s.keyErrors.warn(s.logger, "redis refused one decision: fail_mode decides that request", err)
			return false, err
		}
	case ctx.Err() != nil || kind == errUnknown || waited && late:
		// The client went away, a reload closed this config's
		// connections, the pool had no connection free, or a call that
		// had only what was left of the timeout ran out of it: nothing
		// is known of Redis.
		b.done(probe)
		return false, err
	default:
		if b.outage(time.Now(), probe) || probe {
			s.client.logOutage(s.logger, s.FailMode, err)
		}
		return false, err
	}
	if cached {
		s.remember(now, reqs, flight)
	}
	return allowed, nil
}

// The kinds of error a call to Redis can end with.
const (
	errOutage   = iota // Redis is unreachable, slow, or cannot serve
	errAnswered        // Redis answered, with an error about this call's keys
	errUnknown         // the call never reached Redis: the client was closed, or its pool full
)

// outageReplies are the error replies that say Redis cannot serve at all:
// loading, failing over, read-only after a failover, out of memory, or
// refusing this client's credentials. Any other error reply belongs to
// the keys of one call (a wrong type, a slot error) and says that Redis
// is up.
var outageReplies = []string{
	"LOADING", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS",
	"OOM", "NOAUTH", "WRONGPASS", "NOPERM", "MISCONF",
}

// classify says what kind of failure err is.
func classify(err error) int {
	if errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return errUnknown
	}
	if errors.Is(err, errBadReply) {
		return errAnswered
	}
	if reply, ok := errors.AsType[redis.Error](err); ok {
		for _, prefix := range outageReplies {
			if redis.HasErrorPrefix(reply, prefix) {
				return errOutage
			}
		}
		return errAnswered
	}
	return errOutage // dial errors, timeouts, resets, pool timeouts
}

// decide asks Redis. Zones whose keys share a hash tag go in one atomic
// call. On a cluster, keys in different slots are taken one at a time, and
// when one denies, the buckets already charged get their tokens back, and
// the slots already taken are given back.
func (s *RedisStore) decide(ctx context.Context, deadline time.Time, reqs []request, slots []slot) (bool, error) {
	if !s.client.cluster || oneTag(reqs, slots) {
		return s.run(ctx, deadline, "take", reqs, slots)
	}
	if ok, err := s.decideEach(ctx, deadline, reqs); !ok || err != nil {
		for i := range slots {
			slots[i].free = -1 // not asked
		}
		return ok, err
	}
	for i := range slots {
		ok, err := s.run(ctx, deadline, "take", nil, slots[i:i+1])
		if err == nil && ok {
			continue
		}
		if i > 0 {
			if rerr := s.release(ctx, deadline, slots[:i]); rerr != nil {
				err = errors.Join(err, fmt.Errorf("release: %w", rerr))
			}
		}
		for j := range i {
			slots[j].lease, slots[j].free = "", slots[j].free+1
		}
		for j := i + 1; j < len(slots); j++ {
			slots[j].free = -1 // not asked
		}
		if len(reqs) > 0 {
			if rerr := s.refund(ctx, time.Now(), reqs); rerr != nil {
				err = errors.Join(err, fmt.Errorf("refund: %w", rerr))
			}
		}
		return false, err
	}
	return true, nil
}

// decideEach takes the buckets of reqs one call each, giving back what
// the earlier ones took when one denies.
func (s *RedisStore) decideEach(ctx context.Context, deadline time.Time, reqs []request) (bool, error) {
	for i := range reqs {
		ok, err := s.run(ctx, deadline, "take", reqs[i:i+1], nil)
		if err == nil && ok {
			continue
		}
		// Denied, or failed: give back what the earlier zones took, each
		// in its own call, as their keys live in different slots.
		for j := range i {
			if _, rerr := s.run(ctx, deadline, "refund", reqs[j:j+1], nil); rerr != nil {
				err = errors.Join(err, fmt.Errorf("refund: %w", rerr))
			}
		}
		for j := i + 1; j < len(reqs); j++ {
			reqs[j].ok, reqs[j].debt = true, 0 // not asked
		}
		return false, err
	}
	return true, nil
}

// refund gives the requests' tokens back, in one call where their keys
// share a slot, and makes this instance's over-limit cache forget them
// (other instances' caches only deny a zone with count while its key is
// banned, which a refund never changes).
func (s *RedisStore) refund(ctx context.Context, _ time.Time, reqs []request) error {
	for i := range reqs {
		if s.cache != nil {
			s.cacheOf(&reqs[i]).forget(reqs[i].key)
		}
	}
	if s.client.breaker.openUntil.Load() != 0 {
		return errRedisDown // refunds never probe: decisions do
	}
	// The client may have gone: the tokens come back all the same.
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()
	if !s.client.cluster || oneTag(reqs, nil) {
		_, err := s.run(ctx, deadline, "refund", reqs, nil)
		return err
	}
	var errs []error
	for i := range reqs {
		if _, err := s.run(ctx, deadline, "refund", reqs[i:i+1], nil); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (s *RedisStore) peek(ctx context.Context, _ time.Time, q *request) error {
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	reqs := []request{*q}
	if _, err := s.run(ctx, deadline, "peek", reqs, nil); err != nil {
		return err
	}
	q.debt, q.used = reqs[0].debt, reqs[0].used
	return nil
}

// reset deletes the bucket, and what this instance's over-limit
// cache knew of it. Other instances' caches learn it when their entry
// runs out; until then they may still deny that key.
func (s *RedisStore) reset(ctx context.Context, q *request) (bool, error) {
	if s.cache != nil {
		s.cacheOf(q).forget(q.key)
	}
	ctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	var n int64
	var err error
	if q.win != nil {
		n, err = s.client.Del(ctx, s.quotaKey(q)).Result()
	} else {
		hash, field := splitBucket(s.redisKey(q))
		n, err = s.client.HDel(ctx, hash, field).Result()
	}
	return n > 0, err
}

// cacheOf is the over-limit cache table of q's bucket or quota.
func (s *RedisStore) cacheOf(q *request) *table {
	if q.win != nil {
		return s.quotaCache[q.zone.index]
	}
	return s.cache[q.zone.index]
}

// oneTag reports whether all requests and slots share one hash tag, so
// one cluster slot.
func oneTag(reqs []request, slots []slot) bool {
	var first bucketKey
	switch {
	case len(reqs) > 0:
		first = reqs[0].key
	case len(slots) > 0:
		first = slots[0].key
	}
	for i := range reqs {
		if reqs[i].key != first {
			return false
		}
	}
	for i := range slots {
		if slots[i].key != first {
			return false
		}
	}
	return true
}

// releaseSlots gives back the slots that takeWithSlots took, in one call
// where their keys share a cluster slot. A slot whose release fails comes
// back when its lease ends.
func (s *RedisStore) releaseSlots(ctx context.Context, slots []slot) error {
	if s.client.breaker.openUntil.Load() != 0 {
		return errRedisDown // the leases will end
	}
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	return s.release(ctx, deadline, slots)
}

func (s *RedisStore) release(ctx context.Context, deadline time.Time, slots []slot) error {
	held := 0
	for i := range slots {
		if slots[i].lease != "" {
			held++
		}
	}
	if held == 0 {
		return nil
	}
	if held == len(slots) && (!s.client.cluster || oneTag(nil, slots)) {
		_, err := s.run(ctx, deadline, "release", nil, slots)
		return err
	}
	var errs []error
	for i := range slots {
		if slots[i].lease == "" {
			continue
		}
		if _, err := s.run(ctx, deadline, "release", nil, slots[i:i+1]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// slotsInUse asks Redis how many leases of q's key have not ended.
func (s *RedisStore) slotsInUse(ctx context.Context, q *slot) (int64, error) {
	deadline := time.Now().Add(s.callTimeout)
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	slots := []slot{*q}
	if _, err := s.run(ctx, deadline, "peek", nil, slots); err != nil {
		return 0, err
	}
	return q.zone.Concurrency - slots[0].free, nil
}

// run calls the script for reqs and slots, and sets the requests' ok
// and debt (and a quota's count), and the slots' free, full and lease.
// The buckets' keys go first, then the quotas', then the slots'.
func (s *RedisStore) run(ctx context.Context, deadline time.Time, mode string, reqs []request, slots []slot) (bool, error) {
	nq := 0
	for i := range reqs {
		if reqs[i].win != nil {
			nq++
		}
	}
	nb := len(reqs) - nq
	c := newScriptCall()
	c.deadline = deadline
	keys, args := c.keys, append(c.args, mode, "")
	if s.testClock != nil {
		args[1] = s.testClock().UnixMicro()
	}
	// A take of buckets alone, none with a ban or a delay, may be decided
	// in one call with identical ones (see (*scriptCall).twin).
	alike := mode == "take" && nq == 0 && len(slots) == 0
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			continue
		}
		alike = alike && q.zone.limit.ban == 0 && q.zone.limit.delay == 0
		keys = append(keys, s.redisKey(q))
		shape := &s.shapes[q.zone.index]
		full, cost := shape[0], shape[1]
		if q.pl != nil {
			full, cost = q.pl.fullMicros, q.pl.costMicros
		}
		delay := shape[3]
		if q.noDelay && q.zone.limit.delay > 0 {
			delay = shape[4]
		}
		args = append(args, full, cost, shape[2], delay)
	}
	if nq > 0 {
		for i := range reqs {
			if q := &reqs[i]; q.win != nil {
				keys = append(keys, s.quotaKey(q))
				qa := &s.quotaArgs[q.zone.index]
				args = append(args, qa[0], qa[1], q.win.bounds[0], q.win.bounds[1], q.win.bounds[2], q.win.bounds[3])
			}
		}
	}
	args = append(args, nq) // the quota section's length: always sent
	if len(slots) == 0 {
		args = append(args, noSlots)
	} else {
		for i := range slots {
			keys = append(keys, s.slotKey(&slots[i]))
			shape := &s.slotShapes[slots[i].zone.index]
			args = append(args, shape[0], shape[1], shape[2])
		}
		args = append(args, slots[0].lease, len(slots))
	}
	c.keys, c.args, c.alike = keys, args, alike
	v, err := s.client.pipe.run(ctx, c)
	if err != nil {
		return false, err
	}
	var sv []any
	if len(slots) > 0 {
		var ok bool
		if sv, ok = v[len(v)-1].([]any); !ok || len(sv) != len(slots)+1 {
			return false, fmt.Errorf("%w: %v for %d slot keys", errBadReply, v[len(v)-1], len(slots))
		}
		v = v[:len(v)-1]
	}
	var bans string
	switch extra := len(v) - nb - 1; {
	case nq > 0 && extra != 2+2*nq, nq == 0 && (extra < 0 || extra > 2):
		return false, fmt.Errorf("%w: %d replies for %d keys", errBadReply, len(v)-1, len(reqs))
	case extra > 0:
		if n, _ := v[nb+1].(int64); n > 0 {
			s.repairs.warn(s.logger, "redis store: keys under key_prefix held another type: overwritten",
				fmt.Errorf("%d in zone %s", n, reqs[0].zone.Name))
		}
		if extra >= 2 {
			bans, _ = v[nb+2].(string)
		}
	}
	allowed, _ := v[0].(int64)
	b, j := 0, 0 // the bucket's and the quota's place in the reply
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			used, ok1 := v[nb+3+2*j].(int64)
			ms, ok2 := v[nb+4+2*j].(int64)
			if !ok1 || !ok2 {
				return false, fmt.Errorf("%w: %v %v", errBadReply, v[nb+3+2*j], v[nb+4+2*j])
			}
			j++
			q.used, q.debt = used, 0
			if used > 0 {
				q.debt = time.Duration(ms) * time.Millisecond
			}
			q.ok = allowed == 1 || used+q.zone.Cost <= q.zone.quota.limit
			q.ban = false
			continue
		}
		ns, ok := v[b+1].(int64)
		if !ok {
			return false, fmt.Errorf("%w: %v", errBadReply, v[b+1])
		}
		q.debt = time.Duration(ns)
		q.ok = allowed == 1 || q.wait() == 0
		q.ban = b < len(bans) && bans[b] == '1'
		b++
	}
	if len(slots) > 0 {
		if err := s.readSlots(mode, reqs, sv, slots); err != nil {
			return false, err
		}
	}
	return allowed == 1, nil
}

// leaseSeq numbers the leases this process takes.
var leaseSeq atomic.Uint64

// noSlots is the script's slot count for a call without slots.
var noSlots any = "0"

// readSlots reads the slot section of a reply: which slots the call took,
// and how many are free. A slot is full when the buckets allowed the
// request and the slot had none free.
func (s *RedisStore) readSlots(mode string, reqs []request, sv []any, slots []slot) error {
	held, _ := sv[0].(string)
	if len(held) != len(slots) {
		return fmt.Errorf("%w: slot flags %q for %d slot keys", errBadReply, held, len(slots))
	}
	if mode == "release" {
		return nil // the caller knows what it gave back
	}
	buckets := true // every bucket and quota had what the request takes
	for i := range reqs {
		buckets = buckets && reqs[i].ok
	}
	for i := range slots {
		free, ok := sv[i+1].(int64)
		if !ok {
			return fmt.Errorf("%w: %v", errBadReply, sv[i+1])
		}
		q := &slots[i]
		q.free = free
		if held[i] != '1' {
			q.lease = ""
			q.full = mode == "take" && buckets && free == 0
		}
	}
	return nil
}

// micros converts a duration to the script's microseconds, formatted
// as go-redis would format the float, once rather than per call.
func micros(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/1000, 'f', -1, 64)
}

// errBadReply is a script reply this store cannot read: Redis answered,
// so it says nothing of Redis's health.
var errBadReply = errors.New("redis script: bad reply")

// redisKey names q's bucket for the script: `<key_prefix>{<group>}`, the
// hash, then `<zone>:<key>`, the field, the key hashed if so asked. The
// key never chooses its slot: the hash tag is the group, four hex digits
// of a fixed hash of the key, whatever the key's bytes.
func (s *RedisStore) redisKey(q *request) string {
	return s.key(q.zone, q.key, "")
}

// slotKey is the key of the sorted set of a zone's slots,
// `<key_prefix>{<group>}<zone>:<key>:s`: the bucket's hash tag, and a
// name that no hash of buckets has (they end with the tag).
func (s *RedisStore) slotKey(q *slot) string {
	return s.key(q.zone, q.key, ":s")
}

func (s *RedisStore) key(z *Zone, key bucketKey, end string) string {
	k := key.String()
	if s.HashKeys || len(k) > hashKeysLongerThan {
		sum := sha256.Sum256([]byte(k))
		k = hex.EncodeToString(sum[:16])
	}
	g := bucketGroup(k)
	const digits = "0123456789abcdef"
	tag := [4]byte{digits[g>>12], digits[g>>8&15], digits[g>>4&15], digits[g&15]}
	return s.KeyPrefix + "{" + string(tag[:]) + "}" + s.fields[z.index] + k + end
}

// bucketGroups is how many hashes the buckets are spread over. Redis
// keeps a hash of up to 512 short fields as one compact list
// (hash-max-listpack-entries), so buckets cost least from 100k to a few
// million of them: 50 B each at 100k, 31 B at 1M and 3M (Redis 7.0);
// under 10k, about what a key of their own would.
const bucketGroups = 1 << 14

// bucketGroup is the group of a key's buckets: the 32-bit FNV-1a hash of
// the key, folded. Buckets written by one version must be found by the
// next: this never changes.
func bucketGroup(k string) uint16 {
	h := uint32(2166136261)
	for i := 0; i < len(k); i++ {
		h ^= uint32(k[i])
		h *= 16777619
	}
	return uint16(h>>16^h) & (bucketGroups - 1)
}

// splitBucket splits what redisKey names into the hash and the field.
func splitBucket(name string) (hash, field string) {
	i := strings.IndexByte(name, '}')
	return name[:i+1], name[i+1:]
}

// quotaKey is the key of a calendar quota's counter: its bucket key
// (which a zone with a quota alone never uses) with `:quota` after the
// hash tag, so that it is in the slot of the request's other keys.
func (s *RedisStore) quotaKey(q *request) string {
	return s.redisKey(q) + ":quota"
}

// escapeTag percent-escapes the bytes of chars (which hold '%') in s, so
// that the escaped strings of distinct s differ. The empty string, which
// would make an empty hash tag (and so no tag at all), becomes "%", which
// no other string escapes to.
func escapeTag(s, chars string) string {
	if s == "" {
		return "%"
	}
	if !strings.ContainsAny(s, chars) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; strings.IndexByte(chars, c) >= 0 {
			fmt.Fprintf(&b, "%%%02X", c)
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

// fromCache denies the request without asking Redis when one of its
// buckets is known to lack the tokens. When Redis last answered for a
// bucket at local instant t with debt d, the bucket cannot be fuller than
// a bucket full at t+d: tokens only come back at the zone's rate, and
// other instances only take them. With a delay, the bound is the same
// and the take's condition moves by the delay, as in Redis. (One give-back
// escapes it: a client that leaves while its request waits out a delay
// on another instance gets its tokens back there, which this cache
// learns when its entry runs out, as it learns of an admin reset.)
//
// The same bound says how many requests a bucket could let through now
// (its whole burst when the cache knows nothing of it), and no more calls
// than that go to Redis for the bucket at once: requests beyond it wait
// for an answer and look again. An attacker's concurrency then does not
// multiply the calls to Redis, for a fresh bucket or for one whose
// cached instant has just passed. A request waits for the store's
// timeout at most, then fail_mode decides it.
//
// fromCache returns the instant to ask Redis at and the flight it joined
// (to land when the answer is in); or that the request is denied; or why
// no answer came in time.
func (s *RedisStore) fromCache(ctx context.Context, now time.Time, reqs []request) (time.Time, flightKey, bool, error) {
	deadline := now.Add(s.callTimeout)
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	rtt := time.Duration(s.client.rtt.Load())
	if s.testClock != nil {
		rtt = 0 // replayed instants leave no room to wait
	}
	for {
		tight, most := 0, int64(math.MaxInt64)
		var pace time.Duration
		for i := range reqs {
			q := &reqs[i]
			if q.win != nil {
				// A quota's counter only grows in its window (but for
				// refunds, and resets), so the count Redis last gave is
				// a bound too, for a while (see rememberCount).
				t := s.quotaCache[q.zone.index]
				n := t.instant(now)
				used, _ := t.count(q.key, n)
				q.used, q.debt = used, 0
				if used > 0 {
					q.debt = max(q.win.end.Sub(now), 0)
				}
				q.ok = used+q.zone.Cost <= q.zone.quota.limit
				continue
			}
			p := q.plan()
			t, l := s.cache[q.zone.index], q.limit()
			fullAt, n := t.get(q.key), t.instant(now)
			if fullAt-n > l.burstTime+l.ban+l.delay {
				// The bucket owes more than the request's limit holds:
				// its plan changed. Redis clamps it to the new burst
				// (which no bound from the old plan foresees): ask.
				fullAt = 0
			}
			_, q.ok = l.take(fullAt, n, p.costTime)
			q.debt = l.debt(fullAt, n)
			if m := int64((l.reach() - q.debt) / p.costTime); m < most {
				tight, most = i, m
			}
			// The bound counts from when the last call was sent, Redis
			// from when it ran, up to a round trip later: a call sent
			// within a round trip of the bound would mostly find the
			// bucket still short. Wait out that round trip instead.
			if fullAt != 0 {
				pace = max(pace, fullAt-l.reach()+p.costTime+rtt-n)
			}
		}
		if s.cacheDenied(reqs) {
			return now, flightKey{}, true, nil
		}
		if reqs[tight].win != nil {
			return now, noFlight, false, nil // quotas alone: no bucket to fly for
		}
		var landed <-chan struct{}
		var k flightKey
		if pace <= 0 || !now.Add(pace).Before(deadline) {
			q := &reqs[tight]
			k = flightKey{q.zone.index, s.cache[q.zone.index].hash(q.key)}
			if landed = s.flights.join(k, max(most, 1)); landed == nil {
				return now, k, false, nil
			}
		}
		if timer == nil {
			timer = time.NewTimer(deadline.Sub(now))
		}
		var paced <-chan time.Time
		if landed == nil {
			paced = time.After(pace)
		}
		waitStart := time.Now()
		select {
		case <-landed:
		case <-paced:
		case <-ctx.Done():
			return now, flightKey{}, false, ctx.Err()
		case <-timer.C:
			return now, flightKey{}, false, errNoAnswer
		}
		now = now.Add(time.Since(waitStart))
	}
}

// errNoAnswer is a request that waited out its timeout for the calls in
// flight for its buckets; they report Redis's health, this request not.
var errNoAnswer = errors.New("redis: no answer within timeout")

// cacheDenied counts the zones that the cache refused, and reports
// whether there was one. A zone with a ban whose bucket the cache finds
// short but not banned sends the request to Redis instead: the denial
// that starts a ban is Redis's to make, once for every instance. So does
// a zone with count: other instances' refunds give its tokens back faster
// than its rate, so only a ban (which refunds never shorten) is a bound
// the cache can deny by.
func (s *RedisStore) cacheDenied(reqs []request) bool {
	denied := false
	for i := range reqs {
		q := &reqs[i]
		if !q.ok && q.win != nil && q.zone.Count != nil {
			return false
		}
		if l := q.plan().limit; !q.ok && q.win == nil && (l.ban > 0 || q.zone.Count != nil) && !l.banned(q.debt) {
			return false
		}
		denied = denied || !q.ok
	}
	if denied {
		for i := range reqs {
			if !reqs[i].ok {
				reqs[i].zone.state.cacheHits.Add(1)
			}
		}
	}
	return denied
}

// remember notes, for fromCache, the buckets of a request that Redis
// left without the tokens for another such request; the request's other
// buckets are noted too, so that a denial from the cache still reports
// them in the headers. When Redis left them all with the tokens, the
// cache forgets them (it only ever denies, so forgetting is always safe),
// unless other requests wait for this answer in flight: then they learn
// from it how many of them may ask at once.
func (s *RedisStore) remember(now time.Time, reqs []request, flight flightKey) {
	short := false
	for i := range reqs {
		short = short || reqs[i].wait() > 0
	}
	forget := !short && !s.flights.waited(flight)
	for i := range reqs {
		q := &reqs[i]
		if q.win != nil {
			s.rememberCount(now, q)
			continue
		}
		t := s.cache[q.zone.index]
		if forget {
			t.forget(q.key)
			continue
		}
		n := t.instant(now)
		if l := q.plan().limit; q.zone.plans != nil && t.get(q.key)-n > l.burstTime+l.ban {
			t.forget(q.key) // learnt under another plan: Redis clamped it
		}
		t.raise(q.key, n+q.debt, n)
	}
}

// quotaCacheFor is how long this instance refuses an exhausted quota by
// itself, without asking Redis. A count only grows in its window, but a
// reset through another instance's admin API lowers it, and a window
// lasts up to a month: such a reset is seen here within this time.
const quotaCacheFor = 5 * time.Second

// rememberCount notes the count Redis gave for a quota, sent at now, for
// quotaCacheFor at most, and never past the window that ends debt after:
// no sooner than that, since Redis decided after now (and a millisecond
// sooner, as it counts in whole ones). A count of 0 is forgotten.
func (s *RedisStore) rememberCount(now time.Time, q *request) {
	t := s.quotaCache[q.zone.index]
	if q.used <= 0 || q.debt <= time.Millisecond {
		t.forget(q.key)
		return
	}
	h, n := t.hash(q.key), t.instant(now)
	sh := t.shard(h)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if b, ok := sh.buckets[h]; ok && b.fullAt > n && int64(b.usedAt) > q.used {
		return // a later answer came in first
	}
	sh.setCount(t, h, n+min(q.debt-time.Millisecond, quotaCacheFor), q.used, n)
}

// noFlight is the flight of a request with no bucket to fly for.
var noFlight = flightKey{zone: -1}

// flights are the Redis calls in flight for the buckets of the requests
// that the over-limit cache looks at.
type flights struct {
	mu sync.Mutex
	m  map[flightKey]flight
}

type flightKey struct {
	zone int
	hash uint64
}

// A flight is the calls in flight for one bucket.
type flight struct {
	calls  int64
	landed chan struct{} // closed when a call lands; nil until a request waits
}

// join makes the caller one of k's calls in flight, if fewer than most
// are, and returns nil: the caller lands k when its answer is in.
// Otherwise it returns a channel closed when one of them lands.
func (fs *flights) join(k flightKey, most int64) <-chan struct{} {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[k]
	if f.calls >= most {
		if f.landed == nil {
			f.landed = make(chan struct{})
			fs.m[k] = f
		}
		return f.landed
	}
	f.calls++
	fs.m[k] = f
	return nil
}

// calls is the number of k's calls in flight.
func (fs *flights) calls(k flightKey) int64 {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.m[k].calls
}

// waited reports whether a request waits for one of k's calls.
func (fs *flights) waited(k flightKey) bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.m[k].landed != nil
}

func (fs *flights) land(k flightKey) {
	if k == noFlight {
		return
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[k]
	if f.landed != nil {
		close(f.landed)
		f.landed = nil
	}
	if f.calls--; f.calls == 0 {
		delete(fs.m, k)
		return
	}
	fs.m[k] = f
}

// A throttle lets through at most one event per period, and counts the
// events it holds back.
type throttle struct {
	last atomic.Int64 // monotonic nanoseconds of the last event let through
	held atomic.Int64
}

// allow reports whether an event may pass now, and how many were held
// back since the last that did.
func (t *throttle) allow(period time.Duration) (int64, bool) {
	held := t.held.Add(1)
	now, last := int64(time.Since(processStart)), t.last.Load()
	if last != 0 && now-last < int64(period) || !t.last.CompareAndSwap(last, now) {
		return 0, false
	}
	t.held.Add(-held)
	return held - 1, true
}

// warn logs at WARN at most once a minute.
func (t *throttle) warn(logger *zap.Logger, msg string, err error) {
	if held, ok := t.allow(time.Minute); ok {
		logger.Warn(msg, zap.Error(err), zap.Int64("more_since_last", held))
	}
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
	_ slotKeeper            = (*RedisStore)(nil)
)
