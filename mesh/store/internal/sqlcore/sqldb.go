package sqlcore

import (
	"context"
	"database/sql"
	"errors"
	"runtime"
)

// SQLDB is a Driver over database/sql: one pool for writes (the SQLite backends
// give it a single connection) and one for reads. Each pool keeps its queries
// prepared (stmts), made by OpenSQLite.
type SQLDB struct {
	W, R   *sql.DB
	ws, rs *stmts
}

// Read implements Driver.
func (d SQLDB) Read() Querier { return sqlQuerier{c: d.R, st: d.rs} }

// Exec implements Driver, on the writer connection.
func (d SQLDB) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	return sqlQuerier{c: d.W, st: d.ws}.Exec(ctx, s, args...)
}

// Write implements Driver, on the writer connection.
func (d SQLDB) Write(ctx context.Context, s string, args ...any) (Rows, error) {
	return sqlQuerier{c: d.W, st: d.ws}.Query(ctx, s, args...)
}

// Tx implements Driver.
func (d SQLDB) Tx(ctx context.Context, fn func(Querier) error) (err error) {
	tx, err := d.W.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	// The queries the transaction ran unprepared are prepared once it has given the
	// writer connection back.
	defer d.ws.preparePending(ctx)
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if err = fn(sqlQuerier{c: tx, st: d.ws, tx: tx}); err != nil {
		return err
	}
	return tx.Commit()
}

// Close implements Driver.
func (d SQLDB) Close() error {
	return errors.Join(d.rs.close(), d.ws.close(), d.R.Close(), d.W.Close())
}

type sqlConn interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// sqlQuerier runs queries on c, through st's prepared statements when it has one (in
// the transaction tx, when c is tx).
type sqlQuerier struct {
	c  sqlConn
	st *stmts
	tx *sql.Tx
}

// stmt returns the prepared statement of s, or nil to run s unprepared.
func (q sqlQuerier) stmt(ctx context.Context, s string) *sql.Stmt {
	st := q.st.get(ctx, s, q.tx == nil)
	if st != nil && q.tx != nil {
		return q.tx.StmtContext(ctx, st)
	}
	return st
}

func (q sqlQuerier) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	var res sql.Result
	var err error
	if st := q.stmt(ctx, s); st != nil {
		res, err = st.ExecContext(ctx, args...)
	} else {
		res, err = q.c.ExecContext(ctx, s, args...)
	}
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (q sqlQuerier) QueryRow(ctx context.Context, s string, args ...any) Row {
	if st := q.stmt(ctx, s); st != nil {
		return sqlRow{st.QueryRowContext(ctx, args...)}
	}
	return sqlRow{q.c.QueryRowContext(ctx, s, args...)}
}

func (q sqlQuerier) Query(ctx context.Context, s string, args ...any) (Rows, error) {
	var rows *sql.Rows
	var err error
	if st := q.stmt(ctx, s); st != nil {
		rows, err = st.QueryContext(ctx, args...)
	} else {
		rows, err = q.c.QueryContext(ctx, s, args...)
	}
	if err != nil {
		return nil, err
	}
	return sqlRows{rows}, nil
}

type sqlRow struct{ r *sql.Row }

func (r sqlRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNoRows
	}
	return err
}

type sqlRows struct{ *sql.Rows }

func (r sqlRows) Close() { _ = r.Rows.Close() }

// OpenSQLite opens the two pools of a SQLite database through the driver registered as
// "sqlite", base being its file: URI with a query: one writer connection whose
// transactions take the write lock at BEGIN, and maxConns read-only connections
// (<= 0: max(4, GOMAXPROCS)) plus extra more that may be open but are not kept idle.
func OpenSQLite(base string, maxConns, extra int) (SQLDB, error) {
	w, err := sql.Open("sqlite", base+"&_txlock=immediate")
	if err != nil {
		return SQLDB{}, err
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	w.SetConnMaxLifetime(0)
	// Readers run concurrently with the writer, on read-only connections.
	readers := maxConns
	if readers <= 0 {
		readers = max(4, runtime.GOMAXPROCS(0))
	}
	r, err := sql.Open("sqlite", base+"&_pragma=query_only(1)")
	if err != nil {
		_ = w.Close()
		return SQLDB{}, err
	}
	r.SetMaxOpenConns(readers + extra)
	r.SetMaxIdleConns(readers)
	return SQLDB{W: w, R: r, ws: newStmts(w), rs: newStmts(r)}, nil
}
