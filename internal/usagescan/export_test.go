// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package usagescan

// The bounds, for the black-box tests.
const (
	MaxBody  = maxBody
	MaxEvent = maxEvent
)
