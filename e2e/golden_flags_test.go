package e2e

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

const flagsHeader = `Golden file: the exact -h output of %s
(stdout and stderr apart, each line after "| ") and its exit code. Each binary runs with
HOME set to a temporary directory and no other environment, so that no CURFEW_* variable
of the machine becomes a flag's default; that directory is written as $HOME, the only
machine-dependent text.
Rewrite with: go test ./e2e/ -run Golden -count=1 -update (and say why in the commit).`

// helpSection runs one command line with -h and formats what it printed.
func helpSection(t *testing.T, bin, home, name string, args ...string) (string, execResult) {
	t.Helper()
	r := execBinary(t, bin, name, []string{"HOME=" + home}, 30*time.Second, args...)
	var b strings.Builder
	fmt.Fprintf(&b, "\n$ %s\n", strings.Join(append([]string{name}, args...), " "))
	fmt.Fprintf(&b, "exit %d\n", r.code)
	for _, s := range []struct{ name, text string }{{"stdout", r.stdout}, {"stderr", r.stderr}} {
		fmt.Fprintf(&b, "%s:\n", s.name)
		if s.text == "" {
			continue
		}
		for _, l := range strings.Split(strings.TrimSuffix(strings.ReplaceAll(s.text, home, "$HOME"), "\n"), "\n") {
			b.WriteString(strings.TrimRight("| "+l, " ") + "\n")
		}
		if !strings.HasSuffix(s.text, "\n") {
			b.WriteString("(no newline at the end)\n")
		}
	}
	return b.String(), r
}

var (
	// usageCommand matches a command line of a usage text: "  curfew dlq     ls [--run RUN]"
	// gives "dlq" and "ls".
	usageCommand = regexp.MustCompile(`(?m)^\s+curfew\s+([a-z][a-z0-9-]*)(?:\s+([a-z][a-z0-9-]*))?`)
	// flagLine matches a flag's line in Go's flag usage: "  -addr string".
	flagLine = regexp.MustCompile(`(?m)^  -([a-z0-9][a-z0-9-]*)`)
)

// The -h output of every service binary and of every curfew command and subcommand is
// the golden one. The commands are read from the CLI's own usage text (`curfew -h`, then
// each command's -h for its subcommands), so that a new command is covered without
// editing this test.
func TestGoldenFlags(t *testing.T) {
	t.Parallel()
	bin := goldenBin(t)
	home := t.TempDir()

	for _, svc := range services {
		sec, r := helpSection(t, bin, home, svc, "-h")
		if len(flagLine.FindAllString(r.stderr, -1)) < 10 {
			t.Errorf("%s -h lists too few flags:\n%s", svc, sec)
		}
		golden(t, "flags/"+svc+".txt", fmt.Sprintf(flagsHeader, "the "+svc+" service binary"), sec)
	}

	var all strings.Builder
	top, r := helpSection(t, bin, home, "curfew", "-h")
	all.WriteString(top)
	var cmds []string
	for _, m := range usageCommand.FindAllStringSubmatch(r.stdout, -1) {
		// version prints the build's version, which depends on how it was built, and
		// takes no flags.
		if m[1] != "version" && !slices.Contains(cmds, m[1]) {
			cmds = append(cmds, m[1])
		}
	}
	if len(cmds) < 10 {
		t.Fatalf("found only the commands %v in curfew -h:\n%s", cmds, top)
	}
	for _, cmd := range cmds {
		sec, r := helpSection(t, bin, home, "curfew", cmd, "-h")
		all.WriteString(sec)
		var subs []string
		for _, m := range usageCommand.FindAllStringSubmatch(r.stdout+r.stderr, -1) {
			if m[1] == cmd && m[2] != "" && !slices.Contains(subs, m[2]) {
				subs = append(subs, m[2])
			}
		}
		for _, sub := range subs {
			sec, _ := helpSection(t, bin, home, "curfew", cmd, sub, "-h")
			all.WriteString(sec)
		}
	}
	golden(t, "flags/curfew.txt", fmt.Sprintf(flagsHeader, "the curfew CLI, each command and each subcommand"), all.String())
}
