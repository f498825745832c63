package cli

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/internal/launch"
)

// A command's stderr carries no library INFO line by default (--log-level warn), and
// does with --log-level info: the certificate the command loads to dial the mesh.
func TestLogLevel(t *testing.T) {
	data := t.TempDir()
	if _, err := launch.PrepareTLS(filepath.Join(data, launch.TLSSubdir)); err != nil {
		t.Fatal(err)
	}
	ls := func(extra ...string) string {
		t.Helper()
		var out, errb bytes.Buffer
		// Nothing listens on port 1: the call fails after the dial has loaded curfew-cli's
		// certificate.
		args := append([]string{"ls", "--data-dir", data, "--addr", "127.0.0.1:1"}, extra...)
		if code := Main(context.Background(), args, nil, &out, &errb); code != ExitFail {
			t.Errorf("%q: exit %d, want %d (stderr %q)", args, code, ExitFail, errb.String())
		}
		return errb.String()
	}
	if got := ls(); strings.Contains(got, "INFO") || strings.Contains(got, "certificates loaded") {
		t.Errorf("default log level: stderr has an INFO line:\n%s", got)
	}
	if got := ls("--log-level", "info"); !strings.Contains(got, "level=INFO") || !strings.Contains(got, "certificates loaded") {
		t.Errorf("--log-level info: stderr lacks the certificate's INFO line:\n%s", got)
	}
	if got := ls("--log-level", "error"); strings.Contains(got, "level=") {
		t.Errorf("--log-level error: stderr has a library log line:\n%s", got)
	}
}

// A bad --log-level is a usage error that names the value; every command takes the flag.
func TestLogLevelInvalid(t *testing.T) {
	for _, args := range [][]string{
		{"ls", "--log-level", "loud"},
		{"up", "--log-level", "loud"},
		{"tenant", "ls", "--log-level", "loud"},
		{"tls", "init", "--log-level", "loud"},
		{"drill", "--log-level", "loud"},
		{"dlq", "ls", "--log-level", "loud"},
	} {
		var out, errb bytes.Buffer
		code := Main(context.Background(), args, nil, &out, &errb)
		if code != ExitUsage || !strings.Contains(errb.String(), `invalid value "loud" for flag -log-level`) {
			t.Errorf("%q: exit %d, stderr %q; want %d naming the value", args, code, errb.String(), ExitUsage)
		}
	}
}

// The usage's up line names every flag `curfew up` takes; --log-level, which every
// command takes, is in the text below the commands.
func TestUpUsageListsEveryFlag(t *testing.T) {
	var out, errb bytes.Buffer
	if code := Main(context.Background(), []string{"up", "-h"}, nil, &out, &errb); code != ExitUsage {
		t.Fatalf("up -h: exit %d", code)
	}
	start := strings.Index(usage, "curfew up")
	end := strings.Index(usage, "curfew run")
	if start < 0 || end < start {
		t.Fatal("no up line in the usage")
	}
	up := usage[start:end]
	n := 0
	for _, line := range strings.Split(errb.String(), "\n") {
		name, ok := strings.CutPrefix(line, "  -")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(name, " ")
		n++
		text := up
		if name == "log-level" {
			text = usage
		}
		if !strings.Contains(text, "--"+name) {
			t.Errorf("the usage lacks up's --%s", name)
		}
	}
	if n < 11 {
		t.Errorf("up -h lists %d flags, want 11:\n%s", n, errb.String())
	}
}
