package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// classify marks err with store.ErrUnavailable when it says that PostgreSQL could not
// be reached or could not answer now (unavailable), so that callers can tell an outage
// they may wait out from an answer. Every error the driver returns passes through it.
func classify(err error) error {
	if err == nil || errors.Is(err, store.ErrUnavailable) || !unavailable(err) {
		return err
	}
	return fmt.Errorf("%w: %w", store.ErrUnavailable, err)
}

// unavailable reports whether err is PostgreSQL being out of reach rather than its
// answer:
//   - an error the server sent is judged by its SQLSTATE: class 08 (connection
//     exception), 57P01 admin_shutdown and 57P02 crash_shutdown (the server stopping and
//     cutting its connections), 57P03 cannot_connect_now (starting up or shutting
//     down), 53300 too_many_connections. Any other (a constraint violation, class 23; a
//     serialization failure; a syntax error) is an answer, not an outage;
//   - the caller's own context ending is not the store's outage (the caller decides
//     what its deadline means);
//   - otherwise a connection that could not be made, was cut or timed out: a network
//     error (connection refused, reset, an I/O timeout), the connection ending mid-reply
//     (EOF), or a connection pgx had already closed.
//
// Authentication and TLS failures are ConnectErrors too, but what they wrap is the
// server's answer or a certificate error, neither of which is a network error: they
// stay unclassified (INTERNAL), as a misconfiguration that waiting does not cure.
func unavailable(err error) bool {
	if pe, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch c := pe.Code; {
		case strings.HasPrefix(c, "08"), c == "57P01", c == "57P02", c == "57P03", c == "53300":
			return true
		default:
			return false
		}
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if _, ok := errors.AsType[net.Error](err); ok {
		return true
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, pgconn.ErrConnClosed)
}
