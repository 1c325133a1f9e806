// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redisstore"
	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
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
	engine   *redisstore.Store
	logger   *zap.Logger
	// callTimeout is Timeout, or its default.
	callTimeout time.Duration
}

const (
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
	if s.engine == nil { // never bound, or New failed
		return s.giveBack()
	}
	return s.engine.Drop()
}

// giveBack gives the client back to the pool.
func (s *RedisStore) giveBack() error {
	_, err := redisClients.Delete(s.poolKey)
	return err
}

// bind makes the store's engine for zones. The engine holds the client
// until its last user lets go of it: this config, at its Cleanup, or a
// request of it still running then. Without an engine (New failed, or
// bind never ran), Cleanup gives the client back itself.
func (s *RedisStore) bind(zones []store.ZoneSpec) (store.Store, error) {
	e, err := redisstore.New(s.client, zones, redisstore.Options{
		FailMode: s.FailMode, DisableOverLimitCache: s.DisableOverLimitCache, KeyPrefix: s.KeyPrefix, HashKeys: s.HashKeys,
		CallTimeout: s.callTimeout, Setup: s.poolKey, SyncPool: syncPooled{}, GiveBack: s.giveBack, Logger: s.logger,
	})
	if err != nil {
		return nil, err
	}
	s.engine = e
	return e, nil
}

// Interface guards
var (
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddy.Validator       = (*RedisStore)(nil)
	_ caddy.CleanerUpper    = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
	_ storeModule           = (*RedisStore)(nil)
)
