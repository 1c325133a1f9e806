// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package gcra

// MaxDuration is maxDuration, for the black-box tests.
const MaxDuration = maxDuration
