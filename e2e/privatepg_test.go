package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// privatePG is a PostgreSQL server of the test's own (initdb into a temporary
// directory, pg_ctl on a free port), so that a test can stop the store under a running
// mesh and start it again: the shared server of the machine must stay up for the other
// tests.
type privatePG struct {
	dir, port, owner string
	bin              string // the directory of initdb and pg_ctl
}

// pgBinDir finds PostgreSQL's server programs: on PATH, else Debian's
// /usr/lib/postgresql/<version>/bin.
func pgBinDir() string {
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		return filepath.Dir(p)
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	for i := len(dirs) - 1; i >= 0; i-- {
		if _, err := os.Stat(filepath.Join(dirs[i], "pg_ctl")); err == nil {
			return dirs[i]
		}
	}
	return ""
}

// startPrivatePG initdbs and starts a server; the test's end stops it and removes its
// directory. PostgreSQL refuses to run as root: as root, it runs as the postgres user.
func startPrivatePG(t *testing.T) *privatePG {
	t.Helper()
	bin := pgBinDir()
	if bin == "" {
		t.Fatal("PostgreSQL's server programs (initdb, pg_ctl) are not installed: the README's test command installs them (postgresql)")
	}
	dir, err := os.MkdirTemp("", "curfew-pg-")
	if err != nil {
		t.Fatal(err)
	}
	pg := &privatePG{dir: dir, bin: bin}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root, a private PostgreSQL needs the postgres user: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
		pg.owner = "postgres"
	}
	t.Cleanup(func() {
		_ = pg.run("pg_ctl", "-D", pg.data(), "-m", "immediate", "stop")
		_ = os.RemoveAll(dir)
	})
	l, err := new(net.ListenConfig).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pg.port = strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	if err := pg.run("initdb", "-D", pg.data(), "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v", err)
	}
	pg.start(t)
	return pg
}

func (pg *privatePG) data() string { return filepath.Join(pg.dir, "data") }

// run runs one of PostgreSQL's programs, as the server's owner.
func (pg *privatePG) run(name string, args ...string) error {
	prog := filepath.Join(pg.bin, name)
	var cmd *exec.Cmd
	if pg.owner != "" {
		cmd = exec.Command("runuser", append([]string{"-u", pg.owner, "--", prog}, args...)...) //nolint:gosec,noctx // the test's own server
	} else {
		cmd = exec.Command(prog, args...) //nolint:gosec,noctx // the test's own server
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w\n%s", name, err, out)
	}
	return nil
}

// start starts the server and waits until it answers.
func (pg *privatePG) start(t *testing.T) {
	t.Helper()
	opts := "-c listen_addresses=127.0.0.1 -c port=" + pg.port + " -c unix_socket_directories=" + pg.dir + " -c fsync=off -c max_connections=200"
	if err := pg.run("pg_ctl", "-D", pg.data(), "-l", filepath.Join(pg.dir, "server.log"), "-o", opts, "-w", "start"); err != nil {
		t.Fatalf("pg_ctl start: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		c, err := pgx.Connect(ctx, pg.dsn())
		if err == nil {
			_ = c.Close(ctx)
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("private PostgreSQL not answering: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop stops the server at once (connections are cut, as when its host goes away).
func (pg *privatePG) stop(t *testing.T) {
	t.Helper()
	if err := pg.run("pg_ctl", "-D", pg.data(), "-m", "immediate", "-w", "stop"); err != nil {
		t.Fatalf("pg_ctl stop: %v", err)
	}
}

// dsn is the store DSN of the server's postgres database.
func (pg *privatePG) dsn() string {
	return "postgres://postgres@127.0.0.1:" + pg.port + "/postgres?sslmode=disable"
}
