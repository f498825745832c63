package drill

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func ts(t0 time.Time, d time.Duration) *timestamppb.Timestamp { return timestamppb.New(t0.Add(d)) }

// A row from a run summary: tokens summed over the model nodes, the slack on arrival,
// the lease age derived from the keeper's rule, duplicates from overlapping attempts of
// one retry-id, and the run's cause.
func TestComputeRow(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	cfg := Config{Heartbeat: 4 * time.Second, LeaseTTL: 8 * time.Second, TPS: 40, Deadline: 12 * time.Second}
	run := &orchestratorv1.Run{RunId: "r1", Cause: meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT, CancelledAt: ts(t0, 3500*time.Millisecond),
		Nodes: []*meshv1.Node{
			{Id: "root", Kind: meshv1.NodeKind_NODE_KIND_RUN},
			{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL, RetryId: "rid", Attempt: 2,
				StartedAt: ts(t0, 50*time.Millisecond), EndedAt: ts(t0, 3510*time.Millisecond), Deadline: ts(t0, 12*time.Second),
				Tokens: 139, TokensAtCancel: 138, TokensAfterCancel: 1, Cause: meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT,
				EarlierAttempts: []*meshv1.AttemptRecord{{Attempt: 1, RetryId: "rid", StartedAt: ts(t0, 10*time.Millisecond), EndedAt: ts(t0, 20*time.Millisecond)}}},
			// no-dedupe's leftover of attempt 1, overlapping attempt 2, stopped by its lease.
			{Id: "root/m0~a1", Kind: meshv1.NodeKind_NODE_KIND_MODEL, RetryId: "rid",
				StartedAt: ts(t0, 10*time.Millisecond), EndedAt: ts(t0, 8010*time.Millisecond),
				Tokens: 320, TokensAtCancel: 140, TokensAfterCancel: 180, Cause: meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED},
		}}
	var row Row
	computeRow(&row, run, time.Time{}, cfg)
	if row.RetryID != "rid" || row.DeadlineSlackMS != 11950 || row.Decoders != 2 {
		t.Errorf("retry_id %q, slack %d, decoders %d", row.RetryID, row.DeadlineSlackMS, row.Decoders)
	}
	if row.TokensAtCancel != 278 || row.TokensAtDeadline != 459 || row.OrphanTokenDelta != 179 || row.TokensAfterCancel != 181 {
		t.Errorf("tokens at cancel %d, at deadline %d, orphan %d, after cancel %d", row.TokensAtCancel, row.TokensAtDeadline, row.OrphanTokenDelta, row.TokensAfterCancel)
	}
	// Renewals every min(4s, remaining/3): the first would come at 50ms + 3.98s, after
	// the cancel, so the lease is as old as the decoder.
	if row.LeaseAgeMS != 3450 {
		t.Errorf("lease_age_ms %d, want 3450", row.LeaseAgeMS)
	}
	if row.DuplicateInFlight != 1 || row.ShedReason != "client_disconnect" || !strings.Contains(row.StoppedBy, "lease_expired") {
		t.Errorf("duplicate_in_flight %d, shed_reason %q, stopped_by %q", row.DuplicateInFlight, row.ShedReason, row.StoppedBy)
	}

	// Attempts that follow each other are not duplicates.
	if n := maxOverlap([]span{{t0, t0.Add(time.Second)}, {t0.Add(time.Second), t0.Add(2 * time.Second)}}); n != 1 {
		t.Errorf("back-to-back attempts overlap %d, want 1", n)
	}
}

func TestDrillVerdict(t *testing.T) {
	cfg := Config{Mode: "shed", Heartbeat: 4 * time.Second, LeaseTTL: 8 * time.Second, TPS: 40}
	// One in-flight token after the cancel is not an orphan (orphan_token_delta 0).
	rows := []Row{{Task: "t-0", Criticality: "critical", RunID: "a", Decoders: 1, OrphanTokenDelta: 0, TokensAfterCancel: 1, TokensAtCancel: 138, TokensAtDeadline: 139}}
	if v, ok := Verdict(cfg, rows); !ok || !strings.HasPrefix(v, "shed within grace") {
		t.Errorf("one in-flight token: %q %v", v, ok)
	}
	rows[0].OrphanTokenDelta, rows[0].TokensAfterCancel = 1, 2
	if v, ok := Verdict(cfg, rows); ok || !strings.HasPrefix(v, "cancel missed") {
		t.Errorf("one orphan token: %q %v", v, ok)
	}
	cfg.Mode = "orphan"
	rows[0].OrphanTokenDelta, rows[0].TokensAtDeadline = 339, 477
	if v, ok := Verdict(cfg, rows); ok || !strings.HasPrefix(v, "orphan decode after cancel") {
		t.Errorf("orphan: %q %v", v, ok)
	}
	cfg.Mode, cfg.Fault = "shed", 4
	rows[0].OrphanTokenDelta, rows[0].TokensAtDeadline, rows[0].TokensAtCancel, rows[0].StreamedTokens = 0, 0, 0, 135
	if v, ok := Verdict(cfg, rows); !ok || !strings.Contains(v, "caught by ledger keying") {
		t.Errorf("fault 4: %q %v", v, ok)
	}
}
