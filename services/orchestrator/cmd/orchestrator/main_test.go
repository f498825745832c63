package main

import (
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// runCaptured runs the command's run with args and returns its exit code and stderr. Only
// invalid configurations are tested: a valid one would start serving.
func runCaptured(t *testing.T, args ...string) (int, string) {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "stderr")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	old := os.Stderr
	os.Stderr = f
	done := make(chan int, 1)
	go func() { done <- run(args) }()
	var code int
	select {
	case code = <-done:
	case <-time.After(5 * time.Second):
		os.Stderr = old
		t.Fatalf("run(%q) did not return: the configuration was accepted", args)
	}
	os.Stderr = old
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return code, string(b)
}

func TestRunRejectsBadConfiguration(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"unknown flag", []string{"--bogus"}, nil, "flag provided but not defined"},
		{"extra argument", []string{"serve"}, nil, "unexpected arguments: serve"},
		{"bad duration", []string{"--default-deadline=soon"}, nil, "invalid value"},
		{"default beyond max", []string{"--default-deadline=1h", "--max-deadline=1m"}, nil, "exceeds --max-deadline"},
		{"bad log level", []string{"--log-level=loud"}, nil, "--log-level"},
		{"zero grace", []string{"--shutdown-grace=0s"}, nil, "--shutdown-grace"},
		{"bad env value", nil, map[string]string{"CURFEW_MAX_DEADLINE": "forever"}, "CURFEW_MAX_DEADLINE"},
		{"zero max runs", []string{"--max-runs=0"}, nil, "--max-runs must be at least 1"},
		{"negative run time from env", nil, map[string]string{"CURFEW_MIN_RUN_TIME": "-1s"}, "--min-run-time"},
		{"bad max runs from env", nil, map[string]string{"CURFEW_MAX_RUNS": "lots"}, "CURFEW_MAX_RUNS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			code, stderr := runCaptured(t, tc.args...)
			if code != 2 {
				t.Fatalf("exit code %d, want 2 (stderr: %s)", code, stderr)
			}
			if !strings.Contains(stderr, tc.want) {
				t.Fatalf("stderr %q does not mention %q", stderr, tc.want)
			}
			if !strings.Contains(stderr, "orchestrator:") {
				t.Fatalf("stderr %q does not name the command", stderr)
			}
		})
	}
}
