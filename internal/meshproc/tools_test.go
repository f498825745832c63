package meshproc_test

import (
	"testing"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// ending records how Missing ended a test, in place of ending it.
type ending struct {
	testing.TB
	failed, skipped string
}

func (e *ending) Helper()           {}
func (e *ending) Fatal(args ...any) { e.failed = args[0].(string) }
func (e *ending) Skip(args ...any)  { e.skipped = args[0].(string) }

// Missing skips locally and fails under CI=true, with the same message.
func TestMissingSkipsLocallyFailsInCI(t *testing.T) {
	for _, ci := range []string{"", "true"} {
		t.Setenv("CI", ci)
		e := &ending{TB: t}
		meshproc.Missing(e, "no %s", "tool")
		got, other := e.skipped, e.failed
		if ci == "true" {
			got, other = e.failed, e.skipped
		}
		if got != "no tool" || other != "" {
			t.Errorf("CI=%q: failed %q, skipped %q", ci, e.failed, e.skipped)
		}
	}
}

// Tool finds a tool on PATH when .tools/bin lacks it.
func TestToolOnPath(t *testing.T) {
	if got := meshproc.Tool(t, "go"); got == "" {
		t.Fatal("go not found on PATH")
	}
}
