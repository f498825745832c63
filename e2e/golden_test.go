package e2e

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// The golden tests pin what users and operators depend on and a refactoring must not
// change: every binary's flags and usage text (golden_flags_test.go), the CURFEW_*
// environment variables each binary reads (golden_env_test.go), the metric families and
// label names each service serves after a known run (golden_metrics_test.go), and the
// CLI's exit codes in the documented cases (golden_exit_test.go). The files are under
// testdata/golden/, one per binary and kind.
//
// A deliberate change (the CLI gains a flag, a service a metric) is recorded by
// re-running the tests with -update, which rewrites the files:
//
//	go test ./e2e/ -run Golden -count=1 -update
//
// then reviewing the diff of testdata/golden/ and committing it with the change, saying
// in the commit message why the surface changed. Without -update a mismatch fails the
// test with a line diff naming the file and what changed.
var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden/ instead of comparing with them")

// goldenDir is where the golden files live, relative to this package.
const goldenDir = "testdata/golden"

// golden compares got with the golden file name (relative to testdata/golden), or
// rewrites the file under -update. header is written above got as comment lines ("# ")
// and is part of the comparison, so a changed explanation shows too.
func golden(t *testing.T, name, header, got string) {
	t.Helper()
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimRight(header, "\n"), "\n") {
		b.WriteString(strings.TrimRight("# "+l, " ") + "\n")
	}
	b.WriteString(got)
	content := b.String()
	path := filepath.Join(goldenDir, filepath.FromSlash(name))
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%s: %v (run with -update to create it)", path, err)
	}
	if string(want) == content {
		return
	}
	t.Errorf("%s differs from what the binaries do now (- golden, + now):\n%s\n"+
		"If the change is deliberate, record it: go test ./e2e/ -run Golden -count=1 -update, and say why in the commit.",
		path, lineDiff(string(want), content))
}

// lineDiff returns the lines only in a ("- ") and only in b ("+ ") with a line of context
// around each change ("  "), from a longest common subsequence of the lines; "@ $ cmd"
// names the section of a flags file a change is in. The golden files
// are a few hundred lines at most, so the quadratic table is fine.
func lineDiff(a, b string) string {
	x := strings.Split(strings.TrimSuffix(a, "\n"), "\n")
	y := strings.Split(strings.TrimSuffix(b, "\n"), "\n")
	lcs := make([][]int, len(x)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(y)+1)
	}
	for i := len(x) - 1; i >= 0; i-- {
		for j := len(y) - 1; j >= 0; j-- {
			if x[i] == y[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	type line struct {
		op   byte // ' ', '-', '+'
		text string
	}
	var lines []line
	i, j := 0, 0
	for i < len(x) || j < len(y) {
		switch {
		case i < len(x) && j < len(y) && x[i] == y[j]:
			lines = append(lines, line{' ', x[i]})
			i++
			j++
		case i < len(x) && (j == len(y) || lcs[i+1][j] >= lcs[i][j+1]):
			lines = append(lines, line{'-', x[i]})
			i++
		default:
			lines = append(lines, line{'+', y[j]})
			j++
		}
	}
	show := make([]bool, len(lines))
	for k, l := range lines {
		if l.op != ' ' {
			for c := max(k-1, 0); c <= min(k+1, len(lines)-1); c++ {
				show[c] = true
			}
		}
	}
	var out strings.Builder
	heading := -1 // the last "$ command" line of a file of sections, for context
	shown := -1   // the last line written
	for k, l := range lines {
		if strings.HasPrefix(l.text, "$ ") && l.op != '+' {
			heading = k
		}
		if !show[k] {
			continue
		}
		if shown != k-1 {
			if heading >= 0 && heading > shown && heading < k {
				fmt.Fprintf(&out, "@ %s\n", lines[heading].text)
			} else if shown >= 0 {
				out.WriteString("  ...\n")
			}
		}
		fmt.Fprintf(&out, "%c %s\n", l.op, l.text)
		shown = k
	}
	return out.String()
}

// binaries are the programs the golden files cover, as meshproc builds them.
var binaries = []string{"curfew", "orchestrator", "toolrunner", "subagent", "modelproxy"}

// goldenBin returns the directory of the binaries, built the way every e2e test gets
// them (meshproc.Build: without -race unless CURFEW_RACE=1, which changes none of what
// the golden files hold).
func goldenBin(t *testing.T) string {
	t.Helper()
	bin, err := meshproc.Build()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// execResult is what one run of a binary printed, and its exit code.
type execResult struct {
	stdout, stderr string
	code           int
}

// execBinary runs a binary of bin with args and exactly the environment env (nothing of
// the test's own: a CURFEW_* variable or HOME on the machine running the tests must not
// show in the golden files), and returns what it printed and its exit code. It fails the
// test if the binary runs longer than timeout or cannot be started.
func execBinary(t *testing.T, bin, name string, env []string, timeout time.Duration, args ...string) execResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, name), args...)
	cmd.Env = env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("%s %s did not exit within %v\nstdout:\n%s\nstderr:\n%s", name, strings.Join(args, " "), timeout, out.String(), errb.String())
	}
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s %s: %v", name, strings.Join(args, " "), err)
	}
	return execResult{stdout: out.String(), stderr: errb.String(), code: code}
}
