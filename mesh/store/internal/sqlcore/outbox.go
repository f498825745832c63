package sqlcore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// appendOutbox appends one Notify effect of c's call at position seq among its effects,
// in CompleteTool's transaction. The channel's row is upserted first: its lock (held
// until the commit) orders the writers of one channel, so positions are gap-free and in
// commit order. A row already there (the same call's effect) changes nothing.
func (s *Store) appendOutbox(ctx context.Context, q Querier, c store.ToolClaim, seq int, e store.Notify, now int64) error {
	var exists int64
	err := q.QueryRow(ctx, `SELECT COUNT(*) FROM outbox WHERE tenant = $1 AND idempotency_key = $2 AND seq = $3`,
		c.Tenant, c.Key, seq).Scan(&exists)
	if err != nil || exists > 0 {
		return err
	}
	var pos int64
	if err := q.QueryRow(ctx, `INSERT INTO outbox_channels (tenant, channel, written_seq) VALUES ($1, $2, 1)
		ON CONFLICT (tenant, channel) DO UPDATE SET written_seq = outbox_channels.written_seq + 1
		RETURNING written_seq`, c.Tenant, e.Channel).Scan(&pos); err != nil {
		return err
	}
	_, err = q.Exec(ctx, `INSERT INTO outbox (tenant, idempotency_key, seq, channel, channel_seq, payload, created_ms)
		VALUES ($1, $2, $3, $4, $5, $6, $7)`, c.Tenant, c.Key, seq, e.Channel, pos, blob(e.Payload), now)
	return err
}

const relayName = "outbox"

func scanRelay(r Row) (store.RelayLease, error) {
	var (
		l     store.RelayLease
		until int64
	)
	if err := r.Scan(&l.Owner, &l.Epoch, &until); err != nil {
		return store.RelayLease{}, err
	}
	l.Expires = tm(until)
	return l, nil
}

// ClaimOutboxRelay implements store.Outbox.
func (s *Store) ClaimOutboxRelay(ctx context.Context, owner string, ttl time.Duration) (store.RelayLease, error) {
	if owner == "" || ttl <= 0 {
		return store.RelayLease{}, invalid("claim the outbox relay needs an owner and a positive TTL")
	}
	var out store.RelayLease
	err := s.d.Tx(ctx, func(q Querier) error {
		now := s.nowMs()
		cur, err := scanRelay(q.QueryRow(ctx, `SELECT owner, epoch, lease_expires_ms FROM outbox_relay WHERE name = $1`+s.dl.ForUpdate, relayName))
		if err != nil {
			return err
		}
		if cur.Owner != "" && cur.Owner != owner && ms(cur.Expires) > now {
			return &store.LeaseHeldError{RunID: "(outbox relay)", Owner: cur.Owner, Epoch: cur.Epoch, Expires: cur.Expires}
		}
		out, err = scanRelay(q.QueryRow(ctx, `UPDATE outbox_relay SET owner = $1, epoch = epoch + 1, lease_expires_ms = $2
			WHERE name = $3 RETURNING owner, epoch, lease_expires_ms`, owner, now+ttlMs(ttl), relayName))
		return err
	})
	return out, err
}

// relayFence locks the lease row and checks that l is current.
func (s *Store) relayFence(ctx context.Context, q Querier, l store.RelayLease) error {
	cur, err := scanRelay(q.QueryRow(ctx, `SELECT owner, epoch, lease_expires_ms FROM outbox_relay WHERE name = $1`+s.dl.ForUpdate, relayName))
	if err != nil {
		return err
	}
	if cur.Owner != l.Owner || cur.Epoch != l.Epoch {
		return fmt.Errorf("%w: the outbox relay lease is at epoch %d (owner %q), the writer has %d (owner %q)",
			store.ErrStaleEpoch, cur.Epoch, cur.Owner, l.Epoch, l.Owner)
	}
	return nil
}

// HeartbeatOutboxRelay implements store.Outbox.
func (s *Store) HeartbeatOutboxRelay(ctx context.Context, l store.RelayLease, ttl time.Duration) (store.RelayLease, error) {
	if ttl <= 0 {
		return store.RelayLease{}, invalid("heartbeat the outbox relay with TTL %v", ttl)
	}
	var out store.RelayLease
	err := s.d.Tx(ctx, func(q Querier) error {
		if err := s.relayFence(ctx, q, l); err != nil {
			return err
		}
		var err error
		out, err = scanRelay(q.QueryRow(ctx, `UPDATE outbox_relay SET lease_expires_ms = $1 WHERE name = $2
			RETURNING owner, epoch, lease_expires_ms`, s.nowMs()+ttlMs(ttl), relayName))
		return err
	})
	return out, err
}

// ReleaseOutboxRelay implements store.Outbox.
func (s *Store) ReleaseOutboxRelay(ctx context.Context, l store.RelayLease) error {
	return s.d.Tx(ctx, func(q Querier) error {
		if err := s.relayFence(ctx, q, l); err != nil {
			return err
		}
		_, err := q.Exec(ctx, `UPDATE outbox_relay SET owner = '', lease_expires_ms = 0 WHERE name = $1`, relayName)
		return err
	})
}

const outboxCols = `o.id, o.tenant, o.idempotency_key, o.seq, o.channel, o.channel_seq, o.payload, o.created_ms`

