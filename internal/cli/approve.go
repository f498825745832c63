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

const approveUsage = `Usage:
  curfew approve RUN NODE [--tenant T] [--reason R] [--json]
  curfew deny    RUN NODE [--tenant T] [--reason R] [--json]

Decides a tool call that waits for a human's approval (docs/operations.md, "Approval
gates"): approve lets its effect happen, once; deny ends it without the effect, and the
model (or the plan's step) gets the denial, with the reason, as the tool's result. The
first decision stands: the same decision again changes nothing, the other one fails
(FAILED_PRECONDITION), as does any decision after the wait timed out or was cancelled.
NODE is the tool's node id (curfew approvals ls, curfew get RUN). --tenant may be left
out when the run id names one tenant's run. A tenant may require the approver to
differ from whoever started the run (PERMISSION_DENIED otherwise).
`

const approvalsUsage = `Usage:
  curfew approvals ls [--all] [--tenant T] [--run ID] [--json]

Tool calls waiting for a human's approval, oldest first: the run, the node, the tool,
why it needs approval (registry, destructive_hint, plan), when its wait ends (the run's
deadline less the tool's minimum time) and who started the run. --all lists decided,
timed-out and cancelled requests too.
`

// cmdApprove is curfew approve and curfew deny.
func cmdApprove(approve bool) func(context.Context, []string, io.Writer, io.Writer) int {
	name := "deny"
	if approve {
		name = "approve"
	}
	return func(ctx context.Context, args []string, stdout, stderr io.Writer) int {
		fs := newFlags(name, stderr)
		var c common
		c.register(fs)
		tenant := fs.String("tenant", "", "the run's tenant (default: the one tenant with a run of that id)")
		reason := fs.String("reason", "", "why, for the audit log and the tool's result")
		pos, err := parse(fs, args)
		if err != nil {
			return usageErr(stderr, name, err)
		}
		if len(pos) != 2 {
			return usageErr(stderr, name, errors.New("give RUN and NODE\n\n"+strings.TrimSuffix(approveUsage, "\n")))
		}
		var resp *adminv1.DecideApprovalResponse
		if code := adminCall(ctx, &c, stderr, name, func(ctx context.Context, client adminv1.AdminServiceClient) (err error) {
			resp, err = client.DecideApproval(ctx, &adminv1.DecideApprovalRequest{RunId: pos[0], NodeId: pos[1], Approve: approve,
				Reason: *reason, Tenant: *tenant})
			return err
		}); code != ExitOK {
			return code
		}
		if c.json {
			printJSON(stdout, resp)
			return ExitOK
		}
		a := resp.GetApproval()
		fmt.Fprintf(stdout, "%s %s: %s %s by %s\n", a.GetRunId(), a.GetNodeId(), a.GetTool(), stateName(a.GetState()), a.GetDecidedBy())
		return ExitOK
	}
}

// cmdApprovals is curfew approvals ls.
func cmdApprovals(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	_, args, code, ok := subcommand("approvals", approvalsUsage, []string{"ls"}, args, stdout, stderr)
	if !ok {
		return code
	}
	fs := newFlags("approvals ls", stderr)
	var c common
	c.register(fs)
	all := fs.Bool("all", false, "list decided, timed-out and cancelled requests too")
	tenant := fs.String("tenant", "", "one tenant (default: every tenant)")
	run := fs.String("run", "", "one run")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "approvals ls", err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, "approvals ls", errors.New("takes no arguments"))
	}
	var resp *adminv1.ListApprovalsResponse
	if code := adminCall(ctx, &c, stderr, "approvals ls", func(ctx context.Context, client adminv1.AdminServiceClient) (err error) {
		resp, err = client.ListApprovals(ctx, &adminv1.ListApprovalsRequest{PendingOnly: !*all, Tenant: *tenant, RunId: *run})
		return err
	}); code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, resp)
		return ExitOK
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RUN\tNODE\tTENANT\tTOOL\tWHY\tSTATE\tEXPIRES\tSTARTED BY\tDECIDED BY")
	for _, a := range resp.GetApprovals() {
		exp := "-"
		if a.ExpiresAt != nil {
			exp = a.GetExpiresAt().AsTime().UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.GetRunId(), a.GetNodeId(), a.GetTenant(), a.GetTool(), a.GetWhy(),
			stateName(a.GetState()), exp, dash(a.GetRunStartedBy()), dash(a.GetDecidedBy()))
	}
	_ = tw.Flush()
	return ExitOK
}

// stateName is an approval state as operators read it: pending, approved, …
func stateName(s adminv1.ApprovalState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "APPROVAL_STATE_"))
}
