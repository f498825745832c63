package drill

import (
	"fmt"
	"math"
	"strings"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// bounds are the orphan tokens per decoder each defence allows, beyond the in-flight
// allowance: a cancel stops a decoder at its next token boundary (none); a lease lapse
// within one lease TTL of decode after the caller's last renewal.
func bounds(cfg Config) (cancelBound, leaseBound int64) {
	return 0, int64(math.Ceil(cfg.LeaseTTL.Seconds() * cfg.TPS))
}

// Verdict judges the rows: the VERDICT line and whether the drill passed (no
// leak beyond the bound of the defence in effect; a fault caught).
func Verdict(cfg Config, rows []Row) (string, bool) {
	cancelBound, leaseBound := bounds(cfg)
	var orphan, atCancel, atDeadline, streamed, ledger int64
	var ran, leaked, dup, lapsed, shedBy int
	var leakTasks []string
	cond := map[int]string{2: string(admission.ConditionSlowHeartbeat), 3: string(admission.ConditionRetryWithoutID)}[cfg.Fault]
	for _, r := range rows {
		orphan += r.OrphanTokenDelta
		atCancel += r.TokensAtCancel
		atDeadline += r.TokensAtDeadline
		streamed += r.StreamedTokens
		if r.RunID != "" {
			ran++
			ledger += r.TokensAtDeadline
		}
		if r.DuplicateInFlight > 0 {
			dup++
		}
		if strings.Contains(r.StoppedBy, "lease_expired") {
			lapsed++
		}
		if cond != "" && strings.Contains(r.ShedReason, cond) {
			shedBy++
		}
		bound := cancelBound * int64(max(r.Decoders, 1))
		if cfg.Fault == 1 && r.Criticality == "sheddable" || cfg.Fault == 5 {
			bound += leaseBound
		}
		if r.OrphanTokenDelta > bound {
			leaked++
			leakTasks = append(leakTasks, r.Task)
		}
	}
	avg := func(v int64) int64 {
		if ran == 0 {
			return 0
		}
		return v / int64(ran)
	}
	if cfg.Mode == "orphan" {
		if leaked > 0 {
			return fmt.Sprintf("orphan decode after cancel: %d of %d tasks decoded %d tokens after the client's cancel (per task: tokens_at_cancel ≈ %d, tokens_at_deadline ≈ %d); propagation was off",
				leaked, len(rows), orphan, avg(atCancel), avg(atDeadline)), false
		}
		return fmt.Sprintf("unexpected shed: the orphan baseline leaked nothing (%d orphan tokens)", orphan), false
	}
	if cfg.Fault == 0 {
		if leaked == 0 && dup == 0 {
			return fmt.Sprintf("shed within grace: %d tasks, %d orphan tokens (bound %d per decoder), no duplicate decoder; tokens_at_cancel ≈ %d per task",
				len(rows), orphan, cancelBound, avg(atCancel)), true
		}
		return fmt.Sprintf("cancel missed: %d tasks leaked %d orphan tokens (%s), %d with a duplicate decoder", leaked, orphan, strings.Join(leakTasks, ","), dup), false
	}
	f := faults[cfg.Fault]
	head := fmt.Sprintf("fault %d (%s)", cfg.Fault, f.name)
	within := fmt.Sprintf("%d orphan tokens", orphan)
	if leaked > 0 {
		return fmt.Sprintf("%s NOT caught: %d tasks leaked beyond the bound (%s), %s", head, leaked, strings.Join(leakTasks, ","), within), false
	}
	sheddable := 0
	for _, r := range rows {
		if r.Criticality == "sheddable" {
			sheddable++
		}
	}
	switch cfg.Fault {
	case 1:
		if lapsed < sheddable {
			return fmt.Sprintf("%s NOT caught by the lease: %d of %d overflow decoders stopped by a lease lapse (the deadline or nothing stopped the rest); %s", head, lapsed, sheddable, within), false
		}
		return fmt.Sprintf("%s caught by %s: %d overflow decoders, whose cancel was dropped, stopped by themselves when their lease lapsed; cost %d orphan tokens (bound %d per decoder: one lease TTL of %v at %v tokens/s)",
			head, f.defence, lapsed, orphan, leaseBound, cfg.LeaseTTL, cfg.TPS), true
	case 2, 3:
		if shedBy < sheddable {
			return fmt.Sprintf("%s NOT caught: %d of %d overflow tasks shed with pool_closed (%s)", head, shedBy, sheddable, cond), false
		}
		return fmt.Sprintf("%s caught by %s: %d overflow tasks shed with pool_closed (%s) before any decode; the paid tasks ran and were cancelled; cost %d orphan tokens",
			head, f.defence, shedBy, cond, orphan), true
	case 4:
		if streamed <= ledger {
			return fmt.Sprintf("%s NOT caught: the per-task ledger (%d tokens) agrees with the %d tokens the decoders streamed", head, ledger, streamed), false
		}
		return fmt.Sprintf("%s caught by %s: the per-task ledger holds %d tokens where the decoders streamed %d; cost %d tokens unattributed to any task; %s",
			head, f.defence, ledger, streamed, streamed-ledger, within), true
	case 5:
		if dup == 0 || lapsed < dup {
			return fmt.Sprintf("%s NOT caught: %d tasks had a second decoder, %d stopped by a lease lapse", head, dup, lapsed), false
		}
		return fmt.Sprintf("%s caught by %s (retry-id dedupe was off): %d tasks had a second decoder of the same retry-id, each stopped when its unrenewed lease lapsed; cost %d orphan tokens (bound %d per decoder), %d tokens in all",
			head, f.defence, dup, orphan, leaseBound, atDeadline), true
	}
	return head, false
}
