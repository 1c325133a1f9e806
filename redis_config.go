// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/rediswire"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// RedisTLS configures TLS connections to Redis.
type RedisTLS struct {
	// Accept any server certificate. Only for testing. Default: false.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`

	// A PEM file of the CA certificates to trust instead of the system's.
	// Default: the system's roots.
	CA string `json:"ca,omitempty"`
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

func checkDB(n int) error { return checkRange("db", n, 0, math.MaxInt32) }

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
	if _, ok := store.FailModes[s]; !ok {
		return fmt.Errorf("invalid fail_mode '%s': expected local, open or closed", s)
	}
	return nil
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
			t, perr := durationArg(d, "100ms")
			if perr != nil {
				return perr
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
