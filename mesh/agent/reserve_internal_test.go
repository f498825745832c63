package agent

import (
	"testing"
	"time"
)

// The time-left note rounds down to coarse ranges, so it changes rarely and never
// promises more time than there is.
func TestBucket(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "under 1s"},
		{999 * time.Millisecond, "under 1s"},
		{time.Second, "1s to 2s"},
		{4999 * time.Millisecond, "2s to 5s"},
		{45 * time.Second, "30s to 1m0s"},
		{59*time.Minute + 59*time.Second, "30m0s to 1h0m0s"},
		{2 * time.Hour, "over 1h0m0s"},
	} {
		if got := bucket(tc.d); got != tc.want {
			t.Errorf("bucket(%v) = %q, want %q", tc.d, got, tc.want)
		}
	}
}
