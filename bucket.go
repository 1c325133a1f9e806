// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/gcra"
	"github.com/caddyserver/caddy/v2"
)

// A zone's bucket: its rate, burst and cost, and its kinds' parts (a ban,
// a delay, a debt), made into the limit the stores decide by (a
// gcra.Limit). The bucket math itself is internal/gcra's.

// parseLimit checks the zone's numbers and returns its bucket's shape.
func (z *Zone) parseLimit() (gcra.Limit, error) {
	if err := z.checkKinds(); err != nil {
		return gcra.Limit{}, err
	}
	if !z.hasRate() {
		if l, done, err := z.ratelessLimit(); done || err != nil {
			return l, err
		}
	}
	if z.perRequest() {
		// The limit is known per request (plans.go): its bucket table
		// and the stores' fixed arguments have no shape of their own.
		if err := cmp.Or(z.checkVars(), z.checkPrefixes()); err != nil {
			return gcra.Limit{}, err
		}
		var l gcra.Limit
		for _, k := range kinds {
			if k.fixedShape != nil {
				k.fixedShape(z, &l)
			}
		}
		return l, nil
	}
	var perSec float64
	var burst int64
	var err error
	if z.windowForm() {
		perSec, burst, err = z.windowLimit()
	} else {
		perSec, burst, err = z.rateLimit()
	}
	if err != nil {
		return gcra.Limit{}, err
	}
	l, err := checkLimit(z.rateString(), perSec, burst, cmp.Or(z.Cost, 1))
	if err == nil {
		err = z.checkPrefixes()
	}
	if err == nil {
		err = z.shapeKinds(&l)
	}
	if err != nil {
		return gcra.Limit{}, err
	}
	return l, nil
}

// shapeKinds sets every kind's part of l, a bucket's shape.
func (z *Zone) shapeKinds(l *gcra.Limit) error {
	for _, k := range kinds {
		if k.shape == nil {
			continue
		}
		if err := k.shape(z, l); err != nil {
			return err
		}
	}
	return nil
}

// placeholderLimit is the bucket shape of a zone without a rate, which
// the stores bind but are never asked about.
var placeholderLimit = gcra.NewLimit(1, 1)

// ratelessLimit checks a zone without a rate, which limits requests in
// flight or per calendar window. It reports done when such a zone is
// complete; a zone that is neither is checked as one with a rate, which
// says what it lacks.
func (z *Zone) ratelessLimit() (l gcra.Limit, done bool, err error) {
	inFlight := z.limitsInFlight()
	switch {
	case z.Quota != 0 && z.Burst != 0:
		return gcra.Limit{}, true, errors.New("burst needs a rate")
	case z.Quota != 0:
		return placeholderLimit, true, z.checkPrefixes()
	case (z.Burst != 0 || z.burstVar.template != "") && inFlight:
		return gcra.Limit{}, true, errors.New("burst needs a rate")
	case (z.Cost != 0 && z.Cost != 1 || z.costVar.template != "") && inFlight:
		return gcra.Limit{}, true, errors.New("cost needs a rate: a request in flight takes one slot")
	case inFlight:
		return placeholderLimit, true, z.checkPrefixes()
	}
	return gcra.Limit{}, false, nil
}

// rateLimit reads rate and burst: tokens per second and capacity.
func (z *Zone) rateLimit() (perSec float64, burst int64, err error) {
	if z.Rate == "" {
		return 0, 0, errors.New("rate is required (or window and max_events, concurrency or quota)")
	}
	perSec, n, err := parseRate(z.Rate)
	if err != nil {
		return 0, 0, err
	}
	burst = z.Burst
	if burst == 0 {
		if n > maxBurst {
			return 0, 0, fmt.Errorf("invalid rate '%s': %g is too large a default burst: set a burst of at most %d", z.Rate, n, int64(maxBurst))
		}
		burst = int64(math.Ceil(n))
	}
	return perSec, burst, nil
}

// rateString is the zone's rate as configured, for messages.
func (z *Zone) rateString() string {
	if z.windowForm() {
		return fmt.Sprintf("%d/%s", z.MaxEvents, time.Duration(z.Window))
	}
	return z.Rate
}

// maxBurst is the largest burst: the headers carry it (RateLimit-Policy's
// q), and a structured-field integer has at most 15 digits.
const maxBurst = 999_999_999_999_999

func checkBurst(n int64) error {
	if n > maxBurst {
		return fmt.Errorf("invalid burst %d: at most %d, the largest integer the RateLimit headers can carry", n, int64(maxBurst))
	}
	return checkMin("burst", n, 1)
}

// parseRate reads `<n>r/<unit>` or `<n>[r]/<duration>` and returns the
// rate in tokens per second and n.
func parseRate(s string) (perSec, n float64, err error) {
	perSec, n, err = parseRateNumbers(s)
	if err == nil && perSec > gcra.MaxRate {
		err = fmt.Errorf("at most %.0fr/s", gcra.MaxRate)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("invalid rate '%s': %w", s, err)
	}
	return perSec, n, nil
}

func parseRateNumbers(s string) (perSec, n float64, err error) {
	num, per, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, errors.New("expected <n>r/s, <n>r/m, <n>r/h or <n>/<duration> such as 100/10s")
	}
	num = strings.TrimSuffix(num, "r")
	n, err = strconv.ParseFloat(num, 64)
	if err != nil || math.IsInf(n, 0) || math.IsNaN(n) {
		return 0, 0, fmt.Errorf("'%s' is not a number", num)
	}
	if n <= 0 {
		return 0, 0, errors.New("must be positive")
	}
	switch per {
	case "s", "m", "h", "d":
		per = "1" + per
	}
	d, err := caddy.ParseDuration(per)
	if err != nil {
		if isNumberWithUnit(per) {
			return 0, 0, fmt.Errorf("interval '%s' is too long: at most about 290 years", per)
		}
		return 0, 0, fmt.Errorf("unknown unit '%s': expected s, m, h, d or a duration such as 10s", per)
	}
	if d <= 0 {
		return 0, 0, fmt.Errorf("interval '%s' must be positive", per)
	}
	return n / d.Seconds(), n, nil
}

// isNumberWithUnit reports whether s is a number and a duration unit,
// which caddy.ParseDuration refuses only when it overflows.
func isNumberWithUnit(s string) bool {
	for _, unit := range []string{"ns", "us", "µs", "ms", "s", "m", "h", "d"} {
		if num, ok := strings.CutSuffix(s, unit); ok {
			return num != "" && strings.Trim(num, "0123456789.") == ""
		}
	}
	return false
}

// checkLimit checks a bucket's numbers, and returns its shape.
func checkLimit(rate string, perSec float64, burst, cost int64) (gcra.Limit, error) {
	if err := cmp.Or(checkBurst(burst), checkMin("cost", cost, 1)); err != nil {
		return gcra.Limit{}, err
	}
	if cost > burst {
		return gcra.Limit{}, fmt.Errorf("cost %d exceeds burst %d: no request could ever pass", cost, burst)
	}
	if float64(burst)/perSec > gcra.MaxBurstTime.Seconds() {
		return gcra.Limit{}, fmt.Errorf("burst %d at rate %s takes more than 100 years to refill", burst, rate)
	}
	return gcra.NewLimit(perSec, burst), nil
}
