package outbox

import (
	"context"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Row is an outbox row as operators see it (`curfew outbox ls`, the admin API).
type Row struct {
	ID             int64     `json:"id"`
	Tenant         string    `json:"tenant"`
	Channel        string    `json:"channel"`
	ChannelSeq     int64     `json:"channel_seq"`
	Key            string    `json:"key"` // the message id on JetStream (MsgID)
	IdempotencyKey string    `json:"idempotency_key"`
	State          string    `json:"state"` // StateRelayed or StatePending
	Bytes          int       `json:"bytes"`
	CreatedAt      time.Time `json:"created_at"`
}

// A row's relay state.
const (
	StateRelayed = "relayed"
	StatePending = "pending"
)

// List returns the rows q selects, by ascending ID, with their relay state.
func List(ctx context.Context, st store.Outbox, q store.OutboxQuery) ([]Row, error) {
	rows, err := st.ListOutboxRows(ctx, q)
	if err != nil {
		return nil, err
	}
	out := make([]Row, 0, len(rows))
	for _, r := range rows {
		state := StatePending
		if r.Relayed {
			state = StateRelayed
		}
		out = append(out, Row{ID: r.ID, Tenant: r.Tenant, Channel: r.Channel, ChannelSeq: r.ChannelSeq, Key: MsgID(r.OutboxEntry),
			IdempotencyKey: r.IdempotencyKey, State: state, Bytes: len(r.Payload), CreatedAt: r.CreatedAt})
	}
	return out, nil
}
