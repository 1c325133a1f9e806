// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// Zones with ban refuse a key they denied for a while, however soon its
// bucket would have tokens again. A ban is the bucket's own debt: a
// banned bucket owes its whole bucket and the ban (see limit.startsBan),
// so every store keeps and shares it as it keeps the bucket, and the
// over-limit cache refuses it without asking Redis.

// banConfig is the ban of a zone.
type banConfig struct {
	// When the zone denies a key, refuse that key for this long, however
	// soon its bucket would have tokens again; then its bucket refills
	// from empty as usual. Only the denial that finds the key not banned
	// starts a ban: the denials during it do not make it longer. A
	// duration such as `15m`, at most 100 years. Needs a rate; not with
	// delay or quota. Default: no ban.
	Ban caddy.Duration `json:"ban,omitempty"`
}

// banInfo is a zone's ban in the admin API, and banKeyView a key's.
type (
	banInfo struct {
		Ban  string `json:"ban,omitempty"`
		Bans uint64 `json:"bans"` // denials that started one
	}
	banKeyView struct {
		// The key is banned, for BannedFor seconds more; not told for a
		// zone whose limit comes with each request, but for a key with
		// its own.
		Banned    bool    `json:"banned,omitempty"`
		BannedFor float64 `json:"banned_for,omitempty"`
	}
)

var banKind = kind{
	in: func(z *Zone) bool { return z.Ban != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"ban": durationSub("15m", func(z *Zone) *caddy.Duration { return &z.Ban }, checkBan),
	},
	check: func(z *Zone) error {
		switch {
		case z.Ban == 0:
			return nil
		case !z.hasRate():
			return errors.New("ban needs a rate: it empties the zone's bucket")
		}
		return checkBan(time.Duration(z.Ban))
	},
	shape: func(z *Zone, l *gcra.Limit) error {
		l.Ban = time.Duration(z.Ban)
		return nil
	},
	fixedShape: func(z *Zone, l *gcra.Limit) { l.Ban = time.Duration(z.Ban) },
	decided: func(st *zoneState, d *store.Demands, m *match) {
		if m.bucket >= 0 && d.Buckets[m.bucket].Ban {
			st.bans.Add(1)
		}
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if z.Ban != 0 {
			info.Ban = time.Duration(z.Ban).String()
		}
		info.Bans = z.state.bans.Load()
	},
	view: func(_ context.Context, _ *Handler, z *Zone, _ store.Key, d *store.Demands, v *keyView) error {
		if len(d.Buckets) > 0 && z.knownLimit(&d.Buckets[0]) {
			b := &d.Buckets[0]
			v.Banned, v.BannedFor = b.Limit.Banned(b.Debt), b.Limit.BanLeft(b.Debt).Seconds()
		}
		return nil
	},
	descs: []*prometheus.Desc{bansDesc},
	collect: func(_ chan<- prometheus.Metric, counter counterFunc, _ *prometheus.Desc, _ zoneID, s *zoneState) {
		counter(bansDesc, &s.bans)
	},
}

// banCounts are what bans count, in a zone's state.
type banCounts struct {
	bans atomic.Uint64 // denials that started a ban
}

var bansDesc = prometheus.NewDesc(prometheus.BuildFQName(metricsNamespace, metricsSubsystem, "bans_total"),
	"Denials that started a ban: each ban is counted once, whichever instance started it.",
	[]string{"zone", "limit"}, nil)

func checkBan(d time.Duration) error {
	if d <= 0 || d > gcra.MaxBurstTime {
		return fmt.Errorf("invalid ban %v: must be positive and at most 100 years", d)
	}
	return nil
}
