package postgres

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

// slotChannel is the channel that migration 0010's trigger notifies on every slot
// release, with the scope as payload. Channels are per database, not per schema: stores
// in other schemas of one database (tests) wake each other spuriously, which is harmless.
const slotChannel = "curfew_slots"

// pgStore is the postgres backend's Store: sqlcore's, and the release notifications.
type pgStore struct {
	*sqlcore.Store
	pool *pgxpool.Pool
}

var _ store.SlotReleases = pgStore{}

// WatchSlotReleases implements store.SlotReleases with LISTEN on a connection of its
// own, taken from the pool for the watch's lifetime (it then no longer counts in the
// pool). End ctx before closing the store.
func (s pgStore) WatchSlotReleases(ctx context.Context, fn func(scope string)) (<-chan error, error) {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("postgres: listen %s: %w", slotChannel, err)
	}
	conn := pc.Hijack()
	if _, err := conn.Exec(ctx, "LISTEN "+slotChannel); err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("postgres: listen %s: %w", slotChannel, err)
	}
	done := make(chan error, 1)
	go func() {
		defer close(done)
		defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
		for {
			n, err := conn.WaitForNotification(ctx)
			if err != nil {
				if ctx.Err() == nil {
					done <- fmt.Errorf("postgres: listen %s: %w", slotChannel, err)
				}
				return
			}
			fn(n.Payload)
		}
	}()
	return done, nil
}
