package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

// cmdStatus prints AdminService.Status: what an operator looks at before and after
// each step of the rollback order (docs/operations.md).
func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("status", stderr)
	var c common
	c.register(fs)
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "status", err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, "status", errors.New("takes no arguments"))
	}
	var st *adminv1.StatusResponse
	if code := adminCall(ctx, &c, stderr, "status", func(ctx context.Context, client adminv1.AdminServiceClient) (err error) {
		st, err = client.Status(ctx, &adminv1.StatusRequest{})
		return err
	}); code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, st)
		return ExitOK
	}
	printStatus(stdout, st, time.Now())
	return ExitOK
}

func printStatus(w io.Writer, st *adminv1.StatusResponse, now time.Time) {
	fmt.Fprintf(w, "replica %s\n", st.GetReplica())
	fmt.Fprintf(w, "orphan delta %d tokens in the last %s; dead letters %d\n", st.GetOrphanDelta(),
		st.GetOrphanWindow().AsDuration(), st.GetDeadLetterDepth())
	if len(st.GetUnreachable()) > 0 {
		fmt.Fprintf(w, "not reached: %s\n", strings.Join(st.GetUnreachable(), ", "))
	}
	cl := st.GetCluster()
	switch {
	case cl.GetDegraded():
		fmt.Fprintf(w, "cluster admission DEGRADED since %s: admitting up to this replica's share of each cap (%d replicas); last error: %s\n",
			cl.GetDegradedSince().AsTime().UTC().Format(time.RFC3339), cl.GetReplicas(), dash(cl.GetLastError()))
	case cl.GetEnabled():
		fmt.Fprintf(w, "cluster admission coordinated in the store (holder %s, %d replicas)\n", cl.GetHolder(), cl.GetReplicas())
	}
	if cl.GetLocalAdmits() > 0 || cl.GetSlotsLost() > 0 {
		fmt.Fprintf(w, "cluster admission: %d runs admitted on the local share, %d slots lost\n", cl.GetLocalAdmits(), cl.GetSlotsLost())
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	section := func(title, header string) {
		_ = tw.Flush()
		fmt.Fprintf(w, "\n%s\n", title)
		fmt.Fprintln(tw, header)
	}
	header := "POOL\tSTATE\tIN FLIGHT\tQUEUED\tOLDEST QUEUED\tWHY"
	if cl.GetEnabled() {
		header = "POOL\tSTATE\tIN FLIGHT\tCLUSTER\tQUEUED\tOLDEST QUEUED\tWHY"
	}
	section("POOLS", header)
	for _, p := range st.GetPools() {
		state := "open"
		if p.GetOperatorClosed() || p.GetAutoClosed() {
			state = "closed"
		}
		var why []string
		if p.GetOperatorClosed() {
			why = append(why, "operator "+dash(p.GetOperatorActor())+": "+dash(p.GetOperatorReason()))
		}
		if len(p.GetAutoConditions()) > 0 {
			a := "auto " + strings.Join(p.GetAutoConditions(), ",") + " until " + p.GetAutoClosedUntil().AsTime().UTC().Format(time.RFC3339)
			if p.ForcedOpenUntil != nil {
				a += " (forced open until " + p.GetForcedOpenUntil().AsTime().UTC().Format(time.RFC3339) + ")"
			}
			why = append(why, a)
		}
		inFlight := fmt.Sprintf("%d/%d", p.GetInFlight(), p.GetMaxInFlight())
		if cl.GetEnabled() {
			held := "?" // the store did not answer
			if p.GetClusterInFlight() >= 0 {
				held = fmt.Sprint(p.GetClusterInFlight())
			}
			inFlight += "\t" + held + "/" + fmt.Sprint(p.GetMaxInFlight())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d/%d\t%s\t%s\n", p.GetPool(), state, inFlight, p.GetQueued(),
			p.GetMaxQueue(), p.GetOldestQueued().AsDuration().Round(time.Millisecond), dash(strings.Join(why, "; ")))
	}
	section("BREAKERS", "SERVICE\tREPLICA\tTARGET\tSTATE")
	for _, b := range st.GetBreakers() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", b.GetService(), b.GetReplica(), b.GetTarget(), b.GetState())
	}
	section("COORDINATION", "SERVICE\tREPLICA\tPART\tTARGET\tSTATE\tDETAIL")
	for _, c := range st.GetCoordination() {
		detail := c.GetDetail()
		if c.GetDegraded() && c.Since != nil {
			detail += " (since " + c.GetSince().AsTime().UTC().Format(time.RFC3339) + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.GetService(), c.GetReplica(), c.GetPart(), dash(c.GetTarget()),
			coordinationState(c, now), dash(detail))
	}
	section("DECODERS", "REPLICA\tTENANT\tRUN\tNODE\tMODEL\tAGE\tTOKENS")
	for _, l := range st.GetLeases() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\n", l.GetReplica(), l.GetTenant(), l.GetRunId(), l.GetNodeId(), l.GetModel(),
			l.GetAge().AsDuration().Round(time.Millisecond), l.GetTokens())
	}
	section("CONTROLS", "KIND\tTARGET\tSINCE\tBY\tREASON")
	for _, f := range st.GetFreezes() {
		target := "tenant " + f.GetTenant()
		if f.GetRunId() != "" {
			target = "run " + f.GetRunId()
		}
		fmt.Fprintf(tw, "freeze\t%s\t%s\t%s\t%s\n", target, f.GetFrozenAt().AsTime().UTC().Format(time.RFC3339), f.GetActor(), dash(f.GetReason()))
	}
	for _, d := range st.GetDrains() {
		target := "every run"
		if d.GetPool() != "" {
			target = "pool " + d.GetPool()
		}
		if d.CancelAt != nil {
			target += ", cancel at " + d.GetCancelAt().AsTime().UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "drain\t%s\t%s\t%s\t%s\n", target, d.GetStartedAt().AsTime().UTC().Format(time.RFC3339), d.GetActor(), dash(d.GetReason()))
	}
	section("CONFIGURATION", "SERVICE\tREPLICA\tCONFIG\tVERSION\tLOADED\tSEEN\tLAST ERROR")
	for _, c := range st.GetConfigs() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s ago\t%s\n", c.GetService(), c.GetReplica(), c.GetConfig(), c.GetVersion(),
			c.GetLoadedAt().AsTime().UTC().Format(time.RFC3339), now.Sub(c.GetSeenAt().AsTime()).Round(time.Second), dash(c.GetLastError()))
	}
	_ = tw.Flush()
}

// coordinationState is a coordinated limit's STATE in status: DEGRADED (the store cannot
// be asked), held (this replica holds the window or probe lease), elsewhere (another
// replica holds the probe lease), or coordinated.
func coordinationState(c *adminv1.Coordination, now time.Time) string {
	switch {
	case c.GetDegraded():
		return "DEGRADED"
	case c.GetHeld():
		return "held"
	case c.GetPart() == "breaker_probe" && c.Until != nil && c.GetUntil().AsTime().After(now):
		return "elsewhere"
	}
	return "coordinated"
}
