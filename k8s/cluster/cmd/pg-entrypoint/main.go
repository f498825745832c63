// Command pg-entrypoint is the entrypoint of the test cluster's PostgreSQL image: the part of the
// official postgres image's docker-entrypoint.sh that k8s/overlays/dev/postgres.yaml relies on.
//
//	pg-entrypoint [postgres] [postgres arguments...]
//
// When $PGDATA holds no database cluster (no PG_VERSION), it runs initdb, as the image's user,
// with superuser $POSTGRES_USER (default postgres), UTF8 encoding and the C locale, trust for
// local connections and $POSTGRES_HOST_AUTH_METHOD (default scram-sha-256, then
// $POSTGRES_PASSWORD is the superuser's password) for the others, which pg_hba.conf admits from
// anywhere; $POSTGRES_INITDB_ARGS are added to initdb's. Then it creates database $POSTGRES_DB
// (default $POSTGRES_USER) in single-user mode, unless it is postgres. Like the official image,
// it refuses to initialize with neither a password nor an authentication method.
//
// Then it becomes (execs) postgres -D $PGDATA -c listen_addresses=* with its arguments, so that
// postgres is the container's PID 1 and gets the runtime's signals. A first argument that is
// neither postgres nor a flag is a command to run instead, without initialization.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

func main() {
	if err := run(context.Background(), os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "pg-entrypoint: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) > 0 && args[0] != "postgres" && !strings.HasPrefix(args[0], "-") {
		return execve(args[0], args)
	}
	if len(args) > 0 && args[0] == "postgres" {
		args = args[1:]
	}
	if os.Getuid() == 0 {
		return errors.New("running as root, which postgres refuses: run as the image's user, 999")
	}
	pgdata := os.Getenv("PGDATA")
	if pgdata == "" {
		return errors.New("the environment has no PGDATA")
	}
	switch _, err := os.Stat(filepath.Join(pgdata, "PG_VERSION")); {
	case errors.Is(err, fs.ErrNotExist):
		if err := initialize(ctx, pgdata); err != nil {
			return fmt.Errorf("initializing %s: %w", pgdata, err)
		}
	case err != nil:
		return err
	}
	return execve("postgres", append([]string{"postgres", "-D", pgdata, "-c", "listen_addresses=*"}, args...))
}

// initialize creates the database cluster in pgdata.
func initialize(ctx context.Context, pgdata string) error {
	user := env("POSTGRES_USER", "postgres")
	db := env("POSTGRES_DB", user)
	password := os.Getenv("POSTGRES_PASSWORD")
	auth := os.Getenv("POSTGRES_HOST_AUTH_METHOD")
	if auth == "" && password == "" {
		return errors.New("the superuser password is not specified: set POSTGRES_PASSWORD, " +
			"or POSTGRES_HOST_AUTH_METHOD=trust to allow all connections without a password (not recommended)")
	}
	if auth == "" {
		auth = "scram-sha-256"
	}
	initdb := exec.CommandContext(ctx, "initdb", "-D", pgdata, "-U", user, "--auth-local=trust", "--auth-host="+auth,
		"--encoding=UTF8", "--locale=C")
	if password != "" {
		initdb.Args = append(initdb.Args, "--pwfile=/dev/stdin")
		initdb.Stdin = strings.NewReader(password + "\n")
	}
	initdb.Args = append(initdb.Args, strings.Fields(os.Getenv("POSTGRES_INITDB_ARGS"))...)
	initdb.Stdout, initdb.Stderr = os.Stdout, os.Stderr
	if err := initdb.Run(); err != nil {
		return fmt.Errorf("initdb: %w", err)
	}

	hba, err := os.OpenFile(filepath.Join(pgdata, "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(hba, "\n# pg-entrypoint: POSTGRES_HOST_AUTH_METHOD\nhost all all all %s\n", auth)
	if cerr := hba.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}

	if db == "postgres" {
		return nil
	}
	// Single-user mode needs no socket; with exit_on_error an error fails it, and with -j
	// a statement ends at ";" and an empty line, so that the name may hold any character.
	single := exec.CommandContext(ctx, "postgres", "--single", "-j", "-D", pgdata, "-c", "exit_on_error=on", "postgres")
	single.Stdin = strings.NewReader(`CREATE DATABASE "` + strings.ReplaceAll(db, `"`, `""`) + "\";\n\n")
	single.Stdout, single.Stderr = io.Discard, os.Stderr // stdout has only its prompts
	if err := single.Run(); err != nil {
		return fmt.Errorf("creating database %s: postgres --single: %w", db, err)
	}
	fmt.Printf("pg-entrypoint: created database %s\n", db)
	return nil
}

// execve replaces this process with the program found on PATH.
func execve(program string, argv []string) error {
	p, err := exec.LookPath(program)
	if err != nil {
		return err
	}
	return fmt.Errorf("exec %s: %w", p, syscall.Exec(p, argv, os.Environ()))
}

func env(key, fallback string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return fallback
}
