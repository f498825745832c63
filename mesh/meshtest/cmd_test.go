package meshtest_test

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/service"
)

func TestRunMainCapturesStderrAndCode(t *testing.T) {
	before := os.Stderr
	code, stderr := meshtest.RunMain(t, func(args []string) int {
		fmt.Fprintf(os.Stderr, "fake: %s\n", strings.Join(args, ","))
		return 3
	}, "--a", "b")
	if code != 3 || stderr != "fake: --a,b\n" {
		t.Fatalf("RunMain = %d, %q; want 3 and the arguments written to stderr", code, stderr)
	}
	if os.Stderr != before {
		t.Fatal("os.Stderr was not restored")
	}
	if code, stderr := meshtest.RunMain(t, func([]string) int { return 0 }); code != 0 || stderr != "" {
		t.Fatalf("RunMain of a silent run = %d, %q", code, stderr)
	}
}

func TestRunFlagCasesPassesArgsAndEnv(t *testing.T) {
	const key = "MESHTEST_FLAG_CASE"
	var calls atomic.Int32
	run := func(args []string) int {
		calls.Add(1)
		fmt.Fprintf(os.Stderr, "fake: args=%s env=%s\n", strings.Join(args, ","), os.Getenv(key))
		return 2
	}
	meshtest.RunFlagCases(t, "fake", run, []meshtest.FlagCase{
		{Name: "args", Args: []string{"--x", "y"}, Want: "args=--insecure,--x,y env=\n"},
		{Name: "env", Env: map[string]string{key: "v"}, Want: "args=--insecure env=v\n"},
		{Name: "bare", Args: []string{"--x"}, Bare: true, Want: "args=--x env=\n"},
	})
	if n := calls.Load(); n != 3 {
		t.Fatalf("run called %d times, want once per case", n)
	}
	if v, ok := os.LookupEnv(key); ok {
		t.Fatalf("%s=%q outlived its case", key, v)
	}
}

// svcRun is a service command's run reduced to the common flags: it parses and validates
// them as the service mains do, and returns 0 instead of serving.
func svcRun(args []string) int {
	fs := flag.NewFlagSet("svc", flag.ContinueOnError)
	var o service.Options
	o.Register(fs, "svc", "127.0.0.1:0", "")
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "svc:", err)
		return 2
	}
	if err := o.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "svc:", err)
		return 2
	}
	return 0
}

func TestCommonFlagCasesMatchServiceOptions(t *testing.T) {
	// Without the cases' flags the command line (--insecure, as RunFlagCases adds it) is
	// valid: each case is refused for what it adds.
	if code, stderr := meshtest.RunMain(t, svcRun, "--insecure"); code != 0 {
		t.Fatalf("svcRun() = %d (stderr %q), want 0", code, stderr)
	}
	cases := meshtest.CommonFlagCases()
	if len(cases) == 0 {
		t.Fatal("no common flag cases")
	}
	meshtest.RunFlagCases(t, "svc", svcRun, cases)
}
