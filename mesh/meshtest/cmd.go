package meshtest

import (
	"os"
	"strings"
	"testing"
	"time"
)

// RunMain runs a command's run function (main's body: it takes the arguments after the
// program name and returns the exit code) with args while os.Stderr is redirected to a
// file, and returns the exit code and what was written to stderr. It fails the test if
// run has not returned within 5s, so it suits command lines that make run return, such
// as invalid configurations, not ones that start serving. It swaps the process-wide
// os.Stderr: tests that use it must not run in parallel with tests that write to it.
func RunMain(t testing.TB, run func(args []string) int, args ...string) (code int, stderr string) {
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

// FlagCase is a command line that a service command must refuse as a usage error.
type FlagCase struct {
	// Name names the case's subtest.
	Name string
	// Args are the command-line arguments.
	Args []string
	// Env holds environment variables set for the case (with t.Setenv).
	Env map[string]string
	// Want is text that stderr must contain.
	Want string
	// Bare runs the case without the --insecure that RunFlagCases otherwise puts first,
	// so that the service's required transport flag does not fail every other case.
	Bare bool
}

// CommonFlagCases returns the usage errors of the flags every service command shares:
// those service.Options registers and validates, and their CURFEW_* environment
// variables. A command's test appends its own cases and runs them with [RunFlagCases].
func CommonFlagCases() []FlagCase {
	return []FlagCase{
		{Name: "unknown flag", Args: []string{"--bogus"}, Want: "flag provided but not defined"},
		{Name: "extra argument", Args: []string{"serve"}, Want: "unexpected arguments: serve"},
		{Name: "bad duration", Args: []string{"--default-deadline=soon"}, Want: "invalid value"},
		{Name: "default beyond max", Args: []string{"--default-deadline=1h", "--max-deadline=1m"}, Want: "exceeds --max-deadline"},
		{Name: "bad log level", Args: []string{"--log-level=loud"}, Want: "--log-level"},
		{Name: "zero grace", Args: []string{"--shutdown-grace=0s"}, Want: "--shutdown-grace"},
		{Name: "negative drain delay", Args: []string{"--drain-delay=-1s"}, Want: "--drain-delay must not be negative"},
		{Name: "tiny connection age", Args: []string{"--max-connection-age=10ms"}, Want: "--max-connection-age"},
		{Name: "bad env value", Env: map[string]string{"CURFEW_MAX_DEADLINE": "forever"}, Want: "CURFEW_MAX_DEADLINE"},
		{Name: "neither tls nor insecure", Bare: true, Want: "mTLS is required: give --tls-dir"},
		{Name: "tls and insecure", Args: []string{"--tls-dir=/nonexistent", "--insecure"}, Want: "--tls-dir and --insecure are exclusive"},
		{Name: "tls and insecure from env", Args: []string{"--insecure"}, Env: map[string]string{"CURFEW_TLS_DIR": "/nonexistent"}, Want: "exclusive"},
		{Name: "tiny message limit", Args: []string{"--max-recv-msg-size=10"}, Want: "--max-recv-msg-size"},
	}
}

// RunFlagCases runs each case as a subtest of t: it sets the case's Env, runs run with
// --insecure (unless the case is Bare) and its Args through [RunMain], and fails unless
// run returns exit code 2 and stderr contains the case's Want and names the command
// ("name:").
func RunFlagCases(t *testing.T, name string, run func(args []string) int, cases []FlagCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.Name, func(t *testing.T) {
			for k, v := range tc.Env {
				t.Setenv(k, v)
			}
			args := tc.Args
			if !tc.Bare {
				args = append([]string{"--insecure"}, args...)
			}
			code, stderr := RunMain(t, run, args...)
			if code != 2 {
				t.Fatalf("exit code %d, want 2 (stderr: %s)", code, stderr)
			}
			if !strings.Contains(stderr, tc.Want) {
				t.Fatalf("stderr %q does not mention %q", stderr, tc.Want)
			}
			if !strings.Contains(stderr, name+":") {
				t.Fatalf("stderr %q does not name the command", stderr)
			}
		})
	}
}
