package sqlcore

import (
	"context"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const replicaCols = `service, replica, config, version, loaded_ms, last_error, last_error_ms, seen_ms`

// PutReplicaConfig implements store.Replicas.
func (s *Store) PutReplicaConfig(ctx context.Context, c store.ReplicaConfig) error {
	if c.Service == "" || c.Replica == "" || c.Config == "" {
		return invalid("replica config needs service, replica and config")
	}
	_, err := s.d.Exec(ctx, `INSERT INTO replica_configs (`+replicaCols+`) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
		ON CONFLICT (service, replica, config) DO UPDATE SET version = excluded.version, loaded_ms = excluded.loaded_ms,
		last_error = excluded.last_error, last_error_ms = excluded.last_error_ms, seen_ms = excluded.seen_ms`,
		c.Service, c.Replica, c.Config, c.Version, ms(c.LoadedAt), c.LastError, ms(c.LastErrorAt), s.nowMs())
	return err
}

// ListReplicaConfigs implements store.Replicas.
func (s *Store) ListReplicaConfigs(ctx context.Context, service string) ([]store.ReplicaConfig, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT `+replicaCols+` FROM replica_configs WHERE ($1 = '' OR service = $1)
		ORDER BY service, config, replica`, service)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.ReplicaConfig
	for rows.Next() {
		var (
			c                     store.ReplicaConfig
			loaded, errAt, seenAt int64
		)
		if err := rows.Scan(&c.Service, &c.Replica, &c.Config, &c.Version, &loaded, &c.LastError, &errAt, &seenAt); err != nil {
			return nil, err
		}
		c.LoadedAt, c.LastErrorAt, c.SeenAt = tm(loaded), tm(errAt), tm(seenAt)
		out = append(out, c)
	}
	return out, rows.Err()
}

// PruneReplicaConfigs implements store.Replicas.
func (s *Store) PruneReplicaConfigs(ctx context.Context, before time.Time) (int64, error) {
	return s.d.Exec(ctx, `DELETE FROM replica_configs WHERE seen_ms < $1`, ms(before))
}
