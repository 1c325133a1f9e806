// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package ratelimit

import (
	"strings"
	"testing"
)

func TestLocalStoreValidate(t *testing.T) {
	for _, tc := range []struct {
		maxKeys int64
		wantErr string
	}{
		{maxKeys: 0},
		{maxKeys: 1},
		{maxKeys: -1, wantErr: "invalid max_keys -1: must be at least 1"},
	} {
		err := (&LocalStore{MaxKeys: tc.maxKeys}).Validate()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("max_keys %d: unexpected error: %v", tc.maxKeys, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("max_keys %d: error %v, want one containing %q", tc.maxKeys, err, tc.wantErr)
		}
	}
}
