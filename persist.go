// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/memstore"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// The local store's tables are persisted in Caddy's storage: this
// instance's folder in it, and the hash key kept there (the snapshots'
// format, their writing and loading are the in-memory engine's).

// minPersistInterval keeps storages from being written in a loop.
const minPersistInterval = 100 * time.Millisecond

// openSnapshots finds the storage and the hash key of this instance,
// creating the key on the first start. It returns nil, and logs why,
// when the buckets cannot be persisted: they then start full and live
// in memory only.
func openSnapshots(ctx caddy.Context, interval time.Duration) *memstore.Snapshots {
	logger := ctx.Logger()
	storage := storageOf(ctx)
	if storage == nil {
		return nil
	}
	id, err := caddy.InstanceID()
	if err != nil {
		logger.Error("no instance ID: buckets are not persisted", zap.Error(err))
		return nil
	}
	dir := "rate_limit/" + id.String()
	key, cached, err := hashKeys.Get(storage, dir+"/hash_key")
	if err != nil {
		if !cached {
			logger.Error("cannot read or create the hash key in storage: buckets start full and are not persisted",
				zap.String("storage_key", dir+"/hash_key"), zap.Error(err))
		}
		return nil
	}
	return &memstore.Snapshots{Storage: storage, Dir: dir, Key: key, Interval: interval, Logger: logger, Exiting: caddy.Exiting}
}

// storageOf is the config's storage; nil for a Context made without a
// config (caddy.NewContext, in tests and programs that embed Caddy),
// whose Storage panics.
func storageOf(ctx caddy.Context) (s certmagic.Storage) {
	defer func() { _ = recover() }()
	return ctx.Storage()
}

// hashKeys remembers the hash key of the last storage it was asked for,
// or the error: every local store of a config (one per site, say) gets
// the same storage, which is then asked once per config load, and a
// storage that hangs delays a load by hashKeyTimeout once.
var hashKeys memstore.HashKeyCache
