package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

// driver is a Driver over a pgxpool. Every error it returns has passed through classify:
// PostgreSQL out of reach is store.ErrUnavailable.
type driver struct{ pool *pgxpool.Pool }

// Read implements Driver.
func (d driver) Read() sqlcore.Querier { return pgxQuerier{d.pool} }

// Exec implements Driver.
func (d driver) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	return pgxQuerier{d.pool}.Exec(ctx, s, args...)
}

// Write implements Driver.
func (d driver) Write(ctx context.Context, s string, args ...any) (sqlcore.Rows, error) {
	return pgxQuerier{d.pool}.Query(ctx, s, args...)
}

// Tx implements Driver: READ COMMITTED; the statements lock what they need (ON CONFLICT,
// UPDATE ... WHERE re-checked after a concurrent commit, SELECT ... FOR UPDATE).
func (d driver) Tx(ctx context.Context, fn func(sqlcore.Querier) error) error {
	return classify(pgx.BeginTxFunc(ctx, d.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		return fn(pgxQuerier{tx})
	}))
}

// Close implements Driver.
func (d driver) Close() error {
	d.pool.Close()
	return nil
}

type pgxConn interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

type pgxQuerier struct{ c pgxConn }

func (q pgxQuerier) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	tag, err := q.c.Exec(ctx, s, args...)
	if err != nil {
		return 0, classify(err)
	}
	return tag.RowsAffected(), nil
}

func (q pgxQuerier) QueryRow(ctx context.Context, s string, args ...any) sqlcore.Row {
	return pgxRow{q.c.QueryRow(ctx, s, args...)}
}

func (q pgxQuerier) Query(ctx context.Context, s string, args ...any) (sqlcore.Rows, error) {
	rows, err := q.c.Query(ctx, s, args...)
	if err != nil {
		return nil, classify(err)
	}
	return pgxRows{rows}, nil
}

type pgxRow struct{ r pgx.Row }

func (r pgxRow) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return sqlcore.ErrNoRows
	}
	return classify(err)
}

// pgxRows classifies the errors of reading a result: a connection cut mid-result
// surfaces there, not from Query.
type pgxRows struct{ pgx.Rows }

func (r pgxRows) Scan(dest ...any) error { return classify(r.Rows.Scan(dest...)) }

func (r pgxRows) Err() error { return classify(r.Rows.Err()) }
