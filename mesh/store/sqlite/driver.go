package sqlite

import (
	"context"
	"database/sql"
	"errors"

	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

// driver is a Driver over database/sql: one pool for writes (the SQLite backend
// gives it a single connection) and one for reads.
type driver struct {
	w, r *sql.DB
}

// Read implements Driver.
func (d driver) Read() sqlcore.Querier { return sqlQuerier{d.r} }

// Exec implements Driver, on the writer connection.
func (d driver) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	return sqlQuerier{d.w}.Exec(ctx, s, args...)
}

// Tx implements Driver.
func (d driver) Tx(ctx context.Context, fn func(sqlcore.Querier) error) (err error) {
	tx, err := d.w.BeginTx(ctx, nil)
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
func (d driver) Close() error { return errors.Join(d.r.Close(), d.w.Close()) }

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

func (q sqlQuerier) QueryRow(ctx context.Context, s string, args ...any) sqlcore.Row {
	return sqlRow{q.c.QueryRowContext(ctx, s, args...)}
}

func (q sqlQuerier) Query(ctx context.Context, s string, args ...any) (sqlcore.Rows, error) {
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
		return sqlcore.ErrNoRows
	}
	return err
}

type sqlRows struct{ *sql.Rows }

func (r sqlRows) Close() { _ = r.Rows.Close() }
