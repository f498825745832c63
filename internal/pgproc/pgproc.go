// Package pgproc runs a PostgreSQL server of its own: initdb into a directory, pg_ctl on
// a free loopback port, so that a test or a soak can stop the store under a running mesh
// and start it again (the machine's shared server must stay up for everything else).
//
//	pg, err := pgproc.Start(ctx)
//	defer pg.Close()
//	dsn := pg.DSN()
//	err = pg.Stop()          // at once: connections are cut, as when its host goes away
//	err = pg.Up(ctx)         // again, on the same port and data
//
// PostgreSQL refuses to run as root: as root, the server runs as the postgres user.
package pgproc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Server is a PostgreSQL server of this process's own.
type Server struct {
	dir, port, owner string
	bin              string // the directory of initdb and pg_ctl
}

// BinDir finds PostgreSQL's server programs: on PATH, else Debian's
// /usr/lib/postgresql/<version>/bin; "" when they are not installed.
func BinDir() string {
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

// ErrNotInstalled says PostgreSQL's server programs are missing.
var ErrNotInstalled = errors.New("pgproc: PostgreSQL's server programs (initdb, pg_ctl) are not installed: the README's test command installs them (postgresql)")

// Start initdbs a cluster in a new temporary directory (Close removes it; directly under
// the system's, so that the postgres user can reach it when running as root) and starts
// it.
func Start(ctx context.Context) (*Server, error) {
	bin := BinDir()
	if bin == "" {
		return nil, ErrNotInstalled
	}
	dir, err := os.MkdirTemp("", "curfew-pg-")
	if err != nil {
		return nil, err
	}
	pg := &Server{dir: dir, bin: bin}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("pgproc: running as root, a private PostgreSQL needs the postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		pg.owner = "postgres"
	}
	l, err := new(net.ListenConfig).Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	pg.port = strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	if err := pg.run("initdb", "-D", pg.data(), "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w", err)
	}
	if err := pg.Up(ctx); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return pg, nil
}

func (pg *Server) data() string { return filepath.Join(pg.dir, "data") }

// run runs one of PostgreSQL's programs, as the server's owner.
func (pg *Server) run(name string, args ...string) error {
	prog := filepath.Join(pg.bin, name)
	var cmd *exec.Cmd
	if pg.owner != "" {
		cmd = exec.Command("runuser", append([]string{"-u", pg.owner, "--", prog}, args...)...) //nolint:gosec,noctx // our own server, bounded by pg_ctl -w
	} else {
		cmd = exec.Command(prog, args...) //nolint:gosec,noctx // our own server, bounded by pg_ctl -w
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w\n%s", name, err, out)
	}
	return nil
}

// Up starts the server and waits until it answers (up to 30 s, or ctx).
func (pg *Server) Up(ctx context.Context) error {
	opts := "-c listen_addresses=127.0.0.1 -c port=" + pg.port + " -c unix_socket_directories=" + pg.dir + " -c fsync=off -c max_connections=300"
	if err := pg.run("pg_ctl", "-D", pg.data(), "-l", filepath.Join(pg.dir, "server.log"), "-o", opts, "-w", "start"); err != nil {
		return fmt.Errorf("pg_ctl start: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		c, err := pgx.Connect(ctx, pg.DSN())
		if err == nil {
			return c.Close(ctx)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("private PostgreSQL not answering: %w", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the server at once (immediate mode: connections are cut, as when its host
// goes away).
func (pg *Server) Stop() error {
	if err := pg.run("pg_ctl", "-D", pg.data(), "-m", "immediate", "-w", "stop"); err != nil {
		return fmt.Errorf("pg_ctl stop: %w", err)
	}
	return nil
}

// Close stops the server if it runs and removes its directory.
func (pg *Server) Close() error {
	_ = pg.run("pg_ctl", "-D", pg.data(), "-m", "immediate", "stop")
	return os.RemoveAll(pg.dir)
}

// DSN is the store DSN of the server's postgres database.
func (pg *Server) DSN() string {
	return "postgres://postgres@127.0.0.1:" + pg.port + "/postgres?sslmode=disable"
}

// Dir is the server's directory (its data and server.log).
func (pg *Server) Dir() string { return pg.dir }
