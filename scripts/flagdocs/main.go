// Command flagdocs writes the flag tables of the docs from the binaries' own -h output, so
// that the docs cannot drift from the flags. scripts/flagdocs.sh builds the binaries and
// runs it; scripts/lint.sh checks that its output is what is committed.
//
// A docs page asks for a generated block with a pair of HTML comments:
//
//	<!-- flags: orchestrator -->      a table of `orchestrator -h`'s flags
//	<!-- help: curfew -->             `curfew -h`'s text, verbatim, in a code block
//	<!-- end -->
//
// The words after "flags:" or "help:" are the command line: a binary in -bin, then its
// arguments; -h is appended. Everything between the opening comment and the next
// "<!-- end -->" is replaced.
//
//	flagdocs -bin DIR FILE...
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("flagdocs", flag.ContinueOnError)
	bin := fs.String("bin", "", "directory of the built binaries (required)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *bin == "" || fs.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: flagdocs -bin DIR FILE...")
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	help := func(cmdline []string) (string, error) { return runHelp(ctx, *bin, cmdline) }
	for _, path := range fs.Args() {
		old, err := os.ReadFile(path) //nolint:gosec // the paths are the docs pages named on the command line
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		updated, err := Rewrite(string(old), help)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			return 1
		}
		if updated == string(old) {
			continue
		}
		if err := os.WriteFile(path, []byte(updated), 0o644); err != nil { //nolint:gosec // a docs page, world-readable like the rest of the checkout
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return 0
}

// runHelp runs the command line with -h appended and returns what it printed. Flag
// packages exit 2 after -h and a command's own usage exits 0; both are help.
func runHelp(ctx context.Context, bin string, cmdline []string) (string, error) {
	args := append(append([]string(nil), cmdline[1:]...), "-h")
	cmd := exec.CommandContext(ctx, filepath.Join(bin, cmdline[0]), args...) //nolint:gosec // the binaries this repository builds, named by its docs
	// A fixed environment: defaults derived from $HOME or CURFEW_* would otherwise differ
	// between machines.
	cmd.Env = []string{"HOME=~", "PATH=/usr/bin:/bin"}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && (!errors.As(err, &exit) || exit.ExitCode() != 2) {
		return "", fmt.Errorf("%s -h: %w\n%s", strings.Join(cmdline, " "), err, out.String())
	}
	return out.String(), nil
}

var (
	openRE = regexp.MustCompile(`(?m)^<!-- (flags|help): ([^>]+?) -->\n`)
	endTag = "<!-- end -->"
)

// Rewrite returns doc with every generated block replaced by what help prints for its
// command line.
func Rewrite(doc string, help func(cmdline []string) (string, error)) (string, error) {
	var b strings.Builder
	for {
		loc := openRE.FindStringSubmatchIndex(doc)
		if loc == nil {
			b.WriteString(doc)
			return b.String(), nil
		}
		kind, cmdline := doc[loc[2]:loc[3]], strings.Fields(doc[loc[4]:loc[5]])
		rest := doc[loc[1]:]
		end := strings.Index(rest, endTag)
		if end < 0 {
			return "", fmt.Errorf("<!-- %s: %s --> has no %s", kind, strings.Join(cmdline, " "), endTag)
		}
		out, err := help(cmdline)
		if err != nil {
			return "", err
		}
		b.WriteString(doc[:loc[1]])
		if kind == "flags" {
			flags, err := ParseFlags(out)
			if err != nil {
				return "", fmt.Errorf("%s -h: %w", strings.Join(cmdline, " "), err)
			}
			b.WriteString(Table(flags))
		} else {
			b.WriteString("```text\n" + strings.TrimRight(out, "\n") + "\n```\n")
		}
		doc = rest[end:]
	}
}

// Flag is one flag as the flag package's PrintDefaults prints it.
type Flag struct {
	Name    string // without dashes
	Default string // as printed, quotes included; empty when -h shows none
	Usage   string
}

var (
	nameRE    = regexp.MustCompile(`^  -(\S+)`)
	defaultRE = regexp.MustCompile(` \(default (.*)\)$`)
)

// ParseFlags reads the flags out of PrintDefaults' output: "  -name [type]" on one line,
// the usage on the lines after it, indented by a tab, ending in " (default X)" when the
// default is not the zero value. Lines before the first flag (the "Usage of" line) and
// after the last usage line (a "flag: help requested" error) are skipped.
func ParseFlags(out string) ([]Flag, error) {
	var flags []Flag
	for _, line := range strings.Split(out, "\n") {
		switch {
		case nameRE.MatchString(line):
			flags = append(flags, Flag{Name: nameRE.FindStringSubmatch(line)[1]})
		case strings.HasPrefix(line, "    \t") && len(flags) > 0:
			f := &flags[len(flags)-1]
			f.Usage = strings.TrimSpace(f.Usage + " " + strings.TrimSpace(line))
		}
	}
	if len(flags) == 0 {
		return nil, errors.New("no flags in its output")
	}
	for i := range flags {
		if m := defaultRE.FindStringSubmatchIndex(flags[i].Usage); m != nil {
			flags[i].Default = flags[i].Usage[m[2]:m[3]]
			flags[i].Usage = flags[i].Usage[:m[0]]
		}
	}
	return flags, nil
}

// Table renders flags as a Markdown table.
func Table(flags []Flag) string {
	var b strings.Builder
	b.WriteString("| flag | default | meaning |\n|---|---|---|\n")
	for _, f := range flags {
		def := ""
		if f.Default != "" {
			def = "`" + strings.Trim(f.Default, `"`) + "`"
		}
		fmt.Fprintf(&b, "| `--%s` | %s | %s |\n", f.Name, def, cell(f.Usage))
	}
	return b.String()
}

// cell escapes what would end a table cell or start a tag.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "<", "&lt;", ">", "&gt;").Replace(s)
}
