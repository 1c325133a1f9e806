// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"time"

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
func openSnapshots(ctx caddy.Context, interval time.Duration) *snapshots {
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
	key, cached, err := hashKeys.get(storage, dir+"/hash_key")
	if err != nil {
		if !cached {
			logger.Error("cannot read or create the hash key in storage: buckets start full and are not persisted",
				zap.String("storage_key", dir+"/hash_key"), zap.Error(err))
		}
		return nil
	}
	return &snapshots{storage: storage, dir: dir, key: key, interval: interval, logger: logger, exiting: caddy.Exiting}
}

// storageOf is the config's storage; nil for a Context made without a
// config (caddy.NewContext, in tests and programs that embed Caddy),
// whose Storage panics.
func storageOf(ctx caddy.Context) (s certmagic.Storage) {
	defer func() { _ = recover() }()
	return ctx.Storage()
}
