package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// What PostgreSQL being out of reach looks like, and what only looks alike: the store
// marks the first ErrUnavailable (UNAVAILABLE, waited out by durable runs) and never the
// second.
func TestClassify(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for name, tc := range map[string]struct {
		err  error
		want bool
	}{
		"connection refused":                  {refused, true},
		"connection reset":                    {&net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}, true},
		"cut mid-reply":                       {fmt.Errorf("failed to receive message: %w", io.ErrUnexpectedEOF), true},
		"a connection pgx closed":             {fmt.Errorf("x: %w", pgconn.ErrConnClosed), true},
		"admin_shutdown (server stopping)":    {&pgconn.PgError{Severity: "FATAL", Code: "57P01"}, true},
		"cannot_connect_now (starting up)":    {&pgconn.PgError{Severity: "FATAL", Code: "57P03"}, true},
		"connection exception class 08":       {&pgconn.PgError{Code: "08006"}, true},
		"too many connections":                {&pgconn.PgError{Code: "53300"}, true},
		"unique violation":                    {&pgconn.PgError{Code: "23505"}, false},
		"serialization failure":               {&pgconn.PgError{Code: "40001"}, false},
		"bad password":                        {&pgconn.PgError{Severity: "FATAL", Code: "28P01"}, false},
		"the caller's context":                {fmt.Errorf("q: %w", context.Canceled), false},
		"the caller's deadline":               {fmt.Errorf("q: %w", context.DeadlineExceeded), false},
		"a fenced write":                      {fmt.Errorf("%w: checkpoint 3", store.ErrStaleEpoch), false},
		"unknown":                             {errors.New("something else"), false},
		"nil":                                 {nil, false},
		"marked already, not marked twice":    {fmt.Errorf("%w: x", store.ErrUnavailable), true},
		"a statement error wrapping a server": {fmt.Errorf("insert: %w", &pgconn.PgError{Code: "57P01"}), true},
	} {
		got := classify(tc.err)
		if is := errors.Is(got, store.ErrUnavailable); is != tc.want {
			t.Errorf("%s: classify(%v) = %v, unavailable %v, want %v", name, tc.err, got, is, tc.want)
		}
		if !errors.Is(got, tc.err) {
			t.Errorf("%s: classify(%v) = %v lost the error it classified", name, tc.err, got)
		}
		if got != nil && errors.Is(got, store.ErrUnavailable) && store.Code(got).String() != "Unavailable" {
			t.Errorf("%s: code %v, want Unavailable", name, store.Code(got))
		}
	}
}

// A real connection refused, as pgx reports it while PostgreSQL is down, is marked.
func TestClassifyRefusedConnection(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // a port nobody listens on
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pgconn.Connect(ctx, "postgres://postgres@"+addr+"/test?sslmode=disable&connect_timeout=5")
	if err == nil {
		t.Fatal("connected to a closed port")
	}
	if got := classify(err); !errors.Is(got, store.ErrUnavailable) {
		t.Fatalf("classify(%v) is not unavailable", err)
	}
}
