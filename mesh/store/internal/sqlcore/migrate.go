package sqlcore

import (
	"context"
	"fmt"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/migrations"
)

// Migrate applies the dialect's pending migrations in one transaction, under the
// dialect's lock, recording each in schema_migrations. It is a no-op when the schema is
// current and fails with store.ErrSchemaTooNew when the database has a version this
// binary does not know. It returns the schema version.
func Migrate(ctx context.Context, d Driver, dl Dialect, nowMs int64) (int, error) {
	ms, err := migrations.For(dl.Name)
	if err != nil {
		return 0, err
	}
	var version int
	err = d.Tx(ctx, func(q Querier) error {
		if dl.MigrationLock != "" {
			if _, err := q.Exec(ctx, dl.MigrationLock); err != nil {
				return fmt.Errorf("migration lock: %w", err)
			}
		}
		if _, err := q.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version    INTEGER PRIMARY KEY,
			name       TEXT NOT NULL,
			applied_ms BIGINT NOT NULL)`); err != nil {
			return fmt.Errorf("create schema_migrations: %w", err)
		}
		var cur int64
		if err := q.QueryRow(ctx, `SELECT COALESCE(MAX(version), 0) FROM schema_migrations`).Scan(&cur); err != nil {
			return fmt.Errorf("read schema version: %w", err)
		}
		if int(cur) > len(ms) {
			return fmt.Errorf("%w: database is at version %d, this binary knows up to %d; upgrade curfew",
				store.ErrSchemaTooNew, cur, len(ms))
		}
		for _, m := range ms[cur:] {
			if _, err := q.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("migration %d_%s: %w", m.Version, m.Name, err)
			}
			if _, err := q.Exec(ctx, `INSERT INTO schema_migrations (version, name, applied_ms) VALUES ($1, $2, $3)`,
				m.Version, m.Name, nowMs); err != nil {
				return fmt.Errorf("record migration %d: %w", m.Version, err)
			}
		}
		version = len(ms)
		return nil
	})
	return version, err
}
