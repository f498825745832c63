package storetest

import (
	"errors"
	"fmt"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// notify completes a new tool call of tenant under key with one Notify per channel.
func (e *env) notify(s store.Store, tenant, key string, channels ...string) {
	e.t.Helper()
	b := e.begin(s, tenant, key, "tr-a", time.Minute)
	wantOutcome(e.t, b, store.BeginStarted, "begin "+key)
	effects := make([]store.Effect, 0, len(channels))
	for i, c := range channels {
		effects = append(effects, store.Notify{Channel: c, Payload: fmt.Appendf(nil, "%s/%d", key, i)})
	}
	if err := s.CompleteTool(e.ctx, b.Claim, nil, effects...); err != nil {
		e.t.Fatalf("complete %s: %v", key, err)
	}
}

func (e *env) pending(limit int) []store.PendingOutbox {
	e.t.Helper()
	p, err := e.s.PendingOutbox(e.ctx, limit)
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

func (e *env) lag() int64 {
	e.t.Helper()
	n, err := e.s.OutboxLag(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

var outboxTests = map[string]func(*env){
	"PositionsPerChannelGapFree": func(e *env) {
		e.notify(e.s, tenantA, "c1", "ops", "dev", "ops")
		e.notify(e.s, tenantA, "c2", "ops")
		e.notify(e.s, tenantB, "c1", "ops")
		out, err := e.s.ListOutbox(e.ctx, tenantA, 0, 0)
		if err != nil || len(out) != 4 {
			e.t.Fatalf("outbox %+v %v", out, err)
		}
		want := []struct {
			ch  string
			pos int64
		}{{"ops", 1}, {"dev", 1}, {"ops", 2}, {"ops", 3}}
		for i, w := range want {
			if out[i].Channel != w.ch || out[i].ChannelSeq != w.pos {
				e.t.Fatalf("entry %d: %s at %d, want %s at %d", i, out[i].Channel, out[i].ChannelSeq, w.ch, w.pos)
			}
		}
		if b, _ := e.s.ListOutbox(e.ctx, tenantB, 0, 0); len(b) != 1 || b[0].ChannelSeq != 1 {
			e.t.Fatalf("another tenant's channel of the same name has its own positions: %+v", b)
		}
	},
	"ConcurrentWritersOneChannel": func(e *env) {
		const n = 10
		other := e.open()
		parallel(n, func(i int) {
			s := e.s
			if i%2 == 1 {
				s = other
			}
			b, err := s.BeginTool(e.ctx, store.ToolBegin{Tenant: tenantA, Key: fmt.Sprint("k", i), Owner: "tr", TTL: time.Minute})
			if err == nil {
				err = s.CompleteTool(e.ctx, b.Claim, nil, store.Notify{Channel: "ops", Payload: []byte("x")})
			}
			if err != nil {
				e.t.Errorf("writer %d: %v", i, err)
			}
		})
		out, _ := e.s.ListOutbox(e.ctx, tenantA, 0, 0)
		if len(out) != n {
			e.t.Fatalf("%d entries, want %d", len(out), n)
		}
		for i, o := range out { // by ID: positions follow, without gaps
			if o.ChannelSeq != int64(i+1) {
				e.t.Fatalf("entry %d (id %d) at position %d", i, o.ID, o.ChannelSeq)
			}
		}
		if e.lag() != n {
			e.t.Fatalf("lag %d, want %d", e.lag(), n)
		}
	},
	"RelayLeaseFenced": func(e *env) {
		a, err := e.s.ClaimOutboxRelay(e.ctx, "relay-a", 10*time.Second)
		if err != nil || a.Owner != "relay-a" || a.Epoch != 1 || !a.Expires.Equal(e.clock.Now().Add(10*time.Second)) {
			e.t.Fatalf("first claim %+v %v", a, err)
		}
		var held *store.LeaseHeldError
		if _, err := e.s.ClaimOutboxRelay(e.ctx, "relay-b", 10*time.Second); !errors.As(err, &held) || held.Owner != "relay-a" {
			e.t.Fatalf("claim while held: %v", err)
		}
		e.clock.Advance(5 * time.Second)
		if a, err = e.s.HeartbeatOutboxRelay(e.ctx, a, 10*time.Second); err != nil || !a.Expires.Equal(e.clock.Now().Add(10*time.Second)) {
			e.t.Fatalf("heartbeat %+v %v", a, err)
		}
		e.clock.Advance(11 * time.Second) // a's lease expired
		b, err := e.open().ClaimOutboxRelay(e.ctx, "relay-b", 10*time.Second)
		if err != nil || b.Epoch != 2 {
			e.t.Fatalf("claim after expiry %+v %v", b, err)
		}
		if _, err := e.s.HeartbeatOutboxRelay(e.ctx, a, time.Second); !errors.Is(err, store.ErrStaleEpoch) {
			e.t.Fatalf("stale heartbeat: %v", err)
		}
		e.notify(e.s, tenantA, "c1", "ops")
		adv := store.CursorAdvance{Tenant: tenantA, Channel: "ops", From: 0, To: 1, StreamSeq: 7, MsgID: "m"}
		if err := e.s.AdvanceOutbox(e.ctx, a, adv); !errors.Is(err, store.ErrStaleEpoch) {
			e.t.Fatalf("stale advance: %v", err)
		}
		if err := e.s.AdvanceOutbox(e.ctx, b, adv); err != nil {
			e.t.Fatal(err)
		}
		if err := e.s.ReleaseOutboxRelay(e.ctx, a); !errors.Is(err, store.ErrStaleEpoch) {
			e.t.Fatalf("stale release: %v", err)
		}
		if err := e.s.ReleaseOutboxRelay(e.ctx, b); err != nil {
			e.t.Fatal(err)
		}
		if c, err := e.s.ClaimOutboxRelay(e.ctx, "relay-a", time.Second); err != nil || c.Epoch != 3 {
			e.t.Fatalf("claim after release %+v %v", c, err)
		}
	},
	"PendingAdvanceList": func(e *env) {
		e.notify(e.s, tenantA, "c1", "ops", "dev")
		e.notify(e.s, tenantB, "c1", "ops")
		e.notify(e.s, tenantA, "c2", "ops")
		l, err := e.s.ClaimOutboxRelay(e.ctx, "relay", time.Minute)
		if err != nil {
			e.t.Fatal(err)
		}
		p := e.pending(0)
		if len(p) != 4 || e.lag() != 4 {
			e.t.Fatalf("%d pending, lag %d; want 4", len(p), e.lag())
		}
		for i := 1; i < len(p); i++ {
			if p[i].ID <= p[i-1].ID {
				e.t.Fatalf("pending not by ID: %+v", p)
			}
		}
		if first := p[0]; first.Tenant != tenantA || first.Channel != "ops" || first.ChannelSeq != 1 ||
			first.Cursor != (store.OutboxCursor{}) || string(first.Payload) != "c1/0" || first.IdempotencyKey != "c1" {
			e.t.Fatalf("first pending %+v", first)
		}
		if got := e.pending(2); len(got) != 2 {
			e.t.Fatalf("limit 2: %d", len(got))
		}
		adv := store.CursorAdvance{Tenant: tenantA, Channel: "ops", From: 0, To: 1, StreamSeq: 11, MsgID: "a/c1/0"}
		if err := e.s.AdvanceOutbox(e.ctx, l, adv); err != nil {
			e.t.Fatal(err)
		}
		if err := e.s.AdvanceOutbox(e.ctx, l, adv); !errors.Is(err, store.ErrConflict) {
			e.t.Fatalf("the same advance again: %v, want ErrConflict", err)
		}
		if err := e.s.AdvanceOutbox(e.ctx, l, store.CursorAdvance{Tenant: tenantA, Channel: "ops", From: 1, To: 3, StreamSeq: 12, MsgID: "x"}); !errors.Is(err, store.ErrConflict) {
			e.t.Fatalf("advance past the last written: %v, want ErrConflict", err)
		}
		if err := e.s.AdvanceOutbox(e.ctx, l, store.CursorAdvance{Tenant: tenantA, Channel: "nope", From: 0, To: 1, StreamSeq: 1, MsgID: "x"}); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("advance of an unknown channel: %v", err)
		}
		p = e.pending(0)
		if len(p) != 3 || e.lag() != 3 {
			e.t.Fatalf("%d pending, lag %d after one advance; want 3", len(p), e.lag())
		}
		var next store.PendingOutbox
		for _, x := range p {
			if x.Tenant == tenantA && x.Channel == "ops" {
				next = x
			}
		}
		if next.ChannelSeq != 2 || next.Cursor.RelayedSeq != 1 || next.Cursor.StreamSeq != 11 || next.Cursor.MsgID != "a/c1/0" ||
			!next.Cursor.RelayedAt.Equal(e.clock.Now()) {
			e.t.Fatalf("next on the channel %+v", next)
		}

		all, err := e.s.ListOutboxRows(e.ctx, store.OutboxQuery{})
		if err != nil || len(all) != 4 {
			e.t.Fatalf("all rows %+v %v", all, err)
		}
		relayed := 0
		for _, r := range all {
			if r.Relayed {
				relayed++
				if r.Tenant != tenantA || r.Channel != "ops" || r.ChannelSeq != 1 {
					e.t.Fatalf("relayed row %+v", r)
				}
			}
		}
		if relayed != 1 {
			e.t.Fatalf("%d relayed rows, want 1", relayed)
		}
		if rows, _ := e.s.ListOutboxRows(e.ctx, store.OutboxQuery{Tenant: tenantA, OnlyPending: true}); len(rows) != 2 {
			e.t.Fatalf("tenant A pending: %+v", rows)
		}
		if rows, _ := e.s.ListOutboxRows(e.ctx, store.OutboxQuery{Channel: "ops", After: all[0].ID, Limit: 1}); len(rows) != 1 || rows[0].Tenant != tenantB {
			e.t.Fatalf("ops after the first, one: %+v", rows)
		}
	},
}
