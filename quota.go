// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
	"github.com/caddy-tokenbucket/ratelimit/internal/store"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// A calendar quota is the one limit that is not a token bucket: a counter
// per key and calendar window (a day, an ISO week or a month in the
// zone's time zone), which a request adds its cost to when every zone
// that applies allows it, and which starts again from 0 when the window
// ends. Each store keeps it beside its buckets and decides it in the same
// all-or-nothing take; a request carries the window its instance's clock
// sees, and the store's own clock picks the window (see
// lua/decide/50_counters.lua).
//
// In a request, a quota's debt is how long until its window ends (its
// counter is 0 again), 0 while nothing is counted: the same meaning as a
// bucket's, the time until it is full again.

// quotaConfig is a zone's calendar quota.
type quotaConfig struct {
	// A calendar quota: at most this many units (a request counts its
	// `cost`) per key in each window of quota_period, counted only for
	// requests that every zone allows, and refused with a Retry-After of
	// the time left until the window ends. With a rate, both apply; a
	// zone may also have a quota alone. At most 999999999999999; not with
	// ban, concurrency, window or a cost with placeholders. Default: no
	// quota.
	Quota int64 `json:"quota,omitempty"`

	// The quota's calendar window: `day`, `week` (ISO weeks, from Monday)
	// or `month`, starting at midnight in `timezone`. Required with quota.
	QuotaPeriod string `json:"quota_period,omitempty"`

	// The IANA time zone whose midnights start the quota's windows, such
	// as `Europe/Paris` (daylight saving time included: such a day lasts
	// 23 or 25 hours). Needs quota. Default: `UTC`.
	Timezone string `json:"timezone,omitempty"`
}

// quotaZoneInfo is a zone's quota in the admin API, quotaKeyView a
// key's.
type (
	quotaZoneInfo struct {
		Quota    int64  `json:"quota,omitempty"`
		Per      string `json:"quota_period,omitempty"`
		Timezone string `json:"timezone,omitempty"`
	}
	quotaKeyView struct {
		Quota *quotaInfo `json:"quota,omitempty"`
	}
	quotaInfo struct {
		Limit int64 `json:"limit"`
		Used  int64 `json:"used"`
		Left  int64 `json:"left"`
		// Seconds until the window ends and the count starts again from
		// 0; 0 when nothing is counted.
		ResetIn float64 `json:"reset_in"`
	}
)

var quotaKind = kind{
	in: func(z *Zone) bool { return z.Quota != 0 },
	subdirectives: map[string]func(*caddyfile.Dispenser, *Zone) error{
		"quota": func(d *caddyfile.Dispenser, z *Zone) error {
			// quota <n> per <day|week|month>
			var n, per, p string
			if !d.AllArgs(&n, &per, &p) || per != "per" {
				return d.Err("quota needs a number and a period: quota <n> per day|week|month")
			}
			var err error
			if z.Quota, err = strconv.ParseInt(n, 10, 64); err != nil {
				return d.Errf("invalid quota '%s': expected a whole number", n)
			}
			z.QuotaPeriod = p
			return wrapErr(d, cmp.Or(checkQuota(z.Quota), checkQuotaPeriod(p)))
		},
		"timezone": func(d *caddyfile.Dispenser, z *Zone) error {
			if !d.AllArgs(&z.Timezone) {
				return d.ArgErr()
			}
			_, err := loadTimezone(z.Timezone)
			return wrapErr(d, err)
		},
	},
	check: func(z *Zone) error {
		_, err := z.quotaLimit()
		return err
	},
	provision: func(z *Zone) (err error) {
		z.quota, err = z.quotaLimit()
		return err
	},
	describe: func(z *Zone) string {
		if z.Quota == 0 {
			return ""
		}
		q := "quota " + strconv.FormatInt(z.Quota, 10) + " per " + z.QuotaPeriod
		if z.Timezone != "" {
			q += " in " + z.Timezone
		}
		return q
	},
	info: func(z *Zone, _ store.ZoneStats, info *zoneInfo) {
		if z.quota != nil {
			info.Quota, info.Per, info.Timezone = z.quota.limit, z.QuotaPeriod, z.quota.Loc.String()
		}
	},
	demand: func(z *Zone, k store.Key, d *store.Demands) {
		if z.quota != nil {
			d.Counters = append(d.Counters, store.CounterDemand{Zone: z.index, Key: k, Limit: z.quota.limit, Cost: z.Cost, Window: z.quota.Window(time.Now())})
		}
	},
	view: func(_ context.Context, _ *Handler, _ *Zone, _ store.Key, d *store.Demands, v *keyView) error {
		if len(d.Counters) > 0 {
			c := &d.Counters[0]
			v.Quota = &quotaInfo{Limit: c.Limit, Used: c.Used, Left: c.Remaining(), ResetIn: c.Left.Seconds()}
		}
		return nil
	},
}

func checkQuota(n int64) error {
	if n < 1 || n > maxBurst {
		return fmt.Errorf("invalid quota %d: must be 1 to %d", n, int64(maxBurst))
	}
	return nil
}

func checkQuotaPeriod(s string) error {
	if _, ok := calendar.Periods[s]; !ok {
		return fmt.Errorf("invalid quota period '%s': expected day, week or month", s)
	}
	return nil
}

func loadTimezone(s string) (*time.Location, error) {
	if s == "" {
		return time.UTC, nil
	}
	loc, err := time.LoadLocation(s)
	if err != nil {
		return nil, fmt.Errorf("unknown timezone '%s': expected an IANA time zone such as Europe/Paris", s)
	}
	return loc, nil
}

// A quota is a zone's calendar quota, ready to use.
type quota struct {
	limit int64 // units per window
	calendar.Windows
}

// quotaLimit parses the zone's quota fields; nil when it has none.
func (z *Zone) quotaLimit() (*quota, error) {
	if z.Quota == 0 {
		switch {
		case z.QuotaPeriod != "":
			return nil, errors.New("quota_period needs a quota")
		case z.Timezone != "":
			return nil, errors.New("timezone needs a quota: it says when the quota's windows start")
		}
		return nil, nil
	}
	if err := checkQuota(z.Quota); err != nil {
		return nil, err
	}
	if z.QuotaPeriod == "" {
		return nil, errors.New("quota needs a period: quota_period day, week or month")
	}
	if err := checkQuotaPeriod(z.QuotaPeriod); err != nil {
		return nil, err
	}
	loc, err := loadTimezone(z.Timezone)
	if err != nil {
		return nil, err
	}
	switch {
	case z.windowForm():
		return nil, errors.New("quota does not combine with window and max_events: write the zone's limit as rate and burst")
	case z.costVar.template != "":
		return nil, errors.New("a cost with placeholders does not combine with quota: a quota counts a fixed cost per request")
	case z.Cost > z.Quota:
		return nil, fmt.Errorf("cost %d exceeds quota %d: no request could ever pass", z.Cost, z.Quota)
	}
	return &quota{limit: z.Quota, Windows: calendar.Windows{Period: calendar.Periods[z.QuotaPeriod], Loc: loc}}, nil
}

// quotaID names a quota's counters in the local store: a quota keeps them
// while its period and time zone stay (its limit may change).
func (z *Zone) quotaID() string {
	tz := z.Timezone
	if tz == "" {
		tz = "UTC"
	}
	return z.QuotaPeriod + "@" + tz
}