func scanOutbox(r Rows, more ...any) (store.OutboxEntry, error) {
	var (
		e       store.OutboxEntry
		created int64
	)
	if err := r.Scan(append([]any{&e.ID, &e.Tenant, &e.IdempotencyKey, &e.Seq, &e.Channel, &e.ChannelSeq, &e.Payload, &created}, more...)...); err != nil {
		return store.OutboxEntry{}, err
	}
	e.CreatedAt = tm(created)
	return e, nil
}

// PendingOutbox implements store.Outbox.
func (s *Store) PendingOutbox(ctx context.Context, limit int) ([]store.PendingOutbox, error) {
	rows, err := s.d.Read().Query(ctx, `SELECT `+outboxCols+`, c.relayed_seq, c.stream_seq, c.relayed_key, c.relayed_ms
		FROM outbox_channels c JOIN outbox o ON o.tenant = c.tenant AND o.channel = c.channel AND o.channel_seq > c.relayed_seq
		WHERE c.written_seq > c.relayed_seq ORDER BY o.id LIMIT $1`, pageLimit(limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.PendingOutbox
	for rows.Next() {
		var (
			p         store.PendingOutbox
			streamSeq int64
			relayed   int64
		)
		p.OutboxEntry, err = scanOutbox(rows, &p.Cursor.RelayedSeq, &streamSeq, &p.Cursor.MsgID, &relayed)
		if err != nil {
			return nil, err
		}
		p.Cursor.StreamSeq, p.Cursor.RelayedAt = uint64(max(streamSeq, 0)), tm(relayed) //nolint:gosec // not negative
		out = append(out, p)
	}
	return out, rows.Err()
}

// AdvanceOutbox implements store.Outbox.
func (s *Store) AdvanceOutbox(ctx context.Context, l store.RelayLease, c store.CursorAdvance) error {
	if c.Tenant == "" || c.Channel == "" || c.To <= c.From || c.StreamSeq == 0 || c.MsgID == "" {
		return invalid("advance the outbox cursor of %s/%s from %d to %d (stream sequence %d, id %q)",
			c.Tenant, c.Channel, c.From, c.To, c.StreamSeq, c.MsgID)
	}
	if c.StreamSeq > 1<<62 {
		return invalid("stream sequence %d out of range", c.StreamSeq)
	}
	return s.d.Tx(ctx, func(q Querier) error {
		if err := s.relayFence(ctx, q, l); err != nil {
			return err
		}
		n, err := q.Exec(ctx, `UPDATE outbox_channels SET relayed_seq = $1, stream_seq = $2, relayed_key = $3, relayed_ms = $4
			WHERE tenant = $5 AND channel = $6 AND relayed_seq = $7 AND written_seq >= $1`,
			c.To, int64(c.StreamSeq), c.MsgID, s.nowMs(), c.Tenant, c.Channel, c.From) //nolint:gosec // checked above
		if err != nil || n == 1 {
			return err
		}
		var relayed, written int64
		err = q.QueryRow(ctx, `SELECT relayed_seq, written_seq FROM outbox_channels WHERE tenant = $1 AND channel = $2`,
			c.Tenant, c.Channel).Scan(&relayed, &written)
		if errors.Is(err, ErrNoRows) {
			return fmt.Errorf("%w: no outbox channel %s/%s", store.ErrNotFound, c.Tenant, c.Channel)
		}
		if err != nil {
			return err
		}
		return fmt.Errorf("%w: outbox channel %s/%s is relayed to %d of %d, not %d (advance to %d)",
			store.ErrConflict, c.Tenant, c.Channel, relayed, written, c.From, c.To)
	})
}

// ListOutboxRows implements store.Outbox.
func (s *Store) ListOutboxRows(ctx context.Context, q store.OutboxQuery) ([]store.OutboxRow, error) {
	pending := 0
	if q.OnlyPending {
		pending = 1
	}
	rows, err := s.d.Read().Query(ctx, `SELECT `+outboxCols+`, COALESCE(c.relayed_seq, 0)
		FROM outbox o LEFT JOIN outbox_channels c ON c.tenant = o.tenant AND c.channel = o.channel
		WHERE ($1 = '' OR o.tenant = $1) AND ($2 = '' OR o.channel = $2) AND o.id > $3
			AND ($4 = 0 OR o.channel_seq = 0 OR o.channel_seq > COALESCE(c.relayed_seq, 0))
		ORDER BY o.id LIMIT $5`, q.Tenant, q.Channel, q.After, pending, pageLimit(q.Limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.OutboxRow
	for rows.Next() {
		var relayed int64
		e, err := scanOutbox(rows, &relayed)
		if err != nil {
			return nil, err
		}
		out = append(out, store.OutboxRow{OutboxEntry: e, Relayed: e.ChannelSeq > 0 && e.ChannelSeq <= relayed})
	}
	return out, rows.Err()
}

// OutboxLag implements store.Outbox.
func (s *Store) OutboxLag(ctx context.Context) (int64, error) {
	var n int64
	err := s.d.Read().QueryRow(ctx, `SELECT CAST(COALESCE(SUM(written_seq - relayed_seq), 0) AS BIGINT) FROM outbox_channels`).Scan(&n)
	return n, err
}
