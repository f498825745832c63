package breaker_test

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/breaker"
)

func TestDefaults(t *testing.T) {
	d := breaker.Config{}.WithDefaults()
	want := breaker.Config{ConsecutiveFailures: 5, FailureRatio: 0.5, MinRequests: 20, Window: 10 * time.Second,
		OpenTimeout: 5 * time.Second, Jitter: 0.2}
	if d != want {
		t.Errorf("defaults = %+v, want %+v", d, want)
	}
	if d.WithDefaults() != d {
		t.Error("WithDefaults is not idempotent")
	}
	set := breaker.Config{ConsecutiveFailures: 2, FailureRatio: 0.9, MinRequests: 3, Window: time.Second,
		OpenTimeout: time.Second, Jitter: -1, Off: true}
	if set.WithDefaults() != set {
		t.Errorf("WithDefaults changed set fields: %+v", set.WithDefaults())
	}
	if err := (breaker.Config{}).Validate(); err != nil {
		t.Errorf("zero config invalid: %v", err)
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name  string
		cfg   breaker.Config
		field string
		want  string
	}{
		{"ratio above 1", breaker.Config{FailureRatio: 1.5}, "FailureRatio", "must be in (0, 1]"},
		{"negative ratio", breaker.Config{FailureRatio: -0.1}, "FailureRatio", "must be in (0, 1]"},
		{"NaN ratio", breaker.Config{FailureRatio: math.NaN()}, "FailureRatio", "must be in (0, 1]"},
		{"negative window", breaker.Config{Window: -time.Second}, "Window", "at least 10ms"},
		{"tiny window", breaker.Config{Window: time.Millisecond}, "Window", "at least 10ms"},
		{"negative open timeout", breaker.Config{OpenTimeout: -time.Second}, "OpenTimeout", "at least 1ms"},
		{"jitter 1", breaker.Config{Jitter: 1}, "Jitter", "below 1"},
		{"NaN jitter", breaker.Config{Jitter: math.NaN()}, "Jitter", "below 1"},
		{"jitter leaves nothing", breaker.Config{OpenTimeout: 2 * time.Millisecond, Jitter: 0.9}, "Jitter", "shorter than 1ms"},
	}
	for _, tc := range cases {
		err := tc.cfg.Validate()
		var ce *breaker.ConfigError
		if !errors.As(err, &ce) {
			t.Errorf("%s: Validate = %v, want a *ConfigError", tc.name, err)
			continue
		}
		if ce.Field != tc.field || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate = %v (field %s), want field %s and %q", tc.name, err, ce.Field, tc.field, tc.want)
		}
	}
	for _, ok := range []breaker.Config{
		{FailureRatio: 1}, {Jitter: -1}, {Jitter: 0.99}, {Window: 10 * time.Millisecond}, {OpenTimeout: time.Millisecond, Jitter: -1},
		{ConsecutiveFailures: math.MaxUint32, MinRequests: 1},
	} {
		if err := ok.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v, want nil", ok, err)
		}
	}
}

func TestNewSetPanicsOnInvalidConfig(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "FailureRatio") {
			t.Errorf("recovered %v, want a panic naming FailureRatio", r)
		}
	}()
	breaker.NewSet(breaker.Config{FailureRatio: 2}, nil)
}
