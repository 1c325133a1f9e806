// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package calendar

// The periods, for the black-box tests.
const (
	Day   = day
	Week  = week
	Month = month
)
