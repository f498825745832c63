package main

import (
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

// printDefaults is what a flag set like the services' prints for -h.
func printDefaults() string {
	fs := flag.NewFlagSet("svc", flag.ContinueOnError)
	fs.String("addr", "127.0.0.1:7700", "gRPC listen address")
	fs.Bool("insecure", false, "plaintext, no mTLS; only for `curfew up --insecure` meshes")
	fs.Duration("grace", 10*time.Second, "how long a stop waits (docs/leases.md#drain)")
	fs.String("store", "", "a postgres:// DSN, or a SQLite path (default: curfew.db in --data-dir)")
	fs.String("mode", "shed", "shed|orphan")
	var b strings.Builder
	fs.SetOutput(&b)
	b.WriteString("Usage of svc:\n")
	fs.PrintDefaults()
	b.WriteString("svc: flag: help requested\n")
	return b.String()
}

func TestParseFlags(t *testing.T) {
	got, err := ParseFlags(printDefaults())
	if err != nil {
		t.Fatal(err)
	}
	want := []Flag{
		{Name: "addr", Default: `"127.0.0.1:7700"`, Usage: "gRPC listen address"},
		{Name: "grace", Default: "10s", Usage: "how long a stop waits (docs/leases.md#drain)"},
		{Name: "insecure", Usage: "plaintext, no mTLS; only for curfew up --insecure meshes"},
		{Name: "mode", Default: `"shed"`, Usage: "shed|orphan"},
		{Name: "store", Usage: "a postgres:// DSN, or a SQLite path (default: curfew.db in --data-dir)"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d flags %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("flag %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
	if _, err := ParseFlags("Usage:\n  curfew up ...\n"); err == nil {
		t.Error("ParseFlags of a text without flags: no error")
	}
}

func TestTable(t *testing.T) {
	got := Table([]Flag{
		{Name: "addr", Default: `"127.0.0.1:7700"`, Usage: "gRPC listen address"},
		{Name: "mode", Usage: "shed|orphan, see <service>.crt"},
	})
	want := "| flag | default | meaning |\n|---|---|---|\n" +
		"| `--addr` | `127.0.0.1:7700` | gRPC listen address |\n" +
		"| `--mode` |  | shed\\|orphan, see &lt;service&gt;.crt |\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

func TestRewrite(t *testing.T) {
	help := func(cmdline []string) (string, error) {
		switch strings.Join(cmdline, " ") {
		case "svc":
			return printDefaults(), nil
		case "curfew":
			return "Usage:\n  curfew up\n\n", nil
		}
		return "", errors.New("unknown command")
	}
	doc := "# Page\n\n<!-- flags: svc -->\nstale table\n<!-- end -->\n\ntext\n\n<!-- help: curfew -->\n<!-- end -->\n"
	got, err := Rewrite(doc, help)
	if err != nil {
		t.Fatal(err)
	}
	flags, _ := ParseFlags(printDefaults())
	want := "# Page\n\n<!-- flags: svc -->\n" + Table(flags) + "<!-- end -->\n\ntext\n\n" +
		"<!-- help: curfew -->\n```text\nUsage:\n  curfew up\n```\n<!-- end -->\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	again, err := Rewrite(got, help)
	if err != nil || again != got {
		t.Errorf("rewriting its own output changed it (err %v):\n%s", err, again)
	}
	if _, err := Rewrite("<!-- flags: svc -->\nno end\n", help); err == nil {
		t.Error("a block without its end: no error")
	}
	if _, err := Rewrite("<!-- flags: other -->\n<!-- end -->\n", help); err == nil {
		t.Error("a command that fails: no error")
	}
}
