package sqlcore

import (
	"context"
	"database/sql"
	"errors"
)

// SQLDB is a Driver over database/sql: one pool for writes (the SQLite backends
// give it a single connection) and one for reads.
type SQLDB struct {
	W, R *sql.DB
}

// Read implements Driver.
func (d SQLDB) Read() Querier { return sqlQuerier{d.R} }

// Exec implements Driver, on the writer connection.
func (d SQLDB) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	return sqlQuerier{d.W}.Exec(ctx, s, args...)
}

// Tx implements Driver.
func (d SQLDB) Tx(ctx context.Context, fn func(Querier) error) (err error) {
	tx, err := d.W.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if err = fn(sqlQuerier{tx}); err != nil {
		return err
	}
	return tx.Commit()
}

// Close implements Driver.
func (d SQLDB) Close() error { return errors.Join(d.R.Close(), d.W.Close()) }

type sqlConn interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

type sqlQuerier struct{ c sqlConn }

func (q sqlQuerier) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	res, err := q.c.ExecContext(ctx, s, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (q sqlQuerier) QueryRow(ctx context.Context, s string, args ...any) Row {
	return sqlRow{q.c.QueryRowContext(ctx, s, args...)}
}

func (q sqlQuerier) Query(ctx context.Context, s string, args ...any) (Rows, error) {
	rows, err := q.c.QueryContext(ctx, s, args...)
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
