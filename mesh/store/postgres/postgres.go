package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

func init() { store.Register("postgres", Open) }

var dialect = sqlcore.Dialect{
	Name:       "postgres",
	ForUpdate:  " FOR UPDATE",
	SkipLocked: " FOR UPDATE SKIP LOCKED",
	// Replicas starting together migrate one at a time; the key is arbitrary but fixed.
	MigrationLock: "SELECT pg_advisory_xact_lock(7306254372)",
	Blob:          "BYTEA",
	WritableCTEs:  true,
}

// Open connects a pgxpool to dsn (postgres://user@host:port/db?sslmode=disable, or
// any form pgx accepts; pool_* parameters in the DSN override Options.MaxConns) and
// applies pending migrations in the schema the connection's search_path selects.
func Open(ctx context.Context, dsn string, opts ...store.Option) (store.Store, error) {
	o := store.BuildOptions(opts...)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("%w: postgres dsn: %w", store.ErrInvalidArgument, err)
	}
	if o.MaxConns > 0 {
		cfg.MaxConns = int32(min(o.MaxConns, 1<<15))
	} else if !strings.Contains(dsn, "pool_max_conns") {
		cfg.MaxConns = 10
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	d := driver{pool: pool}
	if err := pool.Ping(ctx); err != nil {
		return nil, errors.Join(fmt.Errorf("postgres %s:%d: %w", cfg.ConnConfig.Host, cfg.ConnConfig.Port, err), d.Close())
	}
	if _, err := sqlcore.Migrate(ctx, d, dialect, max(o.Clock().UnixMilli(), 1)); err != nil {
		return nil, errors.Join(fmt.Errorf("postgres: %w", err), d.Close())
	}
	return pgStore{Store: sqlcore.New(d, dialect, o), pool: pool}, nil
}
